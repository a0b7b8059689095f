/* A Llama-family decoder, every layer of it, in one call: for n rows, per layer, RMSNorm, the q/k/v
 * projections, rotary embeddings, the new K/V rows written into each segment's cache, invariant
 * attention over it (racer_attention), the o projection and the residual, RMSNorm, the gate and up
 * projections, silu(gate) * up, the down projection and the residual. Gemma 3's layers add an RMSNorm
 * of each q and k head, of the attention's output and of the MLP's before their residuals, GELU for
 * SiLU, and sliding-window layers with their own rotary table.
 *
 * The residual stream and every activation stay float32; only the weights and the KV cache are half
 * width (a K/V row is rounded to the cache's type once, when it is written). Each step is rowwise:
 * a norm, a rotation or a product of one row reads that row only, in a fixed order; projections are
 * racer_linear's row-invariant tiles (racer_panel_many's over weights stored as panels, racer_quant_many's
 * over GGUF blocks) and attention
 * is racer_attention's blocks at absolute positions. So a row's bits never depend on the other rows of the call or on the thread count: a
 * tree node, a batch of sessions and a one-token step at the same position compute the same thing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_vec.h"

int racer_linear(int nr, int mr, int type, const float *x, const void *w, const float *bias, float *y, long M, long N,
                 long K, int threads);
int racer_linear_many(int count, const int64_t *tiles, int type, const float *x, const void *const *w,
                      const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads);
int racer_panel_many(int count, int type, const float *x, const void *const *w, const float *const *bias,
                     float *const *y, const int64_t *N, long M, long K, int threads);
int racer_quant_many(int count, const int64_t *types, const float *x, const void *const *w,
                     const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads);

/* What the decoder multiplies GGUF blocks with: this library's block kernel, or where the start-up
 * check refused it, the reference build's entry point of the same signature and bits
 * (verifier/native.py, racer_decoder_quant_from). */
typedef int (*quant_many_fn)(int count, const int64_t *types, const float *x, const void *const *w,
                             const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads);
static quant_many_fn quant_many = racer_quant_many;
void racer_decoder_quant_from(quant_many_fn fn) { quant_many = fn ? fn : racer_quant_many; }

int racer_attention_capped(int type, const float *q, const void *k, const void *v, float *out, long n, long H,
                           long Hkv, long D, long cap, const int64_t *counts, const int64_t *inplace,
                           const int64_t *tail, long T, float scale, float softcap, int threads);

/* One layer's weights, as native.py lays them out (int64 words): norms and biases float32 (NULL for
 * no bias), projection weights at the weight type, and each projection's tile shape over a weight
 * stored as rows, or 0 x 0 for one stored as panels (native_panel.c); ``qtype``: 0, or the GGML type
 * of a weight kept as the GGUF file's blocks (native_quant.c; its tile is then unused); ``qnorm``,
 * ``knorm``: NULL, or the weights [head_dim] of an RMSNorm of each q and k head before the rotation
 * (Qwen3's and Gemma 3's). */
enum { Q, K, V, O, GATE, UP, DOWN, PROJECTIONS };
struct layer {
    const float *norm1, *norm2;
    const void *w[PROJECTIONS];
    const float *bias[PROJECTIONS];
    int64_t tile[PROJECTIONS][2]; /* nr, mr */
    int64_t qtype[PROJECTIONS];
    const float *qnorm, *knorm;
    const float *post_attn, *post_ffn; /* NULL, or RMSNorms of the attention's and the MLP's outputs (Gemma 3's) */
    int64_t windowed;                  /* 1: the layer attends over the segments' sliding-window keys */
    int64_t rope;                      /* its rotary values: 0 the call's first table, 1 its second */
};

/* One session's rows of the call [r0, r1) and its cache: layer 0's K at ``cache``, V after it;
 * ``past`` committed rows; the keys each row sees (racer_attention's counts, inplace, tail). */
struct segment {
    int64_t r0, r1;
    const char *cache;
    int64_t capacity, past;
    const int64_t *counts, *inplace, *tail;
    int64_t tail_width;
    const int64_t *wcounts, *winplace, *wtail; /* the keys each row sees in a sliding-window layer */
    int64_t wtail_width;
};

/* The model's shape and the call's constants; ``act`` the MLP's activation: 0 SiLU, 1 GELU (tanh);
 * ``softcap`` the attention scores' soft cap (Gemma 2's; 0: none). */
struct shape {
    int64_t hidden, heads, kv_heads, head_dim, inter, weight_type, cache_type, threads;
    float eps, scale;
    int64_t act;
    float softcap;
    int64_t rot_dim; /* the rotated dims of each head (head_dim, or fewer: Phi-3's partial rotary) */
};

