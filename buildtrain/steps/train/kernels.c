/* The model's element-wise work on the CPU, fused: RMSNorm, SwiGLU and RoPE, forward and backward,
 * and AdamW's update, float32, contiguous rows (see kernels.py, which builds, loads and calls this
 * file).
 *
 * Why: in eager torch each of these is a chain of kernels, each a full pass over the activations
 * with its own dispatch; here each is one pass (issue 26). Why the bits are a function of this
 * file alone: every operation is a single IEEE-754 float operation in the order written
 * (kernels.py compiles with -ffp-contract=off and without -ffast-math, so the compiler may neither
 * fuse a multiply-add nor reorder a sum), sums run in a fixed order of eight lanes that does not
 * depend on the vector width, and exp is computed here rather than taken from a maths library.
 * So the SSE2 and AVX2 clones below, and any conforming compiler, give the same bits.
 *
 * Why the thread count cannot change them either: a call's work is cut into contiguous ranges of
 * rows (or elements), one per thread (`parallel`), and every output is computed from its own row
 * (element) alone, in the same order whoever computes it. The one sum across rows, RMSNorm's weight
 * gradient, runs on one thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && !defined(BT_BASELINE_ONLY)
#define VECTORIZED __attribute__((target_clones("avx2", "default")))
/* AdamW's lerp is a fused multiply-add (torch's, matched bit for bit): a clone with FMA units. */
#define VECTORIZED_FMA __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTORIZED
#define VECTORIZED_FMA
#endif

#define LANES 8
#define CHUNK 256        /* elements per block of SwiGLU's exp, kept in L1 */
#define GRAIN 16384      /* elements a thread is worth starting for (tens of microseconds of work) */

/* A range [begin, end) of a call's work, and the function that does it. */
typedef void (*part_fn)(const void *call, long begin, long end);

/* How many contiguous ranges `parallel` cuts [0, n) into: at most `threads`, and no more than the
 * work is worth (`cost` elements per unit of n, GRAIN elements a thread); one without OpenMP.
 * Exported for the tests, which check that their large calls are split. */
long bt_parallel_parts(long n, long cost, long threads) {
#ifdef _OPENMP
    long worth = n * cost / GRAIN;
    long parts = threads < worth ? threads : worth;
    return parts < 1 ? 1 : parts > n ? n : parts;
#else
    (void)n, (void)cost, (void)threads;
    return 1;
#endif
}

/* fn over [0, n), one range per thread. The threads are OpenMP's: built with -fopenmp, this
 * library shares the OpenMP runtime torch has loaded (libgomp.so.1), so its team is the one
 * torch's own kernels just used, still awake (threads of our own would wait for a core while that
 * team spins). Without OpenMP the one range runs on the calling thread, with the same results. */
static void parallel(part_fn fn, const void *call, long n, long cost, long threads) {
    long parts = bt_parallel_parts(n, cost, threads);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (long i = 0; i < parts; i++) fn(call, n * i / parts, n * (i + 1) / parts);
}

/* The eight lanes of a sum, added pairwise, then its tail: one order, whatever the vector width. */
static inline float total(const float *lane, float tail) {
    return (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) + tail;
}

