/* The two sums of a tensor's fingerprint (fingerprint.py defines them), in one pass over its words.
 *
 * Integer arithmetic only, so the result is the same in any order and on any machine: every sum is
 * unsigned 64-bit, which wraps modulo 2**64 by the language's definition (signed overflow would not
 * be defined); the plain sum is exact anyway. The words are read as rows of RUN: per column c,
 * `total[c]` sums the column and `later[c]` adds, before each row, the column's total so far, so
 * that it ends as the sum of (rows - 1 - r) x word over rows r. Both are additions only, which the
 * compiler vectorizes (64-bit multiplies have no AVX2 instruction); the weights are applied once
 * per column at the end: position r * RUN + c, sum of r x word = (rows - 1) x total - later. */
#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__)
/* Wider vectors where the CPU has them; integer sums, so every clone gives the same result. */
#define VECTORIZED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTORIZED
#endif

#define RUN 256

#define FINGERPRINT(TYPE)                                                                          \
    const TYPE *w = words;                                                                         \
    for (long r = 0; r < rows; r++) {                                                              \
        const TYPE *row = w + r * RUN;                                                             \
        for (long c = 0; c < RUN; c++) {                                                           \
            later[c] += total[c];                                                                  \
            total[c] += (uint64_t)(int64_t)row[c];                                                 \
        }                                                                                          \
    }                                                                                              \
    for (long q = rows * RUN; q < n; q++) { /* the last, partial row */                            \
        uint64_t x = (uint64_t)(int64_t)w[q];                                                      \
        sum += x;                                                                                  \
        weight += (uint64_t)(q + 1) * x;                                                           \
    }

/* out[0] = sum of the words, out[1] = sum of (position + 1) x word, modulo 2**64 (as int64 bits).
 * width: 4 (int32 words), 2 (int16) or 1 (uint8). */
VECTORIZED void bt_fingerprint(const void *words, long n, long width, int64_t *out) {
    uint64_t total[RUN] = {0}, later[RUN] = {0}, sum = 0, weight = 0;
    long rows = n / RUN;
    if (width == 4) {
        FINGERPRINT(int32_t)
    } else if (width == 2) {
        FINGERPRINT(int16_t)
    } else {
        FINGERPRINT(uint8_t)
    }
    for (long c = 0; c < RUN; c++) {
        uint64_t weighted_rows = (uint64_t)(rows - 1) * total[c] - later[c]; /* sum of r x word */
        sum += total[c];
        weight += (uint64_t)(c + 1) * total[c] + (uint64_t)RUN * weighted_rows;
    }
    out[0] = (int64_t)sum;
    out[1] = (int64_t)weight;
}
