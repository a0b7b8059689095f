/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, for the few rows a verification step has.
 *
 * BLAS libraries pack the weight before a GEMM, which for a handful of rows reads and writes the
 * whole weight once more than the product itself needs. Here each weight row is streamed once per
 * call: a tile of NR weight rows is multiplied with MR rows of x in registers (NR x MR vector
 * accumulators over K, reduced at the end), passes over further rows of x find the tile in the
 * L1 cache, and the next tile is prefetched all the while. Threads (OpenMP: torch's own runtime
 * when loaded into its process) take contiguous ranges of weight rows.
 *
 * A row's result never depends on the other rows of the call: every output is the same sequence of
 * vector FMAs over K followed by the same reduction, whatever tile it falls in.
 *
 * Built by verifier/native.py with -O3 -march=native: the vector width follows the CPU (256-bit on
 * AVX2, 512-bit with AVX-512), and the tuner measures which tile shape wins for each row count.
 */
#include <stddef.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));

static inline vf load(const float *p) { return *(const vfu *)p; }

static inline float reduce(vf v)
{
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

typedef void (*tile_fn)(const float *restrict x, const float *restrict w, const float *restrict bias,
                        float *restrict y, long N, long K, long n0, long m0, const float *next);

/* Weight rows [n0, n0 + NR) against x rows [m0, m0 + MR); ``next``: the following tile's first weight
 * row (NULL for the last tile), prefetched meanwhile, on every pass: a call of at most MR rows makes
 * one pass per tile, and the prefetch keeps the next tile's lines on their way while it runs (one
 * thread, 4 rows: ~20% faster than leaving the stream to the hardware prefetcher alone). */
#define DEFTILE(NR, MR)                                                                                    \
    static void tile_##NR##_##MR(const float *restrict x, const float *restrict w, const float *restrict bias, \
                                 float *restrict y, long N, long K, long n0, long m0, const float *next)   \
    {                                                                                                      \
        vf acc[NR][MR];                                                                                    \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                              \
        const long kv = K - K % VL;                                                                        \
        for (long k = 0; k < kv; k += VL) {                                                                \
            vf xv[MR];                                                                                     \
            for (int j = 0; j < MR; j++) xv[j] = load(x + (m0 + j) * K + k);                               \
            if (next && !(k & 15))                                                                         \
                for (int i = 0; i < NR; i++) __builtin_prefetch(next + i * K + k, 0, 3);                   \
            for (int i = 0; i < NR; i++) {                                                                 \
                vf wv = load(w + (n0 + i) * K + k);                                                        \
                for (int j = 0; j < MR; j++) acc[i][j] += wv * xv[j];                                      \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) {                                                                 \
                float s = reduce(acc[i][j]);                                                               \
                for (long k = kv; k < K; k++) s += w[(n0 + i) * K + k] * x[(m0 + j) * K + k];              \
                y[(m0 + j) * N + n0 + i] = bias ? s + bias[n0 + i] : s;                                    \
            }                                                                                              \
    }

DEFTILE(1, 1)
DEFTILE(4, 1) DEFTILE(4, 2) DEFTILE(4, 3)
DEFTILE(6, 1) DEFTILE(6, 2) DEFTILE(6, 3) DEFTILE(6, 4)
DEFTILE(8, 1) DEFTILE(8, 2) DEFTILE(8, 3)

struct variant {
    int nr, mr;
    tile_fn tiles[5]; /* tiles[r]: r rows of x (1..mr) */
};

static const struct variant VARIANTS[] = {
    {4, 3, {0, tile_4_1, tile_4_2, tile_4_3, 0}},
    {6, 2, {0, tile_6_1, tile_6_2, 0, 0}},
    {6, 4, {0, tile_6_1, tile_6_2, tile_6_3, tile_6_4}},
    {8, 3, {0, tile_8_1, tile_8_2, tile_8_3, 0}},
};

static void block(const struct variant *v, const float *x, const float *w, const float *bias, float *y, long M,
                  long N, long K, long n0)
{
    if (n0 + v->nr > N) { /* the last rows of a weight whose row count NR does not divide */
        for (long n = n0; n < N; n++)
            for (long m = 0; m < M; m++) tile_1_1(x, w, bias, y, N, K, n, m, NULL);
        return;
    }
    const float *next = n0 + 2 * v->nr <= N ? w + (n0 + v->nr) * K : NULL;
    for (long m0 = 0; m0 < M; m0 += v->mr) {
        long r = M - m0 < v->mr ? M - m0 : v->mr;
        v->tiles[r](x, w, bias, y, N, K, n0, m0, next);
    }
}

int racer_vector_bits(void) { return VL * 32; }

/* 0, or -1 for a tile shape this build does not have. */
int racer_linear(int nr, int mr, const float *x, const float *w, const float *bias, float *y, long M, long N, long K,
                 int threads)
{
    const struct variant *v = NULL;
    for (size_t i = 0; i < sizeof VARIANTS / sizeof VARIANTS[0]; i++)
        if (VARIANTS[i].nr == nr && VARIANTS[i].mr == mr) v = &VARIANTS[i];
    if (!v) return -1;
    long blocks = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) block(v, x, w, bias, y, M, N, K, b * nr);
    return 0;
}
