/* Batch-invariant attention for verification steps, over a session's KV cache read in place.
 *
 * Every query row attends over the keys it may see, taken in position order and reduced in fixed
 * blocks of BLOCK keys at fixed ordinals (key j of a row sits at absolute position j: the context,
 * then the row's ancestors). Each block gives a partial softmax state (max, sum, weighted values);
 * the blocks of a chunk (CHUNK keys, also at fixed ordinals) are merged in order, then the chunks in
 * order. A row's result is therefore the same sequence of float32 operations on the same values
 * whatever else shares the call, wherever its keys are read from and however the threads split the
 * work: a tree node computes exactly what a one-token step at its position computes.
 *
 * A row's first ``inplace`` keys are cache rows 0, 1, ...: the committed context. A block of its keys
 * is converted once for all the rows of a work item (its values are widened where the weighted sums
 * load them), and their products with it are made a few rows at a time, each load of a key or value
 * shared by the rows of the tile while the block sits in L1.
 * A row's other keys are cache rows named by ``tail`` (its ancestors, at most the tree's depth): the
 * one block holding them is gathered for that row alone.
 *
 * K and V may be float32, bfloat16 or float16 (converted to float32 as they are loaded); queries
 * and results are float32. The exponential is a fixed polynomial, so the bits do not depend on the
 * C library either.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_vec.h"

#define BLOCK 64
#define MAXD 256

/* One block of a KV head: its keys converted to float32, kt[d][j] = K[key j][d] (keys along the
 * vector lanes, so scores need no horizontal sums), and where each key's value row lies in the cache
 * (``vr[j]``, of element type ``vtype``): the weighted sums widen a value as they load it (exact, so
 * the same values a float32 copy would hold, without writing and reading one). Only keys below a
 * row's count are ever used: the others are masked out of its scores and left out of its sums. */
