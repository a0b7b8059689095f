/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, for the few rows a verification step has;
 * the weight float32, bfloat16 or float16 (widened as it is loaded: a one-token step, bound by the
 * bytes it reads, reads half of them in reduced precision).
 *
 * BLAS libraries pack the weight before a GEMM, which for a handful of rows reads and writes the
 * whole weight once more than the product itself needs. Here each weight row is streamed once per
 * call: a tile of NR weight rows is multiplied with MR rows of x in registers (NR x MR vector
 * accumulators over K, reduced at the end), passes over further rows of x find the tile in the
 * L1 cache, and the next tile is prefetched all the while. Threads (OpenMP: torch's own runtime
 * when loaded into its process) take contiguous ranges of weight rows.
 *
 * A row's result never depends on the other rows of the call: every output is the same sequence of
 * vector FMAs over K followed by the same reduction, whatever tile it falls in. So these kernels are
 * batch invariant by construction, with no chunking of rows, in every dtype.
 *
 * Built by verifier/native.py with -O3 -march=native: the vector width follows the CPU (256-bit on
 * AVX2, 512-bit with AVX-512), and the tuner measures which tile shape wins for each row count.
 */
#include <stddef.h>

#include "native_vec.h"

typedef void (*tile_fn)(const float *restrict x, const void *restrict w, const float *restrict bias,
                        float *restrict y, long N, long K, long n0, long m0, const void *next);

/* Weight rows [n0, n0 + NR) against x rows [m0, m0 + MR); ``next``: the following tile's first weight
 * row (NULL for the last tile), prefetched meanwhile, one line at a time, on every pass: a call of at
 * most MR rows makes one pass per tile, and the prefetch keeps the next tile's lines on their way
 * while it runs (one thread, 4 rows: ~20% faster than leaving the stream to the hardware prefetcher
 * alone). */
#define DEFTILE(T, W, NR, MR)                                                                              \
    static void tile_##T##_##NR##_##MR(const float *restrict x, const void *restrict wv_, const float *restrict bias, \
                                       float *restrict y, long N, long K, long n0, long m0, const void *next_)   \
    {                                                                                                      \
        const W *w = wv_, *next = next_;                                                                   \
        vf acc[NR][MR];                                                                                    \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                              \
        const long kv = K - K % VL;                                                                        \
        for (long k = 0; k < kv; k += VL) {                                                                \
            vf xv[MR];                                                                                     \
            for (int j = 0; j < MR; j++) xv[j] = load_f32(x + (m0 + j) * K + k);                           \
            if (next && !(k & (64 / sizeof(W) - 1)))                                                       \
                for (int i = 0; i < NR; i++) __builtin_prefetch(next + i * K + k, 0, 3);                   \
            for (int i = 0; i < NR; i++) {                                                                 \
                vf wv = load_##T(w + (n0 + i) * K + k);                                                    \
                for (int j = 0; j < MR; j++) acc[i][j] += wv * xv[j];                                      \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) {                                                                 \
                float s = reduce(acc[i][j]);                                                               \
                for (long k = kv; k < K; k++) s += one_##T(w + (n0 + i) * K + k) * x[(m0 + j) * K + k];    \
                y[(m0 + j) * N + n0 + i] = bias ? s + bias[n0 + i] : s;                                    \
            }                                                                                              \
    }

#define DEFTILES(T, W)                                                                                     \
    DEFTILE(T, W, 1, 1)                                                                                    \
    DEFTILE(T, W, 4, 1) DEFTILE(T, W, 4, 2) DEFTILE(T, W, 4, 3)                                            \
    DEFTILE(T, W, 6, 1) DEFTILE(T, W, 6, 2) DEFTILE(T, W, 6, 3) DEFTILE(T, W, 6, 4)                        \
    DEFTILE(T, W, 8, 1) DEFTILE(T, W, 8, 2) DEFTILE(T, W, 8, 3)

DEFTILES(f32, float)
DEFTILES(bf16, uint16_t)
DEFTILES(f16, _Float16)

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bfloat16 weights and rows of x multiplied in pairs by the CPU (AVX512-BF16 ``vdpbf16ps``: two
 * exact products added to each float32 lane, in a fixed order): no widening, twice the products per
 * instruction. The same instruction sequence for every output whatever the other rows, like the
 * tiles above; x is bfloat16 here (it is so in a bfloat16 forward). */
#define DEFTILE_DP(NR, MR)                                                                                 \
    static void tile_dp_##NR##_##MR(const float *restrict x_, const void *restrict wv_, const float *restrict bias, \
                                    float *restrict y, long N, long K, long n0, long m0, const void *next_) \
    {                                                                                                      \
        const uint16_t *x = (const uint16_t *)x_, *w = wv_, *next = next_;                                 \
        __m512 acc[NR][MR];                                                                                \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        const long kv = K - K % 32;                                                                        \
        for (long k = 0; k < kv; k += 32) {                                                                \
            __m512bh xv[MR];                                                                               \
            for (int j = 0; j < MR; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k);      \
            if (next)                                                                                      \
                for (int i = 0; i < NR; i++) __builtin_prefetch(next + i * K + k, 0, 3);                   \
            for (int i = 0; i < NR; i++) {                                                                 \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + i) * K + k);                          \
                for (int j = 0; j < MR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);           \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) {                                                                 \
                vf a;                                                                                      \
                memcpy(&a, &acc[i][j], sizeof a);                                                          \
                float s = reduce(a);                                                                       \
                for (long k = kv; k < K; k++) s += one_bf16(w + (n0 + i) * K + k) * one_bf16(x + (m0 + j) * K + k); \
                y[(m0 + j) * N + n0 + i] = bias ? s + bias[n0 + i] : s;                                    \
            }                                                                                              \
    }
