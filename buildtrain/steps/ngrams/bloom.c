/* The n-grams of normalised words in a stream of text, and the Bloom filter they are added to
   (`bloom.py` says what is hashed and why; its Python functions compute the same bits and are
   the fallback where no compiler builds this). Integer arithmetic only: the same bits on any CPU. */
#include <stdint.h>

#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
#define POLY 0x9e3779b97f4a7c15ULL
/* the state of a document read so far, shared with bloom.py */
enum { WORD, IN_WORD, WORDS, ROLLING, RING };
enum { SPACE = 256, SKIP = 257 }; /* a byte's class beyond its value */

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* class of each byte: 0 a word byte (value: the byte lowercased), 1 whitespace, 2 punctuation */
static int kind(uint8_t c) {
    if (c == ' ' || (c >= 9 && c <= 13)) return 1;
    if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return 2;
    return 0;
}

/* Reads `length` bytes of one document, writes the hash of each n-gram that ends in them to
   `out` (room for length / 2 + 1) and returns how many; `state` carries the document across
   calls. `power` is POLY**n. */
long bt_ngrams(const uint8_t *text, long length, uint64_t *state, long n, uint64_t power, uint64_t *out) {
    uint64_t word = state[WORD], in_word = state[IN_WORD], words = state[WORDS], rolling = state[ROLLING];
    uint64_t *ring = state + RING;
    long written = 0;
    uint16_t table[256]; /* a byte's class at a glance: a table lookup beat kind()'s branches */
    for (int c = 0; c < 256; c++)
        table[c] = kind((uint8_t)c) == 1 ? SPACE : kind((uint8_t)c) == 2 ? SKIP : (c >= 'A' && c <= 'Z') ? c + 32 : c;
    for (long i = 0; i < length; i++) {
        uint16_t c = table[text[i]];
        if (c < SPACE) {
            word = (word ^ c) * FNV_PRIME;
            in_word = 1;
        } else if (c == SPACE && in_word) {
            uint64_t slot = words % (uint64_t)n;
            rolling = rolling * POLY + word - (words >= (uint64_t)n ? ring[slot] * power : 0);
            ring[slot] = word;
            words += 1;
            if (words >= (uint64_t)n) out[written++] = mix(rolling + (uint64_t)n);
            word = FNV_OFFSET;
            in_word = 0;
        }
    }
    state[WORD] = word, state[IN_WORD] = in_word, state[WORDS] = words, state[ROLLING] = rolling;
    return written;
}

/* Sets the bits of `count` hashes in a filter of `blocks` blocks (a power of two) of 8 words. */
void bt_bloom_add(uint64_t *filter, long blocks, const uint64_t *hashes, long count) {
    for (long i = 0; i < count; i++) {
        uint64_t h = hashes[i], bits = mix(h ^ POLY);
        uint64_t *block = filter + 8 * ((h >> 9) & (uint64_t)(blocks - 1));
        if (i + 16 < count) /* the block 16 hashes ahead: its cache miss overlaps this work */
            __builtin_prefetch(filter + 8 * ((hashes[i + 16] >> 9) & (uint64_t)(blocks - 1)), 1);
        for (int j = 0; j < 7; j++) {
            uint64_t at = (bits >> (9 * j)) & 511;
            block[at >> 6] |= 1ULL << (at & 63);
        }
        block[(h & 511) >> 6] |= 1ULL << (h & 63);
    }
}
