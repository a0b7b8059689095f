/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32 over a weight stored as *panels*: the
 * columns of the product in groups of PW (two vectors), each group's K x PW values contiguous, row k
 * after row k - 1 (verifier/layouts.py "panel"; N a multiple of PW). The weight is bfloat16 or
 * float16 (widened as it is loaded) or float32.
 *
 * A broadcast GEMM: R rows of x against one panel live in R x 2 vector accumulators; for k = 0, 1,
 * ..., K - 1 in order the panel's two vectors of row k are loaded once, x[m, k] is broadcast and
 * every accumulator takes one FMA. Each output is thus one lane holding the chain
 * fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), then + bias[n]: the same float32
 * operations whatever the number of rows it shares a pass with, the pass, the panel or the thread.
 * So the kernel is row invariant by construction for any row count (a one-token step computes one
 * row), and the thread count never changes a bit (threads split the panels, never K).
 *
 * Why panels: the rows of x are reused across a whole panel width per load (two vectors) where a
 * dot-product tile reuses them across a few weight rows, and no lane reduction ends each output.
 * On an AVX2 Zen 3 at two threads, against the row tiles of native_linear.c on the default model's
 * shapes: 1.2-1.6x faster at one row (each panel one contiguous stream), 1.5-1.8x at 4-64 rows
 * (scripts/bench_gemm.py measures it on any machine). A panel is widened as it is loaded, in every
 * pass: with at most R rows a pass, the widening is 1 in R of the FMAs.
 *
 * One row: three panels a pass (six independent FMA chains instead of two, so the FMA latency is
 * hidden). Many rows: passes of at most R rows (balanced: 16 rows go 6 + 5 + 5), rows of x taken in
 * blocks that stay in the L2 cache while the panels stream past.
 */
#include <stddef.h>
#include <stdlib.h>

#include "native_pool.h"
#include "native_vec.h"