DEFTILE_DP(1, 1)
DEFTILE_DP(6, 1) DEFTILE_DP(6, 2) DEFTILE_DP(6, 3) DEFTILE_DP(6, 4)
DEFTILE_DP(8, 1) DEFTILE_DP(8, 2) DEFTILE_DP(8, 3)
#define HAVE_DP 1
#else
#define HAVE_DP 0
#endif

enum { BF16_PAIRS = 3 }; /* beside F32, BF16, F16 (native_vec.h) */

struct variant {
    int nr, mr, type, esize;
    tile_fn one;      /* one weight row against one x row: a weight's last rows when NR does not divide */
    tile_fn tiles[5]; /* tiles[r]: r rows of x (1..mr) */
};

#define VARIANTS_OF(T, CODE, ES)                                                                           \
    {4, 3, CODE, ES, tile_##T##_1_1, {0, tile_##T##_4_1, tile_##T##_4_2, tile_##T##_4_3, 0}},              \
    {6, 2, CODE, ES, tile_##T##_1_1, {0, tile_##T##_6_1, tile_##T##_6_2, 0, 0}},                           \
    {6, 4, CODE, ES, tile_##T##_1_1, {0, tile_##T##_6_1, tile_##T##_6_2, tile_##T##_6_3, tile_##T##_6_4}}, \
    {8, 3, CODE, ES, tile_##T##_1_1, {0, tile_##T##_8_1, tile_##T##_8_2, tile_##T##_8_3, 0}},

static const struct variant VARIANTS[] = {
    VARIANTS_OF(f32, F32, 4) VARIANTS_OF(bf16, BF16, 2) VARIANTS_OF(f16, F16, 2)
#if HAVE_DP
    {6, 4, BF16_PAIRS, 2, tile_dp_1_1, {0, tile_dp_6_1, tile_dp_6_2, tile_dp_6_3, tile_dp_6_4}},
    {8, 3, BF16_PAIRS, 2, tile_dp_1_1, {0, tile_dp_8_1, tile_dp_8_2, tile_dp_8_3, 0}},
#endif
};

/* Whether this build multiplies bfloat16 pairs natively (type BF16_PAIRS). */
int racer_bf16_pairs(void) { return HAVE_DP; }

static void block(const struct variant *v, const float *x, const char *w, const float *bias, float *y, long M,
                  long N, long K, long n0)
{
    if (n0 + v->nr > N) { /* the last rows of a weight whose row count NR does not divide */
        for (long n = n0; n < N; n++)
            for (long m = 0; m < M; m++) v->one(x, w, bias, y, N, K, n, m, NULL);
        return;
    }
    const char *next = n0 + 2 * v->nr <= N ? w + (n0 + v->nr) * K * v->esize : NULL;
    for (long m0 = 0; m0 < M; m0 += v->mr) {
        long r = M - m0 < v->mr ? M - m0 : v->mr;
        v->tiles[r](x, w, bias, y, N, K, n0, m0, next);
    }
}

int racer_vector_bits(void) { return VL * 32; }

/* 0, or -1 for a tile shape or weight type this build does not have. */
/* ``type``: the weight's (0 float32, 1 bfloat16, 2 float16; x, bias and y float32), or 3: bfloat16
 * weight and x multiplied in pairs (bias and y float32). */
int racer_linear(int nr, int mr, int type, const float *x, const void *w, const float *bias, float *y, long M, long N,
                 long K, int threads)
{
    const struct variant *v = NULL;
    for (size_t i = 0; i < sizeof VARIANTS / sizeof VARIANTS[0]; i++)
        if (VARIANTS[i].nr == nr && VARIANTS[i].mr == mr && VARIANTS[i].type == type) v = &VARIANTS[i];
    if (!v) return -1;
    long blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) block(v, x, w, bias, y, M, N, K, b * nr);
    return 0;
}