/* sum(a[i] * b[i]) in eight lanes (element i in lane i mod 8). */
static inline float dot(const float *restrict a, const float *restrict b, long n) {
    float lane[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += a[i + l] * b[i + l];
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return total(lane, tail);
}

/* out = x * rstd * weight for rows [begin, end), rstd = 1 / sqrt(mean(x^2) + eps), kept for backward. */
VECTORIZED static void norm_forward_rows(const float *restrict x, const float *restrict weight, float *restrict out,
                                         float *restrict rstd, long width, float eps, long begin, long end) {
    for (long r = begin; r < end; r++) {
        const float *xr = x + r * width;
        float *o = out + r * width;
        float s = 1.0f / __builtin_sqrtf(dot(xr, xr, width) / (float)width + eps);
        rstd[r] = s;
        for (long j = 0; j < width; j++) o[j] = (xr[j] * s) * weight[j];
    }
}

typedef struct {
    const float *x, *weight;
    float *out, *rstd;
    long width;
    float eps;
} norm_t;

static void norm_forward_part(const void *call, long begin, long end) {
    const norm_t *c = call;
    norm_forward_rows(c->x, c->weight, c->out, c->rstd, c->width, c->eps, begin, end);
}

void bt_rms_norm_forward(const float *x, const float *weight, float *out, float *rstd, long rows, long width,
                         float eps, long threads) {
    norm_t call = {x, weight, out, rstd, width, eps};
    parallel(norm_forward_part, &call, rows, width, threads);
}

/* With n = x * rstd and gw = grad * weight: dx = rstd * (gw - n * mean(gw * n)); dweight is the sum
 * over rows of grad * n, added row after row. Products are recomputed rather than stored: a row is
 * in L1 by then, and there is no scratch buffer to size. One thread: the sum over rows could be
 * split by columns without changing a bit, but each thread would then read grad and x again, and
 * in a memory-bound pass that costs what the second thread saves (2,048 x 256 at two threads: 361
 * against 396 us on one; at one thread, 649 us). */
VECTORIZED void bt_rms_norm_backward(const float *restrict grad, const float *restrict x,
                                     const float *restrict weight, const float *restrict rstd,
                                     float *restrict dx, float *restrict dweight, long rows, long width) {
    for (long j = 0; j < width; j++) dweight[j] = 0.0f;
    for (long r = 0; r < rows; r++) {
        const float *g = grad + r * width, *xr = x + r * width;
        float *d = dx + r * width;
        float s = rstd[r];
        float lane[LANES] = {0};
        long j = 0;
        for (; j + LANES <= width; j += LANES)
            for (int l = 0; l < LANES; l++) lane[l] += (g[j + l] * weight[j + l]) * (xr[j + l] * s);
        float tail = 0.0f;
        for (; j < width; j++) tail += (g[j] * weight[j]) * (xr[j] * s);
        float mean = total(lane, tail) / (float)width;
        for (j = 0; j < width; j++) {
            float n = xr[j] * s;
            d[j] = s * (g[j] * weight[j] - n * mean);
            dweight[j] += g[j] * n;
        }
    }
}

/* exp(x) for float32: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial
 * (error below 5e-9 relative), 2^k built in the exponent bits. x is clamped to [-87, 89]: below,
 * 2^k would leave the normal floats (and exp(-87) already vanishes beside 1, all SwiGLU adds it
 * to); above 88.4, k = 128 builds +inf, as exp overflows there (from 88.72 exactly). A NaN becomes
 * -87 here; SwiGLU still returns NaN, from its other factor. */
static inline float exp_clamped(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 89.0f ? x : 89.0f;
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float k = (x * 1.44269504f + shift) - shift;
    float r = (x - k * 0.693145752f) - k * 1.42860677e-6f; /* ln 2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120
              + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp(-a) for a block, computed apart from its use: fused into one loop, the compiler evaluates
 * the use for the clamped constants too, and those divisions make denormals that cost 10x. */
static inline void exp_negated(const float *restrict a, float *restrict e, long m) {
    for (long i = 0; i < m; i++) e[i] = exp_clamped(-a[i]);
}

/* out = silu(a) * b, silu(a) = a / (1 + exp(-a)), for elements [begin, end). */
VECTORIZED static void swiglu_forward_range(const float *restrict a, const float *restrict b, float *restrict out,
                                            long begin, long end) {
    float e[CHUNK];
    for (long start = begin; start < end; start += CHUNK) {
        long m = end - start < CHUNK ? end - start : CHUNK;
        const float *ac = a + start, *bc = b + start;
        float *o = out + start;
        exp_negated(ac, e, m);
        for (long i = 0; i < m; i++) o[i] = (ac[i] / (1.0f + e[i])) * bc[i];
    }
}

/* With s = sigmoid(a): db = grad * a * s; da = grad * b * s * (1 + a * (1 - s)). */
VECTORIZED static void swiglu_backward_range(const float *restrict grad, const float *restrict a,
                                             const float *restrict b, float *restrict da, float *restrict db,
                                             long begin, long end) {
    float e[CHUNK];
    for (long start = begin; start < end; start += CHUNK) {
        long m = end - start < CHUNK ? end - start : CHUNK;
        const float *g = grad + start, *ac = a + start, *bc = b + start;
        float *dac = da + start, *dbc = db + start;
        exp_negated(ac, e, m);
        for (long i = 0; i < m; i++) {
            float s = 1.0f / (1.0f + e[i]);
            dbc[i] = g[i] * (ac[i] * s);
            dac[i] = (g[i] * bc[i]) * (s * (1.0f + ac[i] * (1.0f - s)));
        }
    }
}

typedef struct {
    const float *a, *b, *grad;
    float *out, *da, *db;
} swiglu_t;

static void swiglu_forward_part(const void *call, long begin, long end) {
    const swiglu_t *c = call;
    swiglu_forward_range(c->a, c->b, c->out, begin, end);
}

static void swiglu_backward_part(const void *call, long begin, long end) {
    const swiglu_t *c = call;
    swiglu_backward_range(c->grad, c->a, c->b, c->da, c->db, begin, end);
}

void bt_swiglu_forward(const float *a, const float *b, float *out, long n, long threads) {
    swiglu_t call = {.a = a, .b = b, .out = out};
    parallel(swiglu_forward_part, &call, n, 1, threads);
}

void bt_swiglu_backward(const float *grad, const float *a, const float *b, float *da, float *db, long n,
                        long threads) {
    swiglu_t call = {.a = a, .b = b, .grad = grad, .da = da, .db = db};
    parallel(swiglu_backward_part, &call, n, 1, threads);
}

/* Rotate-half RoPE of x (B, T, H, hs) into out (B, T, H, hs), each in its own strides for b, t and
 * h (channels contiguous), by tables cos and sin (T, hs), for positions [begin, end) of the
 * flattened (B, T): out = x * cos + swap_halves(x) * sin, two products and one sum per element. */
VECTORIZED static void rope_positions(float *restrict out, const float *restrict x, const float *restrict cos,
                                      const float *restrict sin, long T, long H, long hs, const long *stride,
                                      long begin, long end) {
    long half = hs / 2, xb = stride[0], xt = stride[1], xh = stride[2], ob = stride[3], ot = stride[4],
         oh = stride[5];
    for (long p = begin; p < end; p++) {
        long b = p / T, t = p % T;
        const float *c = cos + t * hs, *s = sin + t * hs;
        for (long h = 0; h < H; h++) {
            const float *restrict xi = x + b * xb + t * xt + h * xh;
            float *restrict o = out + b * ob + t * ot + h * oh;
            for (long i = 0; i < half; i++) {
                o[i] = xi[i] * c[i] + xi[i + half] * s[i];
                o[i + half] = xi[i + half] * c[i + half] + xi[i] * s[i + half];
            }
        }
    }
}

typedef struct {
    float *out;
    const float *x, *cos, *sin;
    long T, H, hs, stride[6]; /* x's along b, t and h, then out's */
} rope_t;

static void rope_part(const void *call, long begin, long end) {
    const rope_t *c = call;
    rope_positions(c->out, c->x, c->cos, c->sin, c->T, c->H, c->hs, c->stride, begin, end);
}

void bt_rope(float *out, const float *x, const float *cos, const float *sin, long B, long T, long H, long hs,
             long xb, long xt, long xh, long ob, long ot, long oh, long threads) {
    rope_t call = {out, x, cos, sin, T, H, hs, {xb, xt, xh, ob, ot, oh}};
    parallel(rope_part, &call, B * T, H * hs, threads);
}

/* One AdamW update of n elements, in the operations and order of torch's single-tensor AdamW on a
 * float32 CPU tensor (optimizer.py writes them out with torch._foreach_*), so the same bits, in one
 * pass instead of eight. Every element is computed alike, whatever its position: a shard of a
 * tensor updates exactly as that part of the whole tensor does. The scalars come in as the float32
 * values torch would convert them to. Two steps are torch's fused multiply-adds: lerp(m, g, w), from
 * the nearer end, and addcmul (fmaf is exactly rounded with or without FMA units, so every clone
 * agrees). */
typedef struct {
    float *p, *m, *v;
    const float *g;
    float decay, w, beta2, c, correction, eps, step; /* step: minus the step size */
} adamw_t;

VECTORIZED_FMA static void adamw_range(const adamw_t *a, long begin, long end) {
    float *restrict p = a->p, *restrict m = a->m, *restrict v = a->v;
    const float *restrict g = a->g;
    int near = fabsf(a->w) < 0.5f;
    float coefficient = near ? a->w : a->w - 1.0f;
    for (long i = begin; i < end; i++) {
        float weight = p[i] * a->decay;
        float moment = fmaf(coefficient, g[i] - m[i], near ? m[i] : g[i]);
        float square = fmaf(a->c * g[i], g[i], v[i] * a->beta2); /* torch's addcmul: one rounding */
        float denominator = sqrtf(square) / a->correction + a->eps;
        m[i] = moment;
        v[i] = square;
        p[i] = weight + a->step * moment / denominator;
    }
}

static void adamw_part(const void *call, long begin, long end) {
    adamw_range(call, begin, end);
}

void bt_adamw(float *p, const float *g, float *m, float *v, long n, float decay, float w, float beta2, float c,
              float correction, float eps, float step, long threads) {
    adamw_t call = {p, m, v, g, decay, w, beta2, c, correction, eps, step};
    parallel(adamw_part, &call, n, 1, threads);
}
