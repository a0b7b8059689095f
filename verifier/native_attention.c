/* Batch-invariant attention for verification steps, over a session's KV cache read in place.
 *
 * Every query row attends over the keys it may see, taken in position order and reduced in fixed
 * blocks of BLOCK keys at fixed ordinals (key j of a row sits at absolute position j: the context,
 * then the row's ancestors). Each block gives a partial softmax state (max, sum, weighted values),
 * and the blocks are merged in order. A row's result is therefore the same sequence of float32
 * operations on the same values whatever else shares the call and wherever its keys are read from:
 * a tree node computes exactly what a one-token step at its position computes.
 *
 * A row's first ``inplace`` keys are cache rows 0, 1, ...: the committed context, read where it
 * lies by every row of the call (it stays in the caches while the rows take their turns); its other
 * keys are cache rows named by ``tail`` (its ancestors, at most the tree's depth): no key is copied.
 *
 * K and V may be float32, bfloat16 or float16 (converted to float32 as they are loaded); queries
 * and results are float32. The exponential is a fixed polynomial, so the bits do not depend on the
 * C library either.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64
#define MAXD 256

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef _Float16 vhf __attribute__((vector_size(VL * 2), aligned(2)));

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* VL elements of row ``p`` from ``d`` on, as float32. */
static inline vf load_as_f32(const void *p, long d, int type)
{
    if (type == F32) return *(const vfu *)((const float *)p + d);
    if (type == BF16) {
        vu u = __builtin_convertvector(*(const vh *)((const uint16_t *)p + d), vu) << 16;
        vf f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return __builtin_convertvector(*(const vhf *)((const _Float16 *)p + d), vf);
}

static inline float scalar_as_f32(const void *p, long d, int type)
{
    if (type == F32) return ((const float *)p)[d];
    if (type == BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[d] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return (float)((const _Float16 *)p)[d];
}

/* exp(x) for x <= 0 (softmax terms): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6
 * polynomial (relative error ~2e-7); below -87 it is 0. The same operations for every lane. */
static inline vf vexp(vf x)
{
    const vf lo = (vf){0} - 87.0f;
    vi under = x < lo, xb, lb;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lb, &lo, sizeof lb);
    xb = (xb & ~under) | (lb & under);
    memcpy(&x, &xb, sizeof x);
    const vf magic = (vf){0} + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to nearest */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf sc;
    memcpy(&sc, &e, sizeof sc);
    vf out = p * sc;
    vi bits;
    memcpy(&bits, &out, sizeof bits);
    bits &= ~under;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline float hsum(vf v)
{
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* One block of a KV head converted to float32: kt[d][j] = K[key j][d] (keys along the vector lanes,
 * so scores need no horizontal sums) and vb[j][d] = V[key j][d]; keys past ``nb`` are zero. */
struct block {
    float kt[MAXD * BLOCK] __attribute__((aligned(64)));
    float vb[BLOCK * MAXD] __attribute__((aligned(64)));
};

static void convert(struct block *blk, const char *kbase, const char *vbase, const long *off, long nb, long D, int type)
{
    for (long j = 0; j < BLOCK; j++) {
        if (j < nb) {
            const char *kr = kbase + off[j], *vr = vbase + off[j];
            for (long d = 0; d < D; d += VL) {
                vf kv = load_as_f32(kr, d, type);
                for (int i = 0; i < VL; i++) blk->kt[(d + i) * BLOCK + j] = kv[i];
                *(vf *)(blk->vb + j * D + d) = load_as_f32(vr, d, type);
            }
        } else {
            for (long d = 0; d < D; d++) blk->kt[d * BLOCK + j] = blk->vb[j * D + d] = 0.f;
        }
    }
}

/* A query's running softmax state: max, sum of weights, weighted values (float32). */
struct state {
    float m, l;
    float acc[MAXD] __attribute__((aligned(64)));
};

/* One query (q[D], float32) over one block of ``nb`` keys: the block's partial state, merged into
 * ``st`` (blocks come in position order). */
static void attend_block(struct state *st, const float *q, const struct block *blk, long nb, long D, float scale)
{
    vf sv[BLOCK / VL];
    for (int c = 0; c < BLOCK / VL; c++) sv[c] = (vf){0};
    for (long d = 0; d < D; d++) {
        vf qd = (vf){0} + q[d];
        for (int c = 0; c < BLOCK / VL; c++) sv[c] += qd * *(const vf *)(blk->kt + d * BLOCK + c * VL);
    }
    float s[BLOCK] __attribute__((aligned(64)));
    for (int c = 0; c < BLOCK / VL; c++) *(vf *)(s + c * VL) = sv[c] * scale;
    float mb = s[0];
    for (long j = 1; j < nb; j++) mb = s[j] > mb ? s[j] : mb;
    for (long j = nb; j < BLOCK; j++) s[j] = -INFINITY;
    for (int c = 0; c < BLOCK / VL; c++) *(vf *)(s + c * VL) = vexp(*(vf *)(s + c * VL) - mb);
    float lb = 0.f;
    for (long j = 0; j < nb; j++) lb += s[j];
    float mn = mb > st->m ? mb : st->m;
    float a = vexp((vf){0} + (st->m - mn))[0], c = vexp((vf){0} + (mb - mn))[0];
    st->l = st->l * a + lb * c;
    long dv = D - D % VL;
    for (long d = 0; d < dv; d += VL) {
        vf o = (vf){0};
        for (long j = 0; j < nb; j++) o += s[j] * *(const vf *)(blk->vb + j * D + d);
        *(vf *)(st->acc + d) = *(vf *)(st->acc + d) * a + o * c;
    }
    for (long d = dv; d < D; d++) {
        float o = 0.f;
        for (long j = 0; j < nb; j++) o += s[j] * blk->vb[j * D + d];
        st->acc[d] = st->acc[d] * a + o * c;
    }
    st->m = mn;
}

int racer_attention_block(void) { return BLOCK; }

#define ROW_TILE 8 /* rows sharing one conversion of each context block (speed only, not the bits) */

/* q [n, H, D] float32; k, v: one layer's cache [Hkv, cap, D] of ``type``; out [n, H, D] float32.
 * counts[n]: keys row r sees; inplace[n]: how many of them are cache rows 0, 1, ...; tail [n, T]:
 * the cache rows of the others, in position order. Returns 0, or -1 for an unsupported size. */
int racer_attention(int type, const float *q, const void *k, const void *v, float *out, long n, long H, long Hkv,
                    long D, long cap, const int64_t *counts, const int64_t *inplace, const int64_t *tail, long T,
                    float scale, int threads)
{
    if (D > MAXD || D % VL || H % Hkv || type < F32 || type > F16) return -1;
    const int esize = type == F32 ? 4 : 2;
    const long group = H / Hkv, tiles = (n + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel num_threads(threads)
    {
        struct block *shared = aligned_alloc(64, sizeof(struct block)), *own = aligned_alloc(64, sizeof(struct block));
        struct state *st = aligned_alloc(64, sizeof(struct state) * ROW_TILE * group);
#pragma omp for schedule(static) collapse(2)
        for (long kh = 0; kh < Hkv; kh++)
            for (long t = 0; t < tiles; t++) {
                const char *kb = (const char *)k + kh * cap * D * esize;
                const char *vb = (const char *)v + kh * cap * D * esize;
                long r0 = t * ROW_TILE, r1 = r0 + ROW_TILE < n ? r0 + ROW_TILE : n, most = 0;
                for (long r = r0; r < r1; r++) {
                    most = counts[r] > most ? counts[r] : most;
                    for (long g = 0; g < group; g++) {
                        st[(r - r0) * group + g].m = -INFINITY;
                        st[(r - r0) * group + g].l = 0.f;
                        for (long d = 0; d < D; d++) st[(r - r0) * group + g].acc[d] = 0.f;
                    }
                }
                for (long b0 = 0; b0 < most; b0 += BLOCK) {
                    long shared_nb = -1; /* keys of the shared conversion: in place for some row */
                    for (long r = r0; r < r1; r++) {
                        if (b0 >= counts[r]) continue;
                        long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                        const struct block *blk;
                        long off[BLOCK];
                        if (b0 + nb <= inplace[r]) { /* the whole block is cache rows b0, b0 + 1, ... */
                            if (shared_nb < nb) {
                                for (long j = 0; j < nb; j++) off[j] = (b0 + j) * D * esize;
                                convert(shared, kb, vb, off, nb, D, type);
                                shared_nb = nb;
                            }
                            blk = shared;
                        } else {
                            for (long j = 0; j < nb; j++) {
                                long o = b0 + j;
                                off[j] = (o < inplace[r] ? o : tail[r * T + o - inplace[r]]) * D * esize;
                            }
                            convert(own, kb, vb, off, nb, D, type);
                            blk = own;
                        }
                        for (long g = 0; g < group; g++) {
                            long h = kh * group + g;
                            attend_block(&st[(r - r0) * group + g], q + (r * H + h) * D, blk, nb, D, scale);
                        }
                    }
                }
                for (long r = r0; r < r1; r++)
                    for (long g = 0; g < group; g++) {
                        const struct state *s = &st[(r - r0) * group + g];
                        float inv = s->l > 0.f ? 1.0f / s->l : 0.f;
                        for (long d = 0; d < D; d++) out[(r * H + kh * group + g) * D + d] = s->acc[d] * inv;
                    }
            }
        free(shared);
        free(own);
        free(st);
    }
    return 0;
}