struct block {
    float kt[MAXD * BLOCK] __attribute__((aligned(64)));
    const char *vr[BLOCK];
    int vtype;
};

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 values from p[d] on, as float32 (exact widenings, as load_as_f32's). */
static inline __m256 load8(const char *p, long d, int type)
{
    if (type == F32) return _mm256_loadu_ps((const float *)p + d);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + d));
    if (type == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* kt[d0 .. d0 + 8][j0 .. j0 + 8] from 8 keys' dims d0 .. d0 + 8 (rows[i] NULL: zeros). */
static inline void transpose8(float *kt, const char *const *rows, long d0, int type)
{
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = rows[i] ? load8(rows[i], d0, type) : _mm256_setzero_ps();
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* r[i] (and r[i + 4], for keys 4-7): dim i of keys 0-3 in the low half, dim i + 4 in the high */
    for (int i = 0; i < 4; i++) {
        _mm256_store_ps(kt + (d0 + i) * BLOCK, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_store_ps(kt + (d0 + i + 4) * BLOCK, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

/* Keys j0 .. nb - 1 of a block (j0 a multiple of 8; key j at byte offset off[j] of kbase, vbase)
 * converted into ``blk``, and their value rows located and asked of the cache while the keys are
 * converted (without that, an 8-node chain's attention over 1,024 keys took 18% longer than with the
 * values converted here). With the block items below, the default model's 30 layers of attention on
 * 2 threads (AMD EPYC Zen 3, medians of 4 alternated runs, ms, before / after): one token over 257
 * keys 0.99 / 0.95, 4 nodes 1.72 / 1.60, one token over 1,024 keys 2.67 / 2.35, 8 nodes 10.9 / 10.9. */
static void convert(struct block *blk, const char *kbase, const char *vbase, const long *off, long j0, long nb,
                    long D, int type)
{
    blk->vtype = type;
    const long vbytes = D * (type == F32 ? 4 : 2);
    for (long j = j0; j < nb; j++) {
        blk->vr[j] = vbase + off[j];
        for (long b = 0; b < vbytes; b += 64) __builtin_prefetch(blk->vr[j] + b, 0, 3);
    }
#if defined(__AVX2__)
    for (long j8 = j0; j8 < nb; j8 += 8) {
        const char *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = j8 + i < nb ? kbase + off[j8 + i] : NULL;
        for (long d = 0; d < D; d += 8) transpose8(blk->kt + j8, rows, d, type);
    }
#else
    for (long j = j0; j < nb; j++)
        for (long d = 0; d < D; d += VL) {
            vf kv = load_as_f32(kbase + off[j], d, type);
            for (int i = 0; i < VL; i++) blk->kt[(d + i) * BLOCK + j] = kv[i];
        }
#endif
}

/* Keys 0 .. nb - 1 of ``dst`` (and their value rows) copied from ``src`` (converted already). */
static void copy_keys(struct block *dst, const struct block *src, long nb, long D)
{
    for (long d = 0; d < D; d++) memcpy(dst->kt + d * BLOCK, src->kt + d * BLOCK, sizeof(float) * nb);
    memcpy(dst->vr, src->vr, sizeof(dst->vr[0]) * nb);
    dst->vtype = src->vtype;
}

/* A query's running softmax state: max, sum of weights, weighted values (float32). */
struct state {
    float m, l;
    float acc[MAXD] __attribute__((aligned(64)));
};

/* What one thread works in: scores, then weights, of RB head rows [RB][BLOCK]; their weighted
 * values [RB][MAXD]. */
#define RB 6 /* head rows sharing each load of a block's keys and values (speed only, not the bits) */
#define CK 2 /* key vectors per pass of the scores */
#define DV 2 /* value vectors per pass of the weighted sums */
struct work {
    float s[RB * BLOCK] __attribute__((aligned(64)));
    float o[RB * MAXD] __attribute__((aligned(64)));
    float softcap; /* the call's: > 0 caps each scaled score s to softcap * tanh(s / softcap) */
    int record;    /* 1: a block's state is stored as it is (m, l, weighted values), not merged */
};

/* x in every lane (x - 0 is x for every x: a plain broadcast). */
static inline vf splat(float x) { return x - (vf){0}; }

/* Scaled scores of R head rows (q[r], float32 [D]) against the block's first nb keys (and the keys
 * after them up to a whole pass of CK vectors): s[r][j]. Every score is the same chain of FMAs over d
 * in order whatever R and nb are: a row's bits do not depend on its company. A partial block (a
 * row's last, which holds a tree node's ancestors) takes only the passes that reach its keys. */
static inline __attribute__((always_inline)) void block_scores(int R, float *s, const float *const *q,
                                                                const struct block *blk, long nb, long D, float scale)
{
    const int passes = (int)((nb + CK * VL - 1) / (CK * VL)) * CK;
    for (int c0 = 0; c0 < passes; c0 += CK) {
        vf acc[RB][CK];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            for (int k = 0; k < CK; k++) acc[r][k] = (vf){0};
        for (long d = 0; d < D; d++) {
            vf kv[CK];
            for (int k = 0; k < CK; k++) kv[k] = *(const vf *)(blk->kt + d * BLOCK + (c0 + k) * VL);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                vf qd = splat(q[r][d]);
                for (int k = 0; k < CK; k++) acc[r][k] += qd * kv[k];
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            for (int k = 0; k < CK; k++) *(vf *)(s + r * BLOCK + (c0 + k) * VL) = acc[r][k] * scale;
    }
}

/* NV value vectors from dim d0 on of R head rows' weighted sums over the block's first nb keys
 * (weights p[r][j]; values of element type T): o[r][d] = sum over j in order of p[r][j] V[j][d]. */
static inline __attribute__((always_inline)) void values_pass(int R, int NV, int T, float *o, const float *p,
                                                               const struct block *blk, long nb, long d0)
{
    vf acc[RB][DV];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NV; k++) acc[r][k] = (vf){0};
    for (long j = 0; j < nb; j++) {
        vf vv[DV];
        for (int k = 0; k < NV; k++) vv[k] = load_as_f32(blk->vr[j], d0 + k * VL, T);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            vf pj = splat(p[r * BLOCK + j]);
            for (int k = 0; k < NV; k++) acc[r][k] += pj * vv[k];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NV; k++) *(vf *)(o + r * MAXD + d0 + k * VL) = acc[r][k];
}

static inline __attribute__((always_inline)) void values_of(int R, int T, float *o, const float *p,
                                                             const struct block *blk, long nb, long D)
{
    long d0 = 0;
    for (; d0 + DV * VL <= D; d0 += DV * VL) values_pass(R, DV, T, o, p, blk, nb, d0);
    for (; d0 < D; d0 += VL) values_pass(R, 1, T, o, p, blk, nb, d0);
}

static inline __attribute__((always_inline)) void block_values(int R, float *o, const float *p,
                                                                const struct block *blk, long nb, long D)
{
    switch (blk->vtype) {
    case F32: values_of(R, F32, o, p, blk, nb, D); break;
    case BF16: values_of(R, BF16, o, p, blk, nb, D); break;
    default: values_of(R, F16, o, p, blk, nb, D); break;
    }
}

/* Lanes of ``a`` where ``take`` is set, else of ``b``. */
static inline vf pick(vi take, vf a, vf b)
{
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & take) | (bi & ~take);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* Scaled scores s[BLOCK] of one head row over nb keys -> its softmax weights, in place (0 past nb,
 * within the vectors that hold its keys; the vectors after them are left as they are, and no one
 * reads them); returns the block's max score and (*sum) the weights' sum: the vectors added in key
 * order, then their lanes in lane order. A vector past nb would add exact zeros (vexp gives 0 below
 * -87): leaving it out changes no bit. */
static float block_weights(float *s, long nb, float *sum)
{
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    const vf ninf = (vf){0} - INFINITY;
    const int vecs = (int)((nb + VL - 1) / VL);
    vf x[BLOCK / VL], top = ninf;
    for (int c = 0; c < vecs; c++) {
        x[c] = pick(lane + c * VL < (int)nb, *(const vf *)(s + c * VL), ninf);
        top = pick(x[c] > top, x[c], top);
    }
    float mb = top[0]; /* a max is exact in any order */
    for (int i = 1; i < VL; i++) mb = top[i] > mb ? top[i] : mb;
    vf l = (vf){0};
    for (int c = 0; c < vecs; c++) {
        vf e = vexp(x[c] - mb);
        *(vf *)(s + c * VL) = e;
        l += e;
    }
    *sum = reduce(l);
    return mb;
}

/* A block's state (max ``mb``, weight sum ``lb``, weighted values ``o``) merged into a row's. */
static void merge(struct state *s, const float *o, float mb, float lb, long D)
{
    float mn = mb > s->m ? mb : s->m;
    float a = vexp((vf){0} + (s->m - mn))[0], c = vexp((vf){0} + (mb - mn))[0];
    s->l = s->l * a + lb * c;
    for (long d = 0; d < D; d += VL) *(vf *)(s->acc + d) = *(vf *)(s->acc + d) * a + *(const vf *)(o + d) * c;
    s->m = mn;
}

/* An empty state: no keys yet (what every merge sequence starts from). */
static void empty_state(struct state *s, long D)
{
    s->m = -INFINITY;
    s->l = 0.f;
    memset(s->acc, 0, sizeof(float) * D);
}

/* R head rows (queries q[r], states st[r]) over one block of nb keys, merged into their states. */
static inline __attribute__((always_inline)) void attend_rows(int R, struct work *w, struct state *const *st,
                                                               const float *const *q, const struct block *blk,
                                                               long nb, long D, float scale)
{
    float mb[RB], lb[RB];
    block_scores(R, w->s, q, blk, nb, D, scale);
    if (w->softcap > 0) /* Gemma 2's soft cap, as its attention takes it: (s / cap), tanh, times cap */
        for (int r = 0; r < R; r++)
            for (long j = 0; j < nb; j += VL)
                *(vf *)(w->s + r * BLOCK + j) = vtanh(*(const vf *)(w->s + r * BLOCK + j) / w->softcap) * w->softcap;
    for (int r = 0; r < R; r++) mb[r] = block_weights(w->s + r * BLOCK, nb, &lb[r]);
    block_values(R, w->o, w->s, blk, nb, D);
    for (int r = 0; r < R; r++)
        if (w->record) { /* the block's own state, for the merges of racer_attention's block items */
            st[r]->m = mb[r];
            st[r]->l = lb[r];
            memcpy(st[r]->acc, w->o + r * MAXD, sizeof(float) * D);
        } else {
            merge(st[r], w->o + r * MAXD, mb[r], lb[r], D);
        }
}

/* ``count`` head rows over one block, RB at a time (each a separate instance: the same operations
 * per row for every R). */
static void attend(struct work *w, struct state *const *st, const float *const *q, long count,
                   const struct block *blk, long nb, long D, float scale)
{
    for (long i = 0; i < count; i += RB) {
        switch (count - i < RB ? count - i : RB) {
        case 1: attend_rows(1, w, st + i, q + i, blk, nb, D, scale); break;
        case 2: attend_rows(2, w, st + i, q + i, blk, nb, D, scale); break;
        case 3: attend_rows(3, w, st + i, q + i, blk, nb, D, scale); break;
        case 4: attend_rows(4, w, st + i, q + i, blk, nb, D, scale); break;
        case 5: attend_rows(5, w, st + i, q + i, blk, nb, D, scale); break;
        default: attend_rows(RB, w, st + i, q + i, blk, nb, D, scale); break;
        }
    }
}

int racer_attention_block(void) { return BLOCK; }

/* Keys row r sees in block b0 (0 past its count). */
static inline long keys_in(const int64_t *counts, long r, long b0)
{
    long nb = counts[r] - b0;
    return nb < 0 ? 0 : nb < BLOCK ? nb : BLOCK;
}

/* Whether row r's block b0 is whole and all cache rows b0, b0 + 1, ... (the shared conversion's). */
static inline int whole_in_place(const int64_t *counts, const int64_t *inplace, long r, long b0)
{
    return keys_in(counts, r, b0) == BLOCK && b0 + BLOCK <= inplace[r];
}

/* The head rows of a work item (rows [r0, r1) of KV head kh; head row m = (r - r0) * group + g) and
 * their states, queries and the blocks they read. */
struct item {
    struct state *st, **stp;
    const float **qp;
    struct block *shared, *own;
    struct work *w;
};

/* The in-place conversion of block b0 (its first *have keys) extended to its first ``nb``: cache rows
 * b0, b0 + 1, .... */
static void extend(struct block *blk, long *have, long nb, long b0, const char *kb, const char *vb, long esize,
                   long D, int type)
{
    if (nb <= *have) return;
    long off[BLOCK], from = *have / 8 * 8;
    for (long j = from; j < nb; j++) off[j] = (b0 + j) * D * esize;
    convert(blk, kb, vb, off, from, nb, D, type);
    *have = nb;
}

/* Every head row of rows [r0, r1) over block b0: those whose block is whole and in place share one
 * conversion and run RB at a time; a row whose block is partial or holds other cache rows (``tail``)
 * runs alone, over the in-place conversion or its own. */
static void item_block(struct item *it, long b0, long r0, long r1, long group, const float *q, long H, long kh,
                       const char *kb, const char *vb, long esize, const int64_t *counts, const int64_t *inplace,
                       const int64_t *tail, long T, long D, int type, float scale)
{
    long off[BLOCK], count = 0, partial = 0; /* keys of the in-place conversion */
    for (long r = r0; r < r1; r++)
        if (whole_in_place(counts, inplace, r, b0))
            for (long g = 0; g < group; g++, count++) {
                it->stp[count] = &it->st[(r - r0) * group + g];
                it->qp[count] = q + (r * H + kh * group + g) * D;
            }
    if (count) {
        extend(it->shared, &partial, BLOCK, b0, kb, vb, esize, D, type);
        attend(it->w, it->stp, it->qp, count, it->shared, BLOCK, D, scale);
    }
    for (long r = r0; r < r1; r++) {
        long nb = keys_in(counts, r, b0);
        if (nb == 0 || whole_in_place(counts, inplace, r, b0)) continue;
        const struct block *blk = it->shared;
        if (b0 + nb <= inplace[r]) { /* in place, fewer keys than the block: one conversion for all such */
            extend(it->shared, &partial, nb, b0, kb, vb, esize, D, type);
        } else { /* its context keys copied from the in-place conversion, the others converted */
            long ctx = inplace[r] > b0 ? (inplace[r] - b0) / 8 * 8 : 0;
            extend(it->shared, &partial, ctx, b0, kb, vb, esize, D, type);
            copy_keys(it->own, it->shared, ctx, D);
            for (long j = ctx; j < nb; j++) {
                long o = b0 + j;
                off[j] = (o < inplace[r] ? o : tail[r * T + o - inplace[r]]) * D * esize;
            }
            convert(it->own, kb, vb, off, ctx, nb, D, type);
            blk = it->own;
        }
        for (long g = 0; g < group; g++) {
            it->stp[g] = &it->st[(r - r0) * group + g];
            it->qp[g] = q + (r * H + kh * group + g) * D;
        }
        attend(it->w, it->stp, it->qp, group, blk, nb, D, scale);
    }
}

/* The states of rows [r0, r1) over their keys in [lo, hi) (blocks of one chunk), from empty ones. */
static void item_chunk(struct item *it, long lo, long hi, long r0, long r1, long group, const float *q, long H,
                       long kh, const char *kb, const char *vb, long esize, const int64_t *counts,
                       const int64_t *inplace, const int64_t *tail, long T, long D, int type, float scale)
{
    for (long m = 0; m < (r1 - r0) * group; m++) {
        empty_state(&it->st[m], D);
    }
    for (long b0 = lo; b0 < hi; b0 += BLOCK)
        item_block(it, b0, r0, r1, group, q, H, kh, kb, vb, esize, counts, inplace, tail, T, D, type, scale);
}

#define CHUNK (4 * BLOCK) /* keys whose block states are merged before the chunks' states are */
/* A call with fewer chunk items than BLOCK_ITEMS a thread takes an item per block (at most
 * BLOCK_STATES head-row states recorded): speed only, the same bits. */
#define BLOCK_ITEMS 4
#define BLOCK_STATES 16384

/* A head row's result: its chunk states (chunk c's at p + c * step: m, l | acc) merged in order. */
static void merge_chunks(float *out, const float *p, long step, long chunks, long count, long D)
{
    struct state s;
    empty_state(&s, D);
    for (long c = 0; c < chunks && c * CHUNK < count; c++) merge(&s, p + c * step + VL, p[c * step], p[c * step + 1], D);
    float inv = s.l > 0.f ? 1.0f / s.l : 0.f;
    for (long d = 0; d < D; d++) out[d] = s.acc[d] * inv;
}


/* A thread's work space, kept across calls (freed when the thread ends): allocating and zeroing a
 * thread's blocks (256 KiB when it was measured) in every call of every layer cost a forward more
 * than its smallest trees' attention. Zeroed once, when allocated; after that a block's keys past a
 * row's count hold an earlier call's values, finite and never used (masked out of the scores, left
 * out of the sums). */
struct space {
    struct item it;
    long states; /* head rows st, stp and qp hold */
};

static pthread_key_t space_key;
static pthread_once_t space_once = PTHREAD_ONCE_INIT;

static void space_free(void *p)
{
    struct space *s = p;
    free(s->it.shared);
    free(s->it.own);
    free(s->it.w);
    free(s->it.st);
    free(s->it.stp);
    free(s->it.qp);
    free(s);
}

static void space_key_make(void) { pthread_key_create(&space_key, space_free); }

/* This thread's work space for ``states`` head rows, or NULL when out of memory. */
static struct item *space(long states)
{
    pthread_once(&space_once, space_key_make);
    struct space *s = pthread_getspecific(space_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s) return NULL;
        s->it.shared = aligned_alloc(64, sizeof(struct block));
        s->it.own = aligned_alloc(64, sizeof(struct block));
        s->it.w = aligned_alloc(64, sizeof(struct work));
        if (!s->it.shared || !s->it.own || !s->it.w || pthread_setspecific(space_key, s)) {
            space_free(s);
            return NULL;
        }
        memset(s->it.shared, 0, sizeof(struct block));
        memset(s->it.own, 0, sizeof(struct block));
    }
    if (s->states < states) {
        free(s->it.st);
        free(s->it.stp);
        free(s->it.qp);
        s->it.st = aligned_alloc(64, sizeof(struct state) * states);
        s->it.stp = malloc(sizeof(struct state *) * states);
        s->it.qp = malloc(sizeof(const float *) * states);
        s->states = s->it.st && s->it.stp && s->it.qp ? states : 0;
        if (!s->states) return NULL;
    }
    return &s->it;
}

/* One racer_attention call, as its work items read it. */
struct attention_call {
    _Atomic int failed; /* a thread found no work space: the call returns -2 */
    float *part;
    const float *q;
    const void *k, *v;
    float *out;
    long n, H, Hkv, D, cap;
    const int64_t *counts, *inplace, *tail;
    long T;
    float scale, softcap;
    int type;
    long esize, group, ps, chunks, runs, span;
    long blocks;          /* > 0: the items are blocks, not chunks (``BLOCK_ITEMS``), this many a KV head */
    struct state *record; /* then each block's states: [blocks][Hkv][n][group] */
};

/* Work items [lo, hi): one KV head, one chunk and a run of rows each; their chunk states into part. */
static void attention_items(void *ctx, long lo, long hi, int tid)
{
    struct attention_call *c = ctx;
    (void)tid;
    const long D = c->D, H = c->H, n = c->n, group = c->group, span = c->span;
    struct item *it = space(span * group);
    if (!it) {
        atomic_store(&c->failed, 1);
        return;
    }
    it->w->softcap = c->softcap;
    it->w->record = c->blocks > 0;
    if (c->blocks > 0) { /* one block each: its states recorded where attention_merges reads them */
        struct state *own = it->st;
        for (long x = lo; x < hi; x++) {
            const long kh = x / (c->blocks * c->runs), bu = x % (c->blocks * c->runs), b = bu / c->runs, u = bu % c->runs;
            const long r0 = u * span, r1 = r0 + span < n ? r0 + span : n;
            it->st = c->record + ((b * c->Hkv + kh) * n + r0) * group;
            item_block(it, b * BLOCK, r0, r1, group, c->q, H, kh, (const char *)c->k + kh * c->cap * D * c->esize,
                       (const char *)c->v + kh * c->cap * D * c->esize, c->esize, c->counts, c->inplace, c->tail, c->T,
                       D, c->type, c->scale);
        }
        it->st = own;
        return;
    }
    for (long x = lo; x < hi; x++) {
        const long kh = x / (c->chunks * c->runs), cu = x % (c->chunks * c->runs), ch = cu / c->runs, u = cu % c->runs;
        long r0 = u * span, r1 = r0 + span < n ? r0 + span : n, top = 0, lo_key = ch * CHUNK;
        for (long r = r0; r < r1; r++) top = c->counts[r] > top ? c->counts[r] : top;
        top = top < lo_key + CHUNK ? top : lo_key + CHUNK;
        if (top <= lo_key) continue;
        item_chunk(it, lo_key, top, r0, r1, group, c->q, H, kh, (const char *)c->k + kh * c->cap * D * c->esize,
                   (const char *)c->v + kh * c->cap * D * c->esize, c->esize, c->counts, c->inplace, c->tail, c->T, D,
                   c->type, c->scale);
        for (long r = r0; r < r1; r++) {
            if (c->counts[r] <= lo_key) continue; /* no keys in this chunk: merge_chunks stops before it */
            for (long g = 0; g < group; g++) {
                const struct state *s = &it->st[(r - r0) * group + g];
                float *p = c->part + ((ch * n + r) * H + kh * group + g) * c->ps;
                p[0] = s->m;
                p[1] = s->l;
                memcpy(p + VL, s->acc, sizeof(float) * D);
            }
        }
    }
}

/* Head rows [lo, hi): their chunk states merged in order into out. */
static void attention_merges(void *ctx, long lo, long hi, int tid)
{
    const struct attention_call *c = ctx;
    (void)tid;
    for (long rh = lo; rh < hi; rh++) {
        if (c->blocks > 0) { /* each chunk's state first: its blocks' recorded states merged in order */
            const long r = rh / c->H, kh = rh % c->H / c->group, g = rh % c->group, count = c->counts[r];
            float *p = c->part + rh * c->ps;
            for (long ch = 0; ch * CHUNK < count; ch++, p += c->n * c->H * c->ps) {
                struct state s;
                empty_state(&s, c->D);
                for (long b = ch * CHUNK / BLOCK; b * BLOCK < count && b * BLOCK < (ch + 1) * CHUNK; b++) {
                    const struct state *e = &c->record[((b * c->Hkv + kh) * c->n + r) * c->group + g];
                    merge(&s, e->acc, e->m, e->l, c->D);
                }
                p[0] = s.m;
                p[1] = s.l;
                memcpy(p + VL, s.acc, sizeof(float) * c->D);
            }
        }
        merge_chunks(c->out + rh * c->D, c->part + rh * c->ps, c->n * c->H * c->ps, c->chunks, c->counts[rh / c->H],
                     c->D);
    }
}

/* q [n, H, D] float32; k, v: one layer's cache [Hkv, cap, D] of ``type``; out [n, H, D] float32.
 * counts[n]: keys row r sees; inplace[n]: how many of them are cache rows 0, 1, ...; tail [n, T]:
 * the cache rows of the others, in position order. Returns 0, -1 for an unsupported size, -2 when
 * out of memory.
 *
 * A row's keys fall into chunks of CHUNK at fixed ordinals: within a chunk its block states are
 * merged in order, then the chunks' states in order. A work item is one KV head, one chunk and a run
 * of rows: every block read in place is converted once for all the rows of its item, and the items
 * (about twice the threads, or more) keep every thread busy. Where the chunks give fewer than
 * BLOCK_ITEMS items a thread (a one-token step over a short context: 3 KV heads, 1 or 2 chunks, on 2
 * threads), an item is one block instead: its states are recorded, and each head row's are merged
 * into its chunks' in order afterwards, by the same steps. */
int racer_attention_capped(int type, const float *q, const void *k, const void *v, float *out, long n, long H,
                           long Hkv, long D, long cap, const int64_t *counts, const int64_t *inplace,
                           const int64_t *tail, long T, float scale, float softcap, int threads);
int racer_attention(int type, const float *q, const void *k, const void *v, float *out, long n, long H, long Hkv,
                    long D, long cap, const int64_t *counts, const int64_t *inplace, const int64_t *tail, long T,
                    float scale, int threads)
{
    return racer_attention_capped(type, q, k, v, out, n, H, Hkv, D, cap, counts, inplace, tail, T, scale, 0.f, threads);
}

/* racer_attention with each scaled score s soft-capped to softcap * tanh(s / softcap) (Gemma 2's
 * attn_logit_softcapping; 0: none), before the softmax. */
int racer_attention_capped(int type, const float *q, const void *k, const void *v, float *out, long n, long H,
                           long Hkv, long D, long cap, const int64_t *counts, const int64_t *inplace,
                           const int64_t *tail, long T, float scale, float softcap, int threads)
{
    if (D > MAXD || D % VL || D % 8 || H % Hkv || type < F32 || type > F16) return -1;
    const long esize = type == F32 ? 4 : 2, group = H / Hkv, ps = D + VL; /* a chunk state: m, l | acc */
    long most = 0;
    for (long r = 0; r < n; r++) most = counts[r] > most ? counts[r] : most;
    const long chunks = (most + CHUNK - 1) / CHUNK;
    /* Enough items for the threads (speed only: a row's bits do not depend on its item). */
    long runs = (2 * threads + Hkv * chunks - 1) / (Hkv * chunks > 0 ? Hkv * chunks : 1);
    runs = runs < n ? runs : n;
    runs = runs > 0 ? runs : 1;
    const long span = (n + runs - 1) / runs;
    runs = (n + span - 1) / span;
    size_t bytes = sizeof(float) * (size_t)(chunks * n * H * ps);
    const int nth = threads > 0 ? threads : 1;
    float *part = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!part) return -2;
    struct attention_call c = {0, part, q, k, v, out, n, H, Hkv, D, cap, counts, inplace, tail, T, scale, softcap,
                               type, esize, group, ps, chunks, runs, span, 0, NULL};
    /* Too few items to keep the threads even (a one-token step: a chunk per KV head, 3 items on 2
     * threads): an item per block instead, its states recorded and merged into the chunks' in
     * order afterwards, by the same steps as item_chunk's. */
    const long blocks = (most + BLOCK - 1) / BLOCK;
    if (nth > 1 && Hkv * chunks * runs < BLOCK_ITEMS * nth && blocks > chunks && blocks * n * H <= BLOCK_STATES) {
        c.record = aligned_alloc(64, sizeof(struct state) * (size_t)(blocks * n * H));
        if (c.record) c.blocks = blocks; /* else the chunks', the same bits */
    }
    racer_pfor(Hkv * (c.blocks ? c.blocks : chunks) * runs, 1, nth, attention_items, &c);
    const int ok = !atomic_load(&c.failed);
    if (ok) racer_pfor(n * H, (n * H + nth - 1) / nth, nth, attention_merges, &c);
    free(c.record);
    free(part);
    return ok ? 0 : -2;
}

/* ---- The same attention on AMX tiles (bfloat16 caches, x86 CPUs with AMX-BF16) ----
 *
 * The blocks and their ordinals are the ones above (the block states merged in order, without
 * chunks); what differs is how a block's two products are made. Query and key rows are bfloat16 and multiply in AMX tiles
 * (``tdpbf16ps``: bfloat16 pairs, float32 sums in a fixed order per output element); the block's
 * softmax weights are rounded to bfloat16 and multiply the values in tiles too. A tile's output row
 * depends on its own query row only, so a row's bits still do not depend on the rows beside it,
 * on where its keys lie in the cache or on the thread count. They differ from the vector path's
 * bits (other products, other sums), so a process uses one path for every call (verifier/native.py
 * picks it once): a tree node then still computes what a one-token step at its position computes.
 *
 * Tiles (16 rows of 64 bytes): one query tile holds up to 16 head rows (the query heads of a few
 * rows that share one KV head); a block's keys are laid out for the scores as pairs of dimensions
 * (kp: dimension pair x key) and its values as pairs of keys (vp: key pair x dimension), once per
 * block for all rows that read it in place. */
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether the CPU has AMX-BF16 and Linux lets this process use the tile registers (asked once). */
int racer_attention_amx(void)
{
    static int state = -1;
    if (state < 0) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int cpu = (d >> 22 & 1) && (d >> 24 & 1); /* AMX-BF16, AMX-TILE */
        state = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

struct tilecfg {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

extern __thread int racer_tiles_quant; /* native_quant.c: its tiles' configuration, replaced here */

static void tiles_on(void)
{
    racer_tiles_quant = 0;
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* One block of a KV head laid out for tiles: kp[c][j] = dims 2c, 2c + 1 of key j; vp[c][d] = dim d of
 * keys 2c, 2c + 1 (the low half the first); keys past ``nb`` are zero. ``off``: each key's cache row,
 * in elements. */
struct amx_block {
    uint32_t kp[MAXD / 2 * BLOCK] __attribute__((aligned(64)));
    uint32_t vp[BLOCK / 2 * MAXD] __attribute__((aligned(64)));
};

static void amx_convert(struct amx_block *blk, const uint16_t *kb, const uint16_t *vb, const long *off, long nb,
                        long D)
{
    for (long j0 = 0; j0 < BLOCK; j0 += 16) {
        __mmask16 live = 0;
        int32_t idx[16];
        for (int i = 0; i < 16; i++) {
            live |= (__mmask16)((j0 + i < nb) << i);
            idx[i] = j0 + i < nb ? (int32_t)(off[j0 + i] / 2) : 0;
        }
        __m512i base = _mm512_loadu_si512(idx);
        for (long c = 0; c < D / 2; c++) {
            __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                    _mm512_add_epi32(base, _mm512_set1_epi32((int)c)), kb, 4);
            _mm512_store_si512(blk->kp + c * BLOCK + j0, g);
        }
    }
    for (long c = 0; c < BLOCK / 2; c++) {
        const uint16_t *lo = 2 * c < nb ? vb + off[2 * c] : NULL, *hi = 2 * c + 1 < nb ? vb + off[2 * c + 1] : NULL;
        for (long d = 0; d < D; d += 16) {
            __m512i a = lo ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(lo + d))) : _mm512_setzero_si512();
            __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(hi + d))) : _mm512_setzero_si512();
            _mm512_store_si512(blk->vp + c * D + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

struct amx_work {
    float s[16 * BLOCK] __attribute__((aligned(64)));   /* scores [16, BLOCK] */
    uint16_t p[16 * BLOCK] __attribute__((aligned(64))); /* softmax weights, bfloat16 [16, BLOCK] */
    float o[16 * MAXD] __attribute__((aligned(64)));     /* weighted values [16, D] */
};

/* Scores of a tile's 16 head rows (q [16, D] bfloat16) against the block's keys: w->s = q kp. */
static void amx_scores(struct amx_work *w, const uint16_t *q, const struct amx_block *blk, long D)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long c = 0; c < D / 32; c++) { /* 32 dims at a time, in order */
        _tile_loadd(4, q + 32 * c, D * 2);
        const uint32_t *kp = blk->kp + 16 * c * BLOCK;
        _tile_loadd(5, kp, BLOCK * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, kp + 16, BLOCK * 4);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, kp + 32, BLOCK * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, kp + 48, BLOCK * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, w->s, BLOCK * 4);
    _tile_stored(1, w->s + 16, BLOCK * 4);
    _tile_stored(2, w->s + 32, BLOCK * 4);
    _tile_stored(3, w->s + 48, BLOCK * 4);
}

/* Weighted values of the block: w->o = p vp, 64 dims at a time (keys in order within each). */
static void amx_values(struct amx_work *w, const struct amx_block *blk, long D)
{
    for (long d0 = 0; d0 < D; d0 += 64) {
        long nd = D - d0 < 64 ? (D - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long g = 0; g < BLOCK / 32; g++) {
            _tile_loadd(4, w->p + 32 * g, BLOCK * 2);
            const uint32_t *vp = blk->vp + 16 * g * D + d0;
            _tile_loadd(5, vp, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                _tile_loadd(5, vp + 16, D * 4);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (nd > 2) {
                _tile_loadd(5, vp + 32, D * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (nd > 3) {
                _tile_loadd(5, vp + 48, D * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, w->o + d0, D * 4);
        if (nd > 1) _tile_stored(1, w->o + d0 + 16, D * 4);
        if (nd > 2) _tile_stored(2, w->o + d0 + 32, D * 4);
        if (nd > 3) _tile_stored(3, w->o + d0 + 48, D * 4);
    }
}

/* Head row ``m``'s softmax weights over the block's first ``nb`` keys (bfloat16, into w->p): returns
 * the block's max score, and its sum of the weights as rounded. */
static float amx_weights(struct amx_work *w, long m, long nb, float scale, float *sum)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 s[BLOCK / 16], top = ninf;
    for (int c = 0; c < BLOCK / 16; c++) {
        __mmask16 live = _mm512_cmplt_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)),
                                                  _mm512_set1_epi32((int)nb));
        s[c] = _mm512_mask_mul_ps(ninf, live, _mm512_load_ps(w->s + m * BLOCK + 16 * c), _mm512_set1_ps(scale));
        top = _mm512_max_ps(top, s[c]);
    }
    float mb = _mm512_reduce_max_ps(top); /* a max is exact in any order */
    vf l = (vf){0};
    for (int c = 0; c < BLOCK / 16; c++) {
        vf x = vexp((vf)_mm512_sub_ps(s[c], _mm512_set1_ps(mb)));
        __m256bh h = _mm512_cvtneps_pbh((__m512)x);
        _mm256_store_si256((__m256i *)(w->p + m * BLOCK + 16 * c), (__m256i)h);
        l += (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
    }
    *sum = reduce(l);
    return mb;
}

/* As racer_attention, for bfloat16 q, k and v (q [n, H, D], D a multiple of 32); call only where
 * racer_attention_amx() said yes. A work item is one KV head and a run of query tiles (16 head rows
 * each): a block read in place is laid out once for all of them. */
int racer_attention_tiles(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, long n, long H,
                          long Hkv, long D, long cap, const int64_t *counts, const int64_t *inplace, const int64_t *tail,
                          long T, float scale, int threads)
{
    if (D > MAXD || D % 32 || H % Hkv || H / Hkv > 16 || !racer_attention_amx()) return -1;
    const long group = H / Hkv, per = 16 / group, tiles = (n + per - 1) / per;
    /* Enough items for the threads (speed only: a row's bits do not depend on its item). */
    long runs = (2 * threads + Hkv - 1) / Hkv;
    runs = runs < tiles ? runs : tiles;
    const long span = (tiles + runs - 1) / runs;
    runs = (tiles + span - 1) / span;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        struct amx_block *shared = aligned_alloc(64, sizeof(struct amx_block));
        struct amx_block *own = aligned_alloc(64, sizeof(struct amx_block));
        struct amx_work *w = aligned_alloc(64, sizeof(struct amx_work));
        struct state *st = aligned_alloc(64, sizeof(struct state) * 16 * span);
        uint16_t *qt = aligned_alloc(64, sizeof(uint16_t) * 16 * D * span); /* [span, 16, D] */
        if (!shared || !own || !w || !st || !qt) failed = 1;
        else {
            memset(w, 0, sizeof *w);
            tiles_on();
        }
#pragma omp for schedule(static) collapse(2)
        for (long kh = 0; kh < Hkv; kh++)
            for (long u = 0; u < runs; u++) {
                if (failed) continue;
                const uint16_t *kb = k + kh * cap * D, *vb = v + kh * cap * D;
                /* rows [r0, r1); head row m of the run: row r0 + m / group, head kh * group + m % group,
                 * in tile m / 16 at m % 16 (a tile holds ``per`` whole rows) */
                long r0 = u * span * per, r1 = r0 + span * per < n ? r0 + span * per : n, most = 0;
                memset(qt, 0, sizeof(uint16_t) * 16 * D * span);
#define HEAD_ROW(r, g) (((r) - r0) / per * 16 + ((r) - r0) % per * group + (g))
                for (long r = r0; r < r1; r++) {
                    most = counts[r] > most ? counts[r] : most;
                    for (long g = 0; g < group; g++) {
                        long m = HEAD_ROW(r, g);
                        memcpy(qt + m * D, q + (r * H + kh * group + g) * D, D * 2);
                        empty_state(&st[m], D);
                    }
                }
                for (long b0 = 0; b0 < most; b0 += BLOCK) {
                    /* Rows whose whole block is cache rows b0, b0 + 1, ... share one layout of it and
                     * one pair of products per tile; each other row gets its own (its ancestors,
                     * named by ``tail``). */
                    long shared_nb = 0, off[BLOCK];
                    for (long r = r0; r < r1; r++) {
                        long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                        if (nb > 0 && b0 + nb <= inplace[r] && nb > shared_nb) shared_nb = nb;
                    }
                    if (shared_nb) {
                        for (long j = 0; j < shared_nb; j++) off[j] = (b0 + j) * D;
                        amx_convert(shared, kb, vb, off, shared_nb, D);
                        for (long t0 = r0; t0 < r1; t0 += per) {
                            long t1 = t0 + per < r1 ? t0 + per : r1, any = 0;
                            for (long r = t0; r < t1; r++) {
                                long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                                any |= nb > 0 && b0 + nb <= inplace[r];
                            }
                            if (!any) continue;
                            long tile = HEAD_ROW(t0, 0);
                            float mb[16], lb[16]; /* each head row's block max and weight sum */
                            amx_scores(w, qt + tile * D, shared, D);
                            for (long r = t0; r < t1; r++) {
                                long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                                if (nb > 0 && b0 + nb <= inplace[r])
                                    for (long m = HEAD_ROW(r, 0) - tile; m < HEAD_ROW(r, group) - tile; m++)
                                        mb[m] = amx_weights(w, m, nb, scale, &lb[m]);
                            }
                            amx_values(w, shared, D);
                            for (long r = t0; r < t1; r++) {
                                long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                                if (nb > 0 && b0 + nb <= inplace[r])
                                    for (long m = HEAD_ROW(r, 0) - tile; m < HEAD_ROW(r, group) - tile; m++)
                                        merge(&st[tile + m], w->o + m * D, mb[m], lb[m], D);
                            }
                        }
                    }
                    for (long r = r0; r < r1; r++) {
                        long nb = counts[r] - b0 < BLOCK ? counts[r] - b0 : BLOCK;
                        if (nb <= 0 || b0 + nb <= inplace[r]) continue;
                        for (long j = 0; j < nb; j++) {
                            long o = b0 + j;
                            off[j] = (o < inplace[r] ? o : tail[r * T + o - inplace[r]]) * D;
                        }
                        long tile = HEAD_ROW(r, 0) / 16 * 16;
                        float mb[16], lb[16];
                        amx_convert(own, kb, vb, off, nb, D);
                        amx_scores(w, qt + tile * D, own, D);
                        for (long m = HEAD_ROW(r, 0) - tile; m < HEAD_ROW(r, group) - tile; m++)
                            mb[m] = amx_weights(w, m, nb, scale, &lb[m]);
                        amx_values(w, own, D);
                        for (long m = HEAD_ROW(r, 0) - tile; m < HEAD_ROW(r, group) - tile; m++)
                            merge(&st[tile + m], w->o + m * D, mb[m], lb[m], D);
                    }
                }
                for (long r = r0; r < r1; r++)
                    for (long g = 0; g < group; g++) {
                        const struct state *s = &st[HEAD_ROW(r, g)];
                        float inv = s->l > 0.f ? 1.0f / s->l : 0.f;
                        for (long d = 0; d < D; d++) out[(r * H + kh * group + g) * D + d] = s->acc[d] * inv;
                    }
#undef HEAD_ROW
            }
        if (!failed) _tile_release();
        free(shared);
        free(own);
        free(w);
        free(st);
        free(qt);
    }
    return failed ? -2 : 0;
}
#else
#define HAVE_AMX 0
int racer_attention_amx(void) { return 0; }
int racer_attention_tiles(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, long n, long H,
                          long Hkv, long D, long cap, const int64_t *counts, const int64_t *inplace, const int64_t *tail,
                          long T, float scale, int threads)
{
    return -1;
}
#endif
