/* blake3 of many messages of at most 64 bytes, the first 8 bytes of each digest: what
 * short_blake3.py computes in numpy, one compression per message, here 16 messages at a time
 * (short_blake3.py builds, loads and calls this file; tests/test_split.py holds both to blake3).
 *
 * Why C: the data step decides the split of every block this way, and in numpy each of the
 * compression's ~1,400 word operations is a pass over an array, about 0.4 us a message; here
 * the 16 messages of a group sit in one vector register per word, about 25 ns a message.
 * Only 32-bit integer additions, xors and rotations: the bits are the same on any CPU, compiler
 * and vector width, so the result needs no place in the plan's numerics.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && !defined(BT_BASELINE_ONLY)
#define VECTORIZED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTORIZED
#endif

#define GROUP 16       /* messages compressed together, one per vector lane */
#define BLOCK_BYTES 64 /* one blake3 block: a message that is its own chunk and root */
#define ROUNDS 7

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
static const int PERMUTATION[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
enum { CHUNK_START = 1, CHUNK_END = 2, ROOT = 8 };

/* (a, b, c, d) of the quarter-round's eight calls in a round, in order; call i takes the
 * round's message words 2i and 2i + 1. */
static const int QUARTERS[8][4] = {{0, 4, 8, 12}, {1, 5, 9, 13},  {2, 6, 10, 14}, {3, 7, 11, 15},
                                   {0, 5, 10, 15}, {1, 6, 11, 12}, {2, 7, 8, 13},  {3, 4, 9, 14}};

/* One 32-bit word of each of the group's messages: GCC's and Clang's vector extension, which
 * each clone below compiles to its own registers (four SSE2, two AVX2 or one AVX-512). */
typedef uint32_t words __attribute__((vector_size(4 * GROUP)));

#define ROTATE_RIGHT(x, bits) (((x) >> (bits)) | ((x) << (32 - (bits))))

/* The quarter-round G on state words q[0..3], with message words *x and *y (by address: a vector
 * wider than the baseline ABI's registers is not passed by value). */
static inline void quarter(words v[16], const int q[4], const words *x, const words *y) {
    words a = v[q[0]], b = v[q[1]], c = v[q[2]], d = v[q[3]];
    a = a + b + *x;
    d = ROTATE_RIGHT(d ^ a, 16);
    c = c + d;
    b = ROTATE_RIGHT(b ^ c, 12);
    a = a + b + *y;
    d = ROTATE_RIGHT(d ^ a, 8);
    c = c + d;
    b = ROTATE_RIGHT(b ^ c, 7);
    v[q[0]] = a, v[q[1]] = b, v[q[2]] = c, v[q[3]] = d;
}

/* Messages `first` .. `first + taken - 1` (rows of `length` bytes), zero-padded to a block, as
 * 16 little-endian words of each message; lanes past `taken` stay zero. */
static void load_words(const uint8_t *messages, long first, long taken, long length, words m[16]) {
    memset(m, 0, sizeof(words) * 16);
    for (long lane = 0; lane < taken; lane++) {
        uint8_t block[BLOCK_BYTES] = {0};
        memcpy(block, messages + (first + lane) * length, (size_t)length);
        for (int word = 0; word < 16; word++) {
            const uint8_t *p = block + 4 * word;
            m[word][lane] = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        }
    }
}

/* The message words each round reads, by position: round r uses the words permuted r times. */
static void schedule(int order[ROUNDS][16]) {
    for (int word = 0; word < 16; word++) order[0][word] = word;
    for (int round = 1; round < ROUNDS; round++)
        for (int word = 0; word < 16; word++) order[round][word] = order[round - 1][PERMUTATION[word]];
}

/* out[i] = the first 8 bytes of blake3(messages[i]) as a little-endian number, for `count`
 * rows of `length` bytes (0 <= length <= 64; the caller checks). */
VECTORIZED void bt_digest_prefixes(const uint8_t *messages, long count, long length, uint64_t *out) {
    int order[ROUNDS][16];
    schedule(order);
    words start[16]; /* the compression's starting state, the same in every lane */
    memset(start, 0, sizeof start); /* the chunk counter, words 12 and 13, is 0 */
    for (int lane = 0; lane < GROUP; lane++) {
        for (int i = 0; i < 8; i++) start[i][lane] = IV[i];
        for (int i = 0; i < 4; i++) start[8 + i][lane] = IV[i];
        start[14][lane] = (uint32_t)length;
        start[15][lane] = CHUNK_START | CHUNK_END | ROOT;
    }
    for (long first = 0; first < count; first += GROUP) {
        long taken = count - first < GROUP ? count - first : GROUP;
        words m[16], v[16];
        load_words(messages, first, taken, length, m);
        memcpy(v, start, sizeof v);
        for (int round = 0; round < ROUNDS; round++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                quarter(v, QUARTERS[i], &m[order[round][2 * i]], &m[order[round][2 * i + 1]]);
        words low = v[0] ^ v[8], high = v[1] ^ v[9];
        for (long lane = 0; lane < taken; lane++) out[first + lane] = (uint64_t)low[lane] | (uint64_t)high[lane] << 32;
    }
}