/* y = w * (x / sqrt(mean(x^2) + eps)), one row of ``d`` values (y may be x). */
static void rms_norm(const float *x, const float *w, float *y, long d, float eps)
{
    float ss = 0.f;
    for (long i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (long i = 0; i < d; i++) y[i] = w[i] * (x[i] * r);
}

/* Rotary embedding of ``heads`` heads of one row in place: x*cos + rotate_half(x)*sin over each
 * head's first ``rot`` dims (cos, sin [rot]; Phi-3's partial rotary factor), the others as they are. */
static void rotate(float *x, const float *cos, const float *sin, long heads, long d, long rot)
{
    const long half = rot / 2;
    for (long h = 0; h < heads; h++, x += d)
        for (long i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

/* A float32 value rounded to nearest even bfloat16 (NaN kept a NaN). */
static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* ``d`` float32 values stored at the cache's type. */
static void store(void *dst, const float *src, long d, int type)
{
    if (type == F32)
        memcpy(dst, src, sizeof(float) * d);
    else if (type == BF16)
        for (long i = 0; i < d; i++) ((uint16_t *)dst)[i] = to_bf16(src[i]);
    else
        for (long i = 0; i < d; i++) ((_Float16 *)dst)[i] = (_Float16)src[i];
}

/* Projections first .. first + count - 1 of one layer (consecutive in ``enum``) from the same rows
 * x [n, in]: y[j] [n, out[j]]. Weights of one kind (all row tiles, or all stored as panels: tile
 * 0 x 0) share one parallel region; a mix runs one projection at a time. */
static int project(const struct shape *s, const struct layer *l, int first, int count, const float *x,
                   float *const *y, const int64_t *out, long n, long in)
{
    int panels = 0, blocks = 0;
    for (int j = first; j < first + count; j++) blocks += l->qtype[j] != 0;
    if (blocks == count)
        return quant_many(count, &l->qtype[first], x, &l->w[first], &l->bias[first], y, out, n, in, (int)s->threads);
    if (blocks) {
        for (int j = 0, rc; j < count; j++)
            if ((rc = project(s, l, first + j, 1, x, y + j, out + j, n, in))) return rc;
        return 0;
    }
    for (int j = first; j < first + count; j++) panels += l->tile[j][0] == 0;
    if (panels == count)
        return racer_panel_many(count, (int)s->weight_type, x, &l->w[first], &l->bias[first], y, out, n, in,
                                (int)s->threads);
    if (panels == 0)
        return racer_linear_many(count, &l->tile[first][0], (int)s->weight_type, x, &l->w[first], &l->bias[first],
                                 y, out, n, in, (int)s->threads);
    for (int j = 0, rc; j < count; j++)
        if ((rc = project(s, l, first + j, 1, x, y + j, out + j, n, in))) return rc;
    return 0;
}

/* Threads a rowwise step of ``rows`` rows takes: the call's where the rows are enough to share. Each
 * row's values are computed by one thread, the same steps on any, so the count changes no bits. */
static int threads_for(const struct shape *s, long rows) { return rows >= 8 && s->threads > 1 ? (int)s->threads : 1; }

/* One segment's rows of q and k normed per head (where the layer does) and rotated, and their K/V
 * rows written into its cache (kc, vc: this layer's planes). */
struct kv_rows {
    const struct shape *s;
    const struct layer *l;
    const struct segment *sg;
    float *q, *k;
    const float *v, *cos, *sin;
    char *kc, *vc;
};

static void kv_body(void *ctx, long lo, long hi, int tid)
{
    const struct kv_rows *c = ctx;
    const struct shape *s = c->s;
    const long D = s->head_dim, Hq = s->heads, Hk = s->kv_heads, es = s->cache_type == F32 ? 4 : 2;
    float *q = c->q, *k = c->k;
    (void)tid;
    for (long r = c->sg->r0 + lo; r < c->sg->r0 + hi; r++) {
        if (c->l->qnorm)
            for (long h = 0; h < Hq; h++) rms_norm(q + (r * Hq + h) * D, c->l->qnorm, q + (r * Hq + h) * D, D, s->eps);
        if (c->l->knorm)
            for (long h = 0; h < Hk; h++) rms_norm(k + (r * Hk + h) * D, c->l->knorm, k + (r * Hk + h) * D, D, s->eps);
        const long R = s->rot_dim;
        rotate(q + r * Hq * D, c->cos + r * R, c->sin + r * R, Hq, D, R);
        rotate(k + r * Hk * D, c->cos + r * R, c->sin + r * R, Hk, D, R);
        const long row = c->sg->past + r - c->sg->r0;
        for (long h = 0; h < Hk; h++) {
            store(c->kc + (h * c->sg->capacity + row) * D * es, k + (r * Hk + h) * D, D, (int)s->cache_type);
            store(c->vc + (h * c->sg->capacity + row) * D * es, c->v + (r * Hk + h) * D, D, (int)s->cache_type);
        }
    }
}

/* Attention of layer ``i``: the rows' rotated q/k, their K/V rows written into each segment's cache,
 * then each segment's rows over its own cache. q [n, heads*D], k/v [n, kv_heads*D]; out [n, heads*D]. */
static int attend(const struct shape *s, long i, const struct layer *l, const struct segment *seg, long segments,
                  float *q, float *k, const float *v, const float *cos, const float *sin, float *out)
{
    const long D = s->head_dim, Hq = s->heads, Hk = s->kv_heads, es = s->cache_type == F32 ? 4 : 2;
    for (long g = 0; g < segments; g++) {
        const struct segment *sg = &seg[g];
        const long plane = Hk * sg->capacity * D * es; /* K or V of one layer */
        char *kc = (char *)sg->cache + 2 * i * plane, *vc = kc + plane;
        struct kv_rows c = {s, l, sg, q, k, v, cos, sin, kc, vc};
        const long rows = sg->r1 - sg->r0;
        const int nth = threads_for(s, rows);
        racer_pfor(rows, (rows + 2 * nth - 1) / (2 * nth), nth, kv_body, &c);
        const int win = l->windowed != 0;
        int rc = racer_attention_capped((int)s->cache_type, q + sg->r0 * Hq * D, kc, vc, out + sg->r0 * Hq * D,
                                        sg->r1 - sg->r0, Hq, Hk, D, sg->capacity, win ? sg->wcounts : sg->counts,
                                        win ? sg->winplace : sg->inplace, win ? sg->wtail : sg->tail,
                                        win ? sg->wtail_width : sg->tail_width, s->scale, s->softcap,
                                        (int)s->threads);
        if (rc) return rc;
    }
    return 0;
}

/* Work space of one call, float32: a normed row, q, k, v, attention out, gate, up, a projection out. */
struct work {
    float *h, *q, *k, *v, *a, *g, *u, *y;
};

/* silu(g) * u, or gelu(g) * u with GELU's tanh approximation (``act`` 1), over one row of ``count``
 * values, in place in g. Both are g * sigmoid(z): z = g for SiLU, z = 2 * 0.79788456 * (g + 0.044715
 * g^3) for GELU (0.5 * (1 + tanh(z / 2)) = sigmoid(z)); sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e)
 * below, with e = exp(-|z|) (``vexp``: a fixed polynomial, the same operations in every lane). A row's
 * last values are one vector padded with zeros, so every value takes the same operations wherever it
 * stands and however many rows share the call. */
static void gate_row(float *g, const float *u, long count, int64_t act)
{
    for (long c = 0; c < count; c += VL) {
        const long m = count - c < VL ? count - c : VL;
        vf x = {0}, y = {0};
        if (m == VL) {
            x = load_f32(g + c);
            y = load_f32(u + c);
        } else {
            memcpy(&x, g + c, sizeof(float) * m);
            memcpy(&y, u + c, sizeof(float) * m);
        }
        const vf z = act == 1 ? 1.5957691216057308f * (x + 0.044715f * x * x * x) : x;
        const vi neg = z < 0;
        vf a = z;
        vi bits;
        memcpy(&bits, &a, sizeof bits);
        bits &= 0x7fffffff;
        memcpy(&a, &bits, sizeof a);
        const vf e = vexp((vf){0} - a), one = (vf){0} + 1.0f;
        vi eb, ob;
        memcpy(&eb, &e, sizeof eb);
        memcpy(&ob, &one, sizeof ob);
        eb = (eb & neg) | (ob & ~neg); /* the numerator: e where z < 0, else 1 */
        vf num;
        memcpy(&num, &eb, sizeof num);
        const vf out = x * (num / (1.0f + e)) * y;
        if (m == VL)
            *(vfu *)(g + c) = out;
        else
            memcpy(g + c, &out, sizeof(float) * m);
    }
}

/* The rowwise steps between a layer's products, each over rows [lo, hi) (``rows``). */
enum { NORM1, ADD_ATTN, NORM2, GATE_UP, ADD_MLP };
struct row_step {
    const struct shape *s;
    const struct layer *l;
    float *x;
    struct work *w;
    int step;
};

static void row_body(void *ctx, long lo, long hi, int tid)
{
    const struct row_step *c = ctx;
    const struct shape *s = c->s;
    const struct layer *l = c->l;
    const long E = s->hidden, I = s->inter;
    struct work *w = c->w;
    (void)tid;
    for (long r = lo; r < hi; r++) {
        float *x = c->x + r * E, *y = w->y + r * E;
        switch (c->step) {
        case NORM1: rms_norm(x, l->norm1, w->h + r * E, E, s->eps); break;
        case NORM2: rms_norm(x, l->norm2, w->h + r * E, E, s->eps); break;
        case GATE_UP: gate_row(w->g + r * I, w->u + r * I, I, s->act); break;
        default: { /* the attention's or the MLP's output (normed where the layer norms it) into the residual */
            const float *post = c->step == ADD_ATTN ? l->post_attn : l->post_ffn;
            if (post) rms_norm(y, post, y, E, s->eps);
            for (long j = 0; j < E; j++) x[j] += y[j];
        }
        }
    }
}

static void rows(const struct shape *s, const struct layer *l, float *x, struct work *w, long n, int step)
{
    struct row_step c = {s, l, x, w, step};
    const int nth = threads_for(s, n);
    racer_pfor(n, (n + 2 * nth - 1) / (2 * nth), nth, row_body, &c);
}

static int layer_forward(const struct shape *s, long i, const struct layer *l, const struct segment *seg,
                         long segments, float *x, long n, const float *const *cos, const float *const *sin,
                         struct work *w)
{
    const long E = s->hidden, D = s->head_dim, Hq = s->heads * D, Hk = s->kv_heads * D, I = s->inter;
    int rc = 0;
    const int64_t qkv[3] = {Hq, Hk, Hk}, wide[2] = {I, I}, narrow[1] = {E};
    rows(s, l, x, w, n, NORM1);
    if ((rc = project(s, l, Q, 3, w->h, (float *const[]){w->q, w->k, w->v}, qkv, n, E))) return rc;
    if ((rc = attend(s, i, l, seg, segments, w->q, w->k, w->v, cos[l->rope != 0], sin[l->rope != 0], w->a))) return rc;
    if ((rc = project(s, l, O, 1, w->a, &w->y, narrow, n, Hq))) return rc;
    rows(s, l, x, w, n, ADD_ATTN);
    rows(s, l, x, w, n, NORM2);
    if ((rc = project(s, l, GATE, 2, w->h, (float *const[]){w->g, w->u}, wide, n, E))) return rc;
    rows(s, l, x, w, n, GATE_UP);
    if ((rc = project(s, l, DOWN, 1, w->g, &w->y, narrow, n, I))) return rc;
    rows(s, l, x, w, n, ADD_MLP);
    return 0;
}

/* Every layer over x [n, hidden] (float32, updated in place: the residual stream after the last
 * layer), then the final RMSNorm (weight ``norm``) into ``out`` [n, hidden] float32. cos/sin
 * [n, rot_dim] float32: each row's rotary values; cos2/sin2 those of a second table (Gemma 3's
 * local layers: ``rope`` 1), or the same. 0, -1 for a tile this build does not have or a head shape
 * attention does not take, -2 out of memory. */
int racer_decoder(const struct shape *s, const struct layer *layers, long n_layers, const struct segment *seg,
                  long segments, float *x, long n, const float *cos, const float *sin, const float *norm, float *out,
                  const float *cos2, const float *sin2)
{
    const float *const coss[2] = {cos, cos2}, *const sins[2] = {sin, sin2};
    if (s->rot_dim < 2 || s->rot_dim > s->head_dim || s->rot_dim % 2) return -1;
    const long E = s->hidden, Hq = s->heads * s->head_dim, Hk = s->kv_heads * s->head_dim, I = s->inter;
    const long widest = E > I ? E : I;
    float *all = malloc(sizeof(float) * n * (E + 2 * Hq + 2 * Hk + 2 * I + widest));
    if (!all) return -2;
    struct work w = {.h = all};
    w.q = w.h + n * E, w.k = w.q + n * Hq, w.v = w.k + n * Hk, w.a = w.v + n * Hk;
    w.g = w.a + n * Hq, w.u = w.g + n * I, w.y = w.u + n * I;
    int rc = 0;
    racer_pool_hold(1); /* the pool's workers spin between this forward's loops, and sleep after it */
    for (long i = 0; i < n_layers && !rc; i++) rc = layer_forward(s, i, &layers[i], seg, segments, x, n, coss, sins, &w);
    racer_pool_hold(0);
    free(all);
    for (long r = 0; r < n && !rc; r++) rms_norm(x + r * E, norm, out + r * E, E, s->eps);
    return rc;
}