#if defined(__AVX512F__)
#define VFMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
static inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
enum { R = 12 }; /* 24 accumulators, 2 panel vectors and a broadcast: 27 of 32 registers */
#elif defined(__FMA__) && defined(__AVX__)
#define VFMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
static inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
enum { R = 6 }; /* 12 accumulators, 2 panel vectors and a broadcast: 15 of 16 registers */
#else
static inline vf fma_lanes(vf a, vf b, vf c)
{
    for (int i = 0; i < VL; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
}
#define VFMA(a, b, c) fma_lanes(a, b, c)
static inline vf splat(float s)
{
    vf v;
    for (int i = 0; i < VL; i++) v[i] = s;
    return v;
}
enum { R = 6 };
#endif

/* A panel vector loaded once into a register for the rows that use it (GCC would fold the load into
 * each FMA: R loads, and R widenings, where one does). No effect on the arithmetic. */
#if defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif

enum { PW = 2 * VL }; /* a panel's width: its columns */

/* Software prefetch, one line per LINE_ROWS(W) panel rows: a thread's panels follow one another in
 * memory, so its weight is one stream, which the prefetch carries across the 4 KiB pages the
 * hardware prefetchers stop at. A one-row pass, quick per row, runs AHEAD bytes in front of each panel; a pass
 * of several rows, slower per row and made again for the next rows from the caches, brings in the
 * next panel as it goes. On an AVX2 Zen 3, one thread, weights not in the caches: one row 10-40%
 * faster than the hardware prefetchers alone (512 to 2048 bytes ahead alike), 4-16 rows 5-10%
 * faster a panel ahead than 1024 bytes ahead (scripts/bench_gemm.py). */
enum { AHEAD = 1024 };
#define LINE_ROWS(W) (64 / (sizeof(W) * PW) ? 64 / (sizeof(W) * PW) : 1)

typedef void (*pass_fn)(const float *restrict x, long K, const void *restrict p, float *restrict y, long ldy,
                        const float *restrict bias);

/* ROWS rows of x (row stride K) against one panel ``p``, into y (row stride ldy) and bias from the
 * panel's first column on (or NULL). One function per row count: the accumulators stay in registers. */
#define DEFPASS(T, W, ROWS)                                                                                \
    static void pass_##T##_##ROWS(const float *restrict x, long K, const void *restrict pv,               \
                                  float *restrict y, long ldy, const float *restrict bias)                 \
    {                                                                                                      \
        const W *p = pv;                                                                                   \
        vf a0[ROWS], a1[ROWS];                                                                             \
        for (int i = 0; i < ROWS; i++) a0[i] = a1[i] = (vf){0};                                            \
        for (long k = 0; k < K; k++, p += PW) {                                                            \
            if (!(k % LINE_ROWS(W))) __builtin_prefetch(p + K * PW, 0, 3); /* the next panel */            \
            vf w0 = load_##T(p), w1 = load_##T(p + VL);                                                    \
            KEEP_IN_REGISTER(w0);                                                                          \
            KEEP_IN_REGISTER(w1);                                                                          \
            for (int i = 0; i < ROWS; i++) {                                                               \
                const vf xb = splat(x[i * K + k]);                                                         \
                a0[i] = VFMA(xb, w0, a0[i]);                                                               \
                a1[i] = VFMA(xb, w1, a1[i]);                                                               \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < ROWS; i++) {                                                                   \
            if (bias) a0[i] += load_f32(bias), a1[i] += load_f32(bias + VL);                               \
            memcpy(y + i * ldy, &a0[i], sizeof(vf));                                                       \
            memcpy(y + i * ldy + VL, &a1[i], sizeof(vf));                                                  \
        }                                                                                                  \
    }

/* One row of x against GROUP neighbouring panels (``p`` and the ones after it), into y and bias from
 * the first panel's first column on: the same chain per output as a pass, GROUP times the chains in
 * flight (two per panel: one alone would wait on the FMA latency, not on memory). */
enum { GROUP = 3 };
#define DEFGROUP(T, W)                                                                                     \
    static void group_##T(const float *restrict x, long K, const void *restrict pv, float *restrict y,     \
                          const float *restrict bias)                                                      \
    {                                                                                                      \
        const W *p = pv;                                                                                   \
        vf a[GROUP][2];                                                                                    \
        for (int g = 0; g < GROUP; g++) a[g][0] = a[g][1] = (vf){0};                                       \
        for (long k = 0; k < K; k++) {                                                                     \
            const vf xb = splat(x[k]);                                                                     \
            for (int g = 0; g < GROUP; g++) {                                                              \
                const W *q = p + g * K * PW + k * PW;                                                      \
                if (!(k % LINE_ROWS(W))) __builtin_prefetch((const char *)q + AHEAD, 0, 3);                \
                a[g][0] = VFMA(xb, load_##T(q), a[g][0]);                                                  \
                a[g][1] = VFMA(xb, load_##T(q + VL), a[g][1]);                                             \
            }                                                                                              \
        }                                                                                                  \
        for (int g = 0; g < GROUP; g++)                                                                    \
            for (int j = 0; j < 2; j++) {                                                                  \
                if (bias) a[g][j] += load_f32(bias + g * PW + j * VL);                                     \
                memcpy(y + g * PW + j * VL, &a[g][j], sizeof(vf));                                         \
            }                                                                                              \
    }

#define DEFPASSES(T, W)                                                                                    \
    DEFPASS(T, W, 1) DEFPASS(T, W, 2) DEFPASS(T, W, 3) DEFPASS(T, W, 4) DEFPASS(T, W, 5) DEFPASS(T, W, 6) \
    DEFPASS(T, W, 7) DEFPASS(T, W, 8) DEFPASS(T, W, 9) DEFPASS(T, W, 10) DEFPASS(T, W, 11)               \
    DEFPASS(T, W, 12) DEFGROUP(T, W)
DEFPASSES(f32, float)
DEFPASSES(bf16, uint16_t)
DEFPASSES(f16, _Float16)

typedef void (*group_fn)(const float *restrict, long, const void *restrict, float *restrict, const float *restrict);

/* [type][rows]: the pass of that many rows (1..R); [type]: the one-row pass over GROUP panels. */
#define PASSES_OF(T)                                                                                       \
    {0, pass_##T##_1, pass_##T##_2, pass_##T##_3, pass_##T##_4, pass_##T##_5, pass_##T##_6, pass_##T##_7, \
     pass_##T##_8, pass_##T##_9, pass_##T##_10, pass_##T##_11, pass_##T##_12}
static const pass_fn PASSES[3][13] = {PASSES_OF(f32), PASSES_OF(bf16), PASSES_OF(f16)};
static const group_fn GROUPS[3] = {group_f32, group_bf16, group_f16};
static const long ESIZE[3] = {4, 2, 2};

int racer_panel_width(void) { return PW; }

/* Rows [0, M) of x against panel ``p`` of weight ``w`` (its columns from p * PW on), in balanced
 * passes of at most R rows. */
static void panel_rows(int type, const float *x, long M, long K, const char *w, const float *bias, float *y, long N,
                       long p)
{
    const char *panel = w + p * K * PW * ESIZE[type];
    const float *b = bias ? bias + p * PW : NULL;
    const long passes = (M + R - 1) / R;
    for (long m0 = 0, q = 0; q < passes; q++) {
        const long rows = (M - m0 + passes - q - 1) / (passes - q);
        PASSES[type][rows](x + m0 * K, K, panel, y + m0 * N + p * PW, N, b);
        m0 += rows;
    }
}

enum { X_BLOCK_BYTES = 256 << 10 }; /* rows of x the panels meet per sweep: L2-resident */
enum { MAX_WEIGHTS = 8 };

/* One racer_panel_many call over one block of x's rows, as its units read it. */
struct panel_call {
    int type;
    const float *x;
    long K;
    const void *const *w;
    const float *const *bias;
    float *const *y;
    const int64_t *N;
    const long *first;
    long per, m0, m;
};

/* Units [lo, hi) of work (a panel, or a group of panels for one row), counted across the weights. */
static void panel_body(void *ctx, long lo, long hi, int tid)
{
    const struct panel_call *c = ctx;
    const long K = c->K, per = c->per;
    (void)tid;
    for (long u = lo; u < hi; u++) {
        int i = 0;
        while (u >= c->first[i + 1]) i++;
        const long p = (u - c->first[i]) * per;
        const char *wi = c->w[i];
        if (per == GROUP && p + GROUP <= c->N[i] / PW)
            GROUPS[c->type](c->x, K, wi + p * K * PW * ESIZE[c->type], c->y[i] + p * PW,
                            c->bias[i] ? c->bias[i] + p * PW : NULL);
        else /* many rows, or one row's last panels past a whole group */
            for (long q = p; q < p + per && q < c->N[i] / PW; q++)
                panel_rows(c->type, c->x + c->m0 * K, c->m, K, wi, c->bias[i], c->y[i] + c->m0 * c->N[i], c->N[i], q);
    }
}

/* ``count`` weights against the same rows of x, in one parallel loop (their panels, or groups of
 * panels for one row, shared out among the threads as one list): y[i][M, N[i]] = x[M, K] @
 * w[i][N[i], K]^T (+ bias[i]). Each output is computed exactly as alone. 0, or -1 for a weight type
 * this build does not have, a count out of range or an N that is not a whole number of panels. */
int racer_panel_many(int count, int type, const float *x, const void *const *w, const float *const *bias,
                     float *const *y, const int64_t *N, long M, long K, int threads)
{
    long first[MAX_WEIGHTS + 1] = {0};
    if (type < F32 || type > F16 || count < 1 || count > MAX_WEIGHTS || M < 1) return -1;
    const long per = M == 1 ? GROUP : 1; /* panels a unit of work takes */
    for (int i = 0; i < count; i++) {
        if (N[i] % PW) return -1;
        first[i + 1] = first[i] + (N[i] / PW + per - 1) / per;
    }
    long mb = X_BLOCK_BYTES / (K * 4);
    mb = mb < R ? R : mb / R * R;
    const int nth = threads > 0 ? threads : 1;
    struct panel_call c = {type, x, K, w, bias, y, N, first, per};
    for (c.m0 = 0; c.m0 < M; c.m0 += mb) {
        c.m = M - c.m0 < mb ? M - c.m0 : mb;
        racer_pfor(first[count], (first[count] + nth - 1) / nth, nth, panel_body, &c);
    }
    return 0;
}

/* 0, or -1 (see racer_panel_many). ``type``: the weight's (0 float32, 1 bfloat16, 2 float16); x,
 * bias and y float32. */
int racer_linear_panel(int type, const float *x, const void *w, const float *bias, float *y, long M, long N, long K,
                       int threads)
{
    const int64_t n = N;
    return racer_panel_many(1, type, x, &w, &bias, &y, &n, M, K, threads);
}
