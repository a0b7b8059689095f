/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) over a weight kept as a GGUF file stores it: each row a
 * run of quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 32 values a block; Q4_K, Q5_K, Q6_K: 256),
 * read in place.
 *
 * The arithmetic is llama.cpp's: each row of x is quantized to 8 bits per 32 values (a float32 scale
 * dx = max|x| / 127, the values rounded to nearest, and for the formats with a minimum the block's
 * sum sx = dx * sum(q)), and each 32-value block of a weight row is multiplied with it as integers.
 * The integer products and sums are exact in any order, so the float32 steps alone decide the bits,
 * and they are fixed: per output, 8 float32 lanes, lane j of block b taking
 *     acc[j] = fma(ws[j] * dx[b], (float) isum[j], acc[j])
 * where isum[j] is the integer dot product of values 4j .. 4j + 3 of the block and ws[j] the weight's
 * scale for them (one per block; Q6_K has one per 16 values); blocks in order. Then
 *     y = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + msum (+ bias)
 * with msum = fma(min[b], sx[b], msum) over the blocks in order (Q4_1, Q5_1, Q4_K, Q5_K). Each output is thus
 * the same float32 operations whatever the rows it shares a call with, the tile, the thread or the
 * vector unit: row invariant by construction. AVX2's maddubs/madd, AVX-VNNI's and AVX512-VNNI's
 * dpbusd and the generic C code all make the same integers, so every build gives the same bits.
 *
 * The integer products never saturate: a 4-, 5- or 6-bit unsigned weight value times a quantized
 * activation (|q| <= 127), two of them summed into 16 bits, stays under 2 * 63 * 127; a signed 8-bit
 * weight is multiplied as |w| times x with w's sign, at most 2 * 128 * 127 < 32768. The offset
 * formats (Q4_0: values 0..15 standing for v - 8, Q5_0: 0..31 for v - 16, Q6_K: 0..63 for v - 32)
 * subtract offset * sum(q) from the unsigned products' sum.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"

/* Whether this thread's tiles hold the block kernel's configuration (AMX: native_attention.c's tiles
 * clear it when they load theirs). */
__thread int racer_tiles_quant = 0;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

/* GGML's type numbers. */
enum { GQ4_0 = 2, GQ4_1 = 3, GQ5_0 = 6, GQ5_1 = 7, GQ8_0 = 8, GQ4_K = 12, GQ5_K = 13, GQ6_K = 14 };

static float half_to_float(uint16_t h)
{
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* Bytes a block takes and values it holds. */
static long block_bytes(int type)
{
    switch (type) {
    case GQ4_0: return 18;
    case GQ4_1: return 20;
    case GQ5_0: return 22;
    case GQ5_1: return 24;
    case GQ8_0: return 34;
    case GQ4_K: return 144;
    case GQ5_K: return 176;
    case GQ6_K: return 210;
    default: return 0;
    }
}
static long block_values(int type) { return type == GQ4_K || type == GQ5_K || type == GQ6_K ? 256 : 32; }

/* Whether a format's blocks have a minimum (value = scale * v + min), and the offset o of the formats
 * whose unsigned values v stand for v - o (Q8_0's signed bytes: none). */
static inline int has_min(int type) { return type == GQ4_1 || type == GQ5_1 || type == GQ4_K || type == GQ5_K; }
static inline int value_offset(int type) { return type == GQ4_0 ? 8 : type == GQ5_0 ? 16 : type == GQ6_K ? 32 : 0; }

/* A little-endian uint32 at p (Q5_0's and Q5_1's high bits). */
static inline uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

#define PACKED 256 /* a packed weight's type: its GGML number + PACKED (racer_quant_pack) */
static long packed_bytes(int type);
int racer_quant_many(int count, const int64_t *types, const float *x, const void *const *w,
                     const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads);

/* Whether the kernel takes weights of ``type`` (GGML's number, or a packed one's). */
int racer_quant_supported(int type) { return block_bytes(type) > 0 || (type > PACKED && packed_bytes(type - PACKED) > 0); }

/* Which integer instructions this build multiplies with: 2 AVX512-VNNI, 1 AVX-VNNI, 0 AVX2, -1 C. */
int racer_quant_isa(void)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVXVNNI__)
    return 1;
#elif defined(QUANT_AVX2)
    return 0;
#else
    return -1;
#endif
}

/* Q4_K's 6-bit scale and minimum of sub-block j (0..7), as llama.cpp unpacks them. */
static void k4_scale(const uint8_t *q, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 32-value block b of a row: its values as bytes (``sign``: 0 unsigned u8, 1 signed s8, or an offset
 * o > 1: unsigned bytes standing for v - o), the scale of each group of 4 values (8 lanes) and the
 * block's minimum (0 for formats without one). Value i of the block is ws[i / 4] * (v[i] - o) + min. */
static void unpack(int type, const uint8_t *row, long b, uint8_t v[32], float ws[8], float *min, int *offset)
{
    *min = 0.f;
    *offset = 0;
    if (type == GQ4_0 || type == GQ4_1) {
        const uint8_t *p = row + b * block_bytes(type);
        const float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
        if (type == GQ4_1) *min = half_to_float((uint16_t)(p[2] | p[3] << 8));
        const uint8_t *qs = p + (type == GQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; i++) v[i] = qs[i] & 0xF, v[i + 16] = qs[i] >> 4;
        for (int j = 0; j < 8; j++) ws[j] = d;
        *offset = type == GQ4_0 ? 8 : 0;
    } else if (type == GQ5_0 || type == GQ5_1) { /* d, (m,) qh: bit i value i's fifth bit, qs as Q4_0's */
        const uint8_t *p = row + b * block_bytes(type);
        const float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
        if (type == GQ5_1) *min = half_to_float((uint16_t)(p[2] | p[3] << 8));
        const uint8_t *h = p + (type == GQ5_1 ? 4 : 2), *qs = h + 4;
        const uint32_t qh = le32(h);
        for (int i = 0; i < 16; i++) {
            v[i] = (uint8_t)((qs[i] & 0xF) | ((qh >> i) & 1) << 4);
            v[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        }
        for (int j = 0; j < 8; j++) ws[j] = d;
        *offset = type == GQ5_0 ? 16 : 0;
    } else if (type == GQ8_0) {
        const uint8_t *p = row + b * 34;
        const float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
        memcpy(v, p + 2, 32);
        for (int j = 0; j < 8; j++) ws[j] = d;
        *offset = 1;
    } else if (type == GQ4_K) {
        const uint8_t *p = row + (b / 8) * 144;
        const int s = (int)(b % 8);
        const float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
        const float dmin = half_to_float((uint16_t)(p[2] | p[3] << 8));
        int sc, m;
        k4_scale(p + 4, s, &sc, &m);
        const uint8_t *qs = p + 16 + 32 * (s / 2);
        for (int i = 0; i < 32; i++) v[i] = s % 2 ? qs[i] >> 4 : qs[i] & 0xF;
        for (int j = 0; j < 8; j++) ws[j] = d * (float)sc;
        *min = -(dmin * (float)m);
    } else if (type == GQ5_K) { /* Q4_K's fields, then qh[32] (bit s of byte i: value i's fifth bit in sub-block s), qs[128] */
        const uint8_t *p = row + (b / 8) * 176;
        const int s = (int)(b % 8);
        const float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
        const float dmin = half_to_float((uint16_t)(p[2] | p[3] << 8));
        int sc, m;
        k4_scale(p + 4, s, &sc, &m);
        const uint8_t *qh = p + 16, *qs = p + 48 + 32 * (s / 2);
        for (int i = 0; i < 32; i++)
            v[i] = (uint8_t)((s % 2 ? qs[i] >> 4 : qs[i] & 0xF) | ((qh[i] >> s) & 1) << 4);
        for (int j = 0; j < 8; j++) ws[j] = d * (float)sc;
        *min = -(dmin * (float)m);
    } else { /* Q6_K */
        const uint8_t *p = row + (b / 8) * 210;
        const int s = (int)(b % 8), h = s / 4, k = s % 4;
        const uint8_t *ql = p + 64 * h + 32 * (k & 1), *qh = p + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(p + 192) + 8 * h + 2 * k;
        const float d = half_to_float((uint16_t)(p[208] | p[209] << 8));
        for (int i = 0; i < 32; i++)
            v[i] = (uint8_t)(((k < 2 ? ql[i] & 0xF : ql[i] >> 4)) | (((qh[i] >> (2 * k)) & 3) << 4));
        for (int j = 0; j < 8; j++) ws[j] = d * (float)sc[j / 4];
        *offset = 32;
    }
}

/* Rows of x quantized per 32 values: q [M, K] int8, d and s [M, K / 32] float32. */
struct xq {
    int8_t *q;
    float *d, *s;
    long nb;
};

/* 32 values of x to 8 bits: scale max|x| / 127, rounded to nearest. Returns the scale; *sum the
 * values' integer sum, and *first (where not NULL) that of the first 16. The AVX2 build's vectors make
 * the same bits as the loops: a maximum and integer sums are the same in any order, a NaN is passed
 * over by either, each value takes the same multiply and the same rounding (to nearest even, as
 * nearbyintf under the default mode), and a byte is the low 8 bits of its 32-bit value. */
#if defined(QUANT_AVX2)
static float quantize_block(const float *xb, int8_t *q, int *sum, int *first)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), m); /* a NaN's lane keeps m's value */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float db = amax / 127.f, id = db != 0.f ? 127.f / amax : 0.f;
    const __m256 ids = _mm256_set1_ps(id);
    /* byte 0 of each 32-bit lane to the lane's low 4 bytes of its 128-bit half */
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i s[2];
    for (int i = 0; i < 4; i++) {
        const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], ids));
        s[i / 2] = i % 2 ? _mm256_add_epi32(s[i / 2], n) : n;
        const __m256i b = _mm256_shuffle_epi8(n, low);
        int32_t lo = _mm256_cvtsi256_si32(b), hi = _mm256_extract_epi32(b, 4);
        memcpy(q + 8 * i, &lo, 4);
        memcpy(q + 8 * i + 4, &hi, 4);
    }
    int32_t lanes[2][8];
    _mm256_storeu_si256((__m256i *)lanes[0], s[0]);
    _mm256_storeu_si256((__m256i *)lanes[1], s[1]);
    int a = 0, b = 0;
    for (int j = 0; j < 8; j++) a += lanes[0][j], b += lanes[1][j];
    *sum = (int)((unsigned)a + (unsigned)b);
    if (first) *first = a;
    return db;
}
#else
static float quantize_block(const float *xb, int8_t *q, int *sum, int *first)
{
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
    }
    const float db = amax / 127.f, id = db != 0.f ? 127.f / amax : 0.f;
    *sum = 0;
    for (int i = 0; i < 32; i++) {
        const int v = (int)nearbyintf(xb[i] * id);
        q[i] = (int8_t)v;
        *sum += v;
        if (i == 15 && first) *first = *sum;
    }
    return db;
}
#endif

static void quantize_row(const float *x, long K, int8_t *q, float *d, float *s)
{
    for (long b = 0; b < K / 32; b++) {
        int sum;
        d[b] = quantize_block(x + 32 * b, q + 32 * b, &sum, NULL);
        s[b] = d[b] * (float)sum;
    }
}

/* The fixed sum of 8 lanes. */
static inline float lanes_sum(const float a[8])
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#if defined(QUANT_AVX2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

/* 4 bytes at p as one int32 (for a broadcast). */
static inline int32_t load32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 8 int32 lanes, lane j the dot product of bytes 4j .. 4j + 3: u unsigned, s signed. */
static inline __m256i dot_us(__m256i u, __m256i s)
{
#if defined(DPBUSD)
    return DPBUSD(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The 32 bits of a little-endian uint32 at p as 32 bytes: byte i 0x10 where bit i is set, else 0
 * (Q5_0's and Q5_1's fifth bits, in place). */
static inline __m256i bits_to_0x10(const uint8_t *p)
{
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)le32(p)), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
}

/* Block b of a row widened in registers: 32 bytes (as ``unpack`` describes) and its lane scales. */
static inline __attribute__((always_inline)) __m256i block_bytes_avx2(int type, const uint8_t *row, long b, __m256 *ws, float *min)
{
    const __m256i low4 = _mm256_set1_epi8(0xF);
    if (type == GQ5_0 || type == GQ5_1) {
        const uint8_t *p = row + b * block_bytes(type);
        *ws = _mm256_set1_ps(half_to_float((uint16_t)(p[0] | p[1] << 8)));
        *min = type == GQ5_1 ? half_to_float((uint16_t)(p[2] | p[3] << 8)) : 0.f;
        const uint8_t *h = p + (type == GQ5_1 ? 4 : 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(h + 4));
        const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
        return _mm256_or_si256(lo, bits_to_0x10(h));
    }
    if (type == GQ5_K) {
        const uint8_t *p = row + (b / 8) * 176;
        const int s = (int)(b % 8);
        int sc, m;
        k4_scale(p + 4, s, &sc, &m);
        *ws = _mm256_set1_ps(half_to_float((uint16_t)(p[0] | p[1] << 8)) * (float)sc);
        *min = -(half_to_float((uint16_t)(p[2] | p[3] << 8)) * (float)m);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * (s / 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        const __m256i lo = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    if (type == GQ4_0 || type == GQ4_1) {
        const uint8_t *p = row + b * block_bytes(type);
        *ws = _mm256_set1_ps(half_to_float((uint16_t)(p[0] | p[1] << 8)));
        *min = type == GQ4_1 ? half_to_float((uint16_t)(p[2] | p[3] << 8)) : 0.f;
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + (type == GQ4_1 ? 4 : 2)));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
    }
    if (type == GQ8_0) {
        const uint8_t *p = row + b * 34;
        *ws = _mm256_set1_ps(half_to_float((uint16_t)(p[0] | p[1] << 8)));
        *min = 0.f;
        return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
    if (type == GQ4_K) {
        const uint8_t *p = row + (b / 8) * 144;
        const int s = (int)(b % 8);
        int sc, m;
        k4_scale(p + 4, s, &sc, &m);
        *ws = _mm256_set1_ps(half_to_float((uint16_t)(p[0] | p[1] << 8)) * (float)sc);
        *min = -(half_to_float((uint16_t)(p[2] | p[3] << 8)) * (float)m);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * (s / 2)));
        return _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
    }
    const uint8_t *p = row + (b / 8) * 210; /* Q6_K */
    const int s = (int)(b % 8), h = s / 4, k = s % 4;
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * h + 2 * k;
    const float d = half_to_float((uint16_t)(p[208] | p[209] << 8));
    const float lo = d * (float)sc[0], hi = d * (float)sc[1];
    *ws = _mm256_setr_ps(lo, lo, lo, lo, hi, hi, hi, hi);
    *min = 0.f;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (k & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    const __m256i l4 = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
    return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4));
}
#endif

/* One weight row against R rows of x (R <= 4), rows m0 .. m0 + R - 1: y[r] (stride ``ys``). */
static inline __attribute__((always_inline)) void row_dot(int R, int type, const uint8_t *row, const struct xq *X,
                                                          long m0, float *y, long ys, float bias)
{
    const long nb = X->nb;
    const int signed8 = type == GQ8_0;
    const int offset = value_offset(type);
    float msum[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(QUANT_AVX2)
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i off = _mm256_set1_epi8((char)offset);
    for (long b = 0; b < nb; b++) {
        __m256 ws;
        float min;
        const __m256i w = block_bytes_avx2(type, row, b, &ws, &min);
        const __m256i wa = signed8 ? _mm256_sign_epi8(w, w) : w; /* |w| for signed weights */
        for (int r = 0; r < R; r++) {
            const long m = m0 + r;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(X->q + m * nb * 32 + 32 * b));
            __m256i isum;
            if (signed8)
                isum = dot_us(wa, _mm256_sign_epi8(x, w));
            else if (offset)
                isum = _mm256_sub_epi32(dot_us(w, x), dot_us(off, x));
            else
                isum = dot_us(w, x);
            const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(X->d[m * nb + b]));
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[r]);
            if (has_min(type)) msum[r] = fmaf(min, X->s[m * nb + b], msum[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float a[8];
        _mm256_storeu_ps(a, acc[r]);
        y[r * ys] = lanes_sum(a) + msum[r] + bias;
    }
#else
    float acc[4][8] = {{0.f}};
    for (long b = 0; b < nb; b++) {
        uint8_t v[32];
        float ws[8], min;
        int o;
        unpack(type, row, b, v, ws, &min, &o);
        const int8_t *sv = (const int8_t *)v; /* Q8_0's values: signed bytes read as such (see quant_packed_ref) */
        for (int r = 0; r < R; r++) {
            const long m = m0 + r;
            const int8_t *x = X->q + m * nb * 32 + 32 * b;
            for (int j = 0; j < 8; j++) {
                int isum = 0;
                for (int i = 4 * j; i < 4 * j + 4; i++)
                    isum += (signed8 ? (int)sv[i] : (int)v[i] - offset) * (int)x[i];
                acc[r][j] = fmaf(ws[j] * X->d[m * nb + b], (float)isum, acc[r][j]);
            }
            if (has_min(type)) msum[r] = fmaf(min, X->s[m * nb + b], msum[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ys] = lanes_sum(acc[r]) + msum[r] + bias;
#endif
}

/* One weight row against every row of x, four at a time; compiled once per type (``type`` constant). */
static inline __attribute__((always_inline)) void row_all_of(int type, const uint8_t *row, const struct xq *X, long M,
                                                             float *y, long N, float bias)
{
    long m = 0;
    for (; m + 4 <= M; m += 4) row_dot(4, type, row, X, m, y + m * N, N, bias);
    switch (M - m) {
    case 3: row_dot(3, type, row, X, m, y + m * N, N, bias); break;
    case 2: row_dot(2, type, row, X, m, y + m * N, N, bias); break;
    case 1: row_dot(1, type, row, X, m, y + m * N, N, bias); break;
    default: break;
    }
}

#define ROW_ALL(T)                                                                                             \
    static void row_all_##T(const uint8_t *row, const struct xq *X, long M, float *y, long N, float bias)      \
    {                                                                                                          \
        row_all_of(T, row, X, M, y, N, bias);                                                                  \
    }
ROW_ALL(GQ4_0)
ROW_ALL(GQ4_1)
ROW_ALL(GQ5_0)
ROW_ALL(GQ5_1)
ROW_ALL(GQ8_0)
ROW_ALL(GQ4_K)
ROW_ALL(GQ5_K)
ROW_ALL(GQ6_K)

static void row_all(int type, const uint8_t *row, const struct xq *X, long M, float *y, long N, float bias)
{
    switch (type) {
    case GQ4_0: row_all_GQ4_0(row, X, M, y, N, bias); break;
    case GQ4_1: row_all_GQ4_1(row, X, M, y, N, bias); break;
    case GQ5_0: row_all_GQ5_0(row, X, M, y, N, bias); break;
    case GQ5_1: row_all_GQ5_1(row, X, M, y, N, bias); break;
    case GQ8_0: row_all_GQ8_0(row, X, M, y, N, bias); break;
    case GQ4_K: row_all_GQ4_K(row, X, M, y, N, bias); break;
    case GQ5_K: row_all_GQ5_K(row, X, M, y, N, bias); break;
    default: row_all_GQ6_K(row, X, M, y, N, bias); break;
    }
}

struct rows_call {
    const int64_t *types;
    const void *const *w;
    const float *const *bias;
    float *const *y;
    const int64_t *N;
    const struct xq *X;
    long M, K;
};

/* Weight rows [lo, hi) of a quant_rows_many call, counted across its projections. */
static void rows_body(void *ctx, long lo, long hi, int tid)
{
    const struct rows_call *c = ctx;
    (void)tid;
    for (long t = lo; t < hi; t++) {
        int j = 0;
        long n = t;
        while (n >= c->N[j]) n -= c->N[j++];
        const long row_bytes = c->K / block_values((int)c->types[j]) * block_bytes((int)c->types[j]);
        row_all((int)c->types[j], (const uint8_t *)c->w[j] + n * row_bytes, c->X, c->M, c->y[j] + n, c->N[j],
                c->bias && c->bias[j] ? c->bias[j][n] : 0.f);
    }
}

/* racer_quant_many over weights whose rows are as the file stores them: w[j] of GGML type types[j],
 * N[j] rows of K / block_values blocks. x is quantized once; the
 * projections' rows share one parallel region (threads split weight rows, never K). 0, -1 for a type
 * or K the kernel does not take, -2 out of memory. */
static int quant_rows_many(int count, const int64_t *types, const float *x, const void *const *w,
                           const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads)
{
    long total = 0;
    for (int j = 0; j < count; j++) {
        if (!racer_quant_supported((int)types[j]) || K % block_values((int)types[j])) return -1;
        total += N[j];
    }
    struct xq X = {.nb = K / 32};
    void *mem = malloc((size_t)M * K + sizeof(float) * 2 * M * X.nb + 64);
    if (!mem) return -2;
    X.q = mem;
    X.d = (float *)((char *)mem + ((M * K + 15) & ~15L));
    X.s = X.d + M * X.nb;
    for (long m = 0; m < M; m++) quantize_row(x + m * K, K, X.q + m * K, X.d + m * X.nb, X.s + m * X.nb);
    struct rows_call c = {types, w, bias, y, N, &X, M, K};
    racer_pfor(total, (total + 2 * threads - 1) / (2 * threads > 0 ? 2 * threads : 1), threads, rows_body, &c);
    free(mem);
    return 0;
}

/* One projection: y [M, N] = x [M, K] @ w^T (+ bias). */
int racer_quant(int type, const float *x, const void *w, const float *bias, float *y, long M, long N, long K,
                int threads)
{
    const int64_t t = type, n = N;
    return racer_quant_many(1, &t, x, &w, &bias, &y, &n, M, K, threads);
}

static int quant_packed_many(int count, const int64_t *types, const float *x, const void *const *w,
                             const float *const *bias, float *const *y, const int64_t *N, long M, long K,
                             int threads, int simd);

/* ``count`` projections of the same rows x [M, K] (float32): y[j] [M, N[j]] = x @ w[j]^T (+ bias[j]),
 * w[j] of type types[j]: a GGML number (rows as the file stores them) or a packed one (groups of 8
 * rows, racer_quant_pack). Projections of one layout share one parallel region; a mix runs one at a
 * time. 0, -1 for a type or K the kernel does not take, -2 out of memory. */
int racer_quant_many(int count, const int64_t *types, const float *x, const void *const *w,
                     const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads)
{
    int packed = 0;
    for (int j = 0; j < count; j++) packed += types[j] > PACKED;
    if (packed == count) return quant_packed_many(count, types, x, w, bias, y, N, M, K, threads, 1);
    if (packed == 0) return quant_rows_many(count, types, x, w, bias, y, N, M, K, threads);
    for (int j = 0, rc; j < count; j++)
        if ((rc = racer_quant_many(1, types + j, x, w + j, bias ? bias + j : NULL, y + j, N + j, M, K, threads)))
            return rc;
    return 0;
}

static void packed_block(int type, const uint8_t *gb, int j, uint8_t *out);
static void k_unpack(int type, const uint8_t *g, int j, long b, uint8_t v[32], float ws[8], float *min, int *offset);
static inline int is_k(int type);
static long group_bytes(int type, long K);

/* Rows ``ids`` [n] of a quantized weight [rows, K] (as the file stores it, or packed) dequantized to
 * float32 out [n, K]: value i of a block is ws * (v - offset) + min, as the file defines it (an
 * embedding lookup). */
int racer_quant_rows(int type, const void *w, const int64_t *ids, long n, long K, float *out)
{
    const int packed = type > PACKED;
    const int base = packed ? type - PACKED : type;
    if (!racer_quant_supported(type) || K % block_values(base)) return -1;
    const long nb = K / 32, row_bytes = K / block_values(base) * block_bytes(base);
    for (long r = 0; r < n; r++)
        for (long b = 0; b < nb; b++) {
            uint8_t v[32], blk[34];
            float ws[8], min;
            int o;
            if (packed && is_k(base)) {
                k_unpack(base, (const uint8_t *)w + (ids[r] / 8) * group_bytes(base, K), (int)(ids[r] % 8), b, v, ws, &min, &o);
            } else if (packed) {
                packed_block(base, (const uint8_t *)w + ((ids[r] / 8) * nb + b) * packed_bytes(base), (int)(ids[r] % 8), blk);
                unpack(base, blk, 0, v, ws, &min, &o);
            } else {
                unpack(base, (const uint8_t *)w + ids[r] * row_bytes, b, v, ws, &min, &o);
            }
            const int8_t *sv = (const int8_t *)v;
            for (int i = 0; i < 32; i++) {
                const int q = o == 1 ? (int)sv[i] : (int)v[i] - o;
                out[r * K + 32 * b + i] = ws[i / 4] * (float)q + min;
            }
        }
    return 0;
}

/* -- Packed groups: the 32-value formats' blocks, 8 weight rows interleaved ---------------------------
 *
 * racer_quant_pack moves a Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weight's bytes (rows a multiple of 8) into
 * groups of 8 rows; within a group, block b of all 8 rows is one run of bytes: the values first
 * (Q4_0/Q4_1/Q5_0/Q5_1: 4 runs of 32 bytes, run c holding bytes 4c .. 4c + 3 of each row's 16 nibble
 * bytes in row order, so that its low nibbles are values 4c .. 4c + 3 of the 8 rows and its high
 * nibbles values 16 + 4c .. 16 + 4c + 3; Q8_0: 8 runs of 32 bytes, run t holding values 4t .. 4t + 3 of
 * the 8 rows in row order), then the 8 rows' float16
 * scales, then (Q4_1, Q5_1) their 8 float16 minimums, then (Q5_0, Q5_1) their 8 32-bit words of fifth
 * bits, each row's bits reordered within its word: bit t of byte i is value 4t + i's (the file's bit
 * 4t + i), so that values 4t .. 4t + 3 take bit t of the word's 4 bytes, one shift for all 8 rows.
 * The same bytes as the file, moved (the fifth bits within their word): nothing is widened. A packed
 * type's number is its GGML number + PACKED.
 *
 * Over packed groups each output is the integer dot product of a whole 32-value block (exact),
 * then per block, in order, with float32 rounding at each step:
 *     acc = fma(dw[b] * dx[b], (float) isum[b], acc)      msum = fma(min[b], sx[b], msum)
 *     y = (acc + msum) + bias
 * where dw/min are the weight block's, dx the activation block's scale and sx = dx * sum(q) (Q4_1
 * and Q5_1 only; msum stays 0 otherwise), and isum = sum(v * q) - offset * sum(q) (Q4_0's offset 8,
 * Q5_0's 16). The SIMD code computes 8 weight rows' outputs in the 8 float lanes of one vector (two
 * groups side by side: two such vectors, or with AVX-512 the 16 lanes of one), so each lane is one
 * output's steps exactly: row invariant, and the same bits as the C code (quant_packed_ref). These
 * are not the bits of the rows as stored (row_dot keeps 8 partial sums a block): a weight is served
 * in one layout for its life. */
static long packed_bytes(int type) /* one block of a group of 8 rows (K-quants: one super-block) */
{
    switch (type) {
    case GQ4_0: return 8 * 18;
    case GQ4_1: return 8 * 20;
    case GQ5_0: return 8 * 22;
    case GQ5_1: return 8 * 24;
    case GQ8_0: return 8 * 34;
    case GQ4_K: return 160 + 8 * 128;
    case GQ5_K: return 160 + 8 * 160;
    case GQ6_K: return 144 + 8 * 192;
    default: return 0;
    }
}

/* -- Packed K-quants ------------------------------------------------------------------------------
 *
 * A K-quant's super-block (256 values) of a group's 8 rows is one run of bytes: a header, then its 8
 * sub-blocks of 32 values, each laid out as a nibble format's values are (4 runs of 32 bytes, above),
 * followed by (Q5_K) the 8 rows' words of fifth bits as Q5_0's, or (Q6_K) two runs of 32 bytes of
 * high bits: in run h, byte i of row j holds at bits 2u, 2u + 1 the top two bits of value
 * 4 (4h + u) + i (u = 0..3), so that one shift and mask bring values 4t .. 4t + 3's to bits 4-5. The
 * header: Q4_K and Q5_K the 8 rows' float16 d, their 8 float16 dmin, then the 6-bit scales and
 * minimums unpacked to a byte each ([sub-block][row], 64 bytes each); Q6_K the 8 rows' float16 d,
 * then the signed scales ([sub-block][half][row], 128 bytes). Q6_K takes the file's bytes exactly;
 * Q4_K and Q5_K 32 bytes more a group's super-block (the unpacked scales), 2.8% and 2.3%.
 *
 * The arithmetic per 32-value sub-block b, in integers (exact), then one float step per block as the
 * 32-value formats take:
 *     Q4_K, Q5_K:  is = sc[b] * sum(v * q)          Q6_K:  is = sc_lo[b] * (sum_lo(v * q) - 32 sum_lo(q))
 *                                                                + sc_hi[b] * (sum_hi(v * q) - 32 sum_hi(q))
 *     acc = fma(d * dx[b], (float) is, acc)          msum = fma(-(dmin * m[b]), sx[b], msum)
 *     y = (acc + msum) + bias
 * (lo, hi: the sub-block's values 0-15 and 16-31, Q6_K's scale halves). |is| < 2^24. */
static inline int is_k(int type) { return type == GQ4_K || type == GQ5_K || type == GQ6_K; }
static long k_header(int type) { return type == GQ6_K ? 144 : 160; }
static long k_unit(int type) { return type == GQ4_K ? 128 : type == GQ5_K ? 160 : 192; } /* a sub-block's bytes */

/* A group's bytes over K columns, and where its block b's values start (``g``: the group's first byte). */
static long group_bytes(int type, long K) { return K / block_values(type) * packed_bytes(type); }
static inline const uint8_t *block_at(int type, const uint8_t *g, long b)
{
    if (!is_k(type)) return g + b * packed_bytes(type);
    return g + (b / 8) * packed_bytes(type) + k_header(type) + (b % 8) * k_unit(type);
}
static inline const uint8_t *header_at(int type, const uint8_t *g, long b) { return g + (b / 8) * packed_bytes(type); }

/* Bytes a packed weight of N rows and K columns takes; -1 where the kernel does not pack it. */
long racer_quant_packed_size(int type, long N, long K)
{
    if (!packed_bytes(type) || N % 8 || K % block_values(type)) return -1;
    return N / 8 * group_bytes(type, K);
}

/* Where the nibble formats keep their fields: in the file's block, the first value byte (after d, m
 * and qh) and qh (0: none); in a group's block, the 8 rows' qh words (0: none). The scales are at 128
 * and the minimums at 144 of a group's block (Q5_K: its fifth bits at 128 of a sub-block's). */
static int file_qs(int type) { return type == GQ4_0 ? 2 : type == GQ4_1 ? 4 : type == GQ5_0 ? 6 : 8; }
static int file_qh(int type) { return type == GQ5_0 ? 2 : type == GQ5_1 ? 4 : 0; }
static int group_qh(int type) { return type == GQ5_0 ? 144 : type == GQ5_1 ? 160 : type == GQ5_K ? 128 : 0; }

/* A row's fifth bits, the file's word (bit b: value b's) <-> a group's (bit t of byte i: value 4t + i's). */
static void qh_to_group(const uint8_t *file, uint8_t *group)
{
    const uint32_t w = le32(file);
    uint32_t o = 0;
    for (int b = 0; b < 32; b++) o |= ((w >> b) & 1u) << (8 * (b % 4) + b / 4);
    for (int i = 0; i < 4; i++) group[i] = (uint8_t)(o >> (8 * i));
}
static void qh_from_group(const uint8_t *group, uint8_t *file)
{
    const uint32_t o = le32(group);
    uint32_t w = 0;
    for (int b = 0; b < 32; b++) w |= ((o >> (8 * (b % 4) + b / 4)) & 1u) << b;
    for (int i = 0; i < 4; i++) file[i] = (uint8_t)(w >> (8 * i));
}

/* Bytes of row j's block b within a group's block, as the file stores the block (for unpacking). */
static void packed_block(int type, const uint8_t *gb, int j, uint8_t *out)
{
    if (type == GQ8_0) {
        memcpy(out, gb + 256 + 2 * j, 2);
        for (int t = 0; t < 8; t++) memcpy(out + 2 + 4 * t, gb + 32 * t + 4 * j, 4);
        return;
    }
    const int head = file_qs(type);
    memcpy(out, gb + 128 + 2 * j, 2);
    if (has_min(type)) memcpy(out + 2, gb + 144 + 2 * j, 2);
    if (file_qh(type)) qh_from_group(gb + group_qh(type) + 4 * j, out + file_qh(type));
    for (int c = 0; c < 4; c++) memcpy(out + head + 4 * c, gb + 32 * c + 4 * j, 4);
}

/* Row j's super-block ``src`` (as the file stores it) into its group's packed super-block ``sb``. */
static void pack_k(int type, const uint8_t *src, int j, uint8_t *sb)
{
    const int head = (int)k_header(type);
    memcpy(sb + 2 * j, type == GQ6_K ? src + 208 : src, 2);
    if (type != GQ6_K) memcpy(sb + 16 + 2 * j, src + 2, 2);
    for (int s = 0; s < 8; s++) {
        uint8_t v[32], nib[16];
        float ws[8], min;
        int o;
        unpack(type, src, s, v, ws, &min, &o); /* the values only: the scales come from the file's bytes */
        uint8_t *p = sb + head + s * k_unit(type);
        for (int i = 0; i < 16; i++) nib[i] = (uint8_t)((v[i] & 0xF) | (v[i + 16] & 0xF) << 4);
        for (int c = 0; c < 4; c++) memcpy(p + 32 * c + 4 * j, nib + 4 * c, 4);
        if (type == GQ5_K) {
            uint8_t word[4] = {0, 0, 0, 0};
            for (int i = 0; i < 32; i++) word[i % 4] |= (uint8_t)(((v[i] >> 4) & 1) << (i / 4));
            memcpy(p + 128 + 4 * j, word, 4);
        } else if (type == GQ6_K) {
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++) {
                    uint8_t byte = 0;
                    for (int u = 0; u < 4; u++) byte |= (uint8_t)((v[4 * (4 * h + u) + i] >> 4) << (2 * u));
                    p[128 + 32 * h + 4 * j + i] = byte;
                }
        }
        if (type == GQ6_K) {
            sb[16 + 16 * s + j] = src[192 + 2 * s];
            sb[16 + 16 * s + 8 + j] = src[192 + 2 * s + 1];
        } else {
            int sc, m;
            k4_scale(src + 4, s, &sc, &m);
            sb[32 + 8 * s + j] = (uint8_t)sc;
            sb[96 + 8 * s + j] = (uint8_t)m;
        }
    }
}

/* w [N, K / 32 blocks] as the file stores it -> ``out`` packed (N a multiple of 8;
 * racer_quant_packed_size bytes). 0, or -1. */
int racer_quant_pack(int type, const void *w, long N, long K, void *out)
{
    if (racer_quant_packed_size(type, N, K) < 0) return -1;
    if (is_k(type)) {
        const long nsb = K / 256, row_bytes = nsb * block_bytes(type);
        for (long n = 0; n < N; n++)
            for (long B = 0; B < nsb; B++)
                pack_k(type, (const uint8_t *)w + n * row_bytes + B * block_bytes(type), (int)(n % 8),
                       (uint8_t *)out + (n / 8) * group_bytes(type, K) + B * packed_bytes(type));
        return 0;
    }
    const long nb = K / 32, bb = block_bytes(type), row_bytes = nb * bb, gbytes = packed_bytes(type);
    const int head = type == GQ8_0 ? 2 : file_qs(type);
    for (long n = 0; n < N; n++) {
        const long g = n / 8;
        const int j = (int)(n % 8);
        for (long b = 0; b < nb; b++) {
            const uint8_t *src = (const uint8_t *)w + n * row_bytes + b * bb;
            uint8_t *gb = (uint8_t *)out + (g * nb + b) * gbytes;
            if (type == GQ8_0) {
                memcpy(gb + 256 + 2 * j, src, 2);
                for (int t = 0; t < 8; t++) memcpy(gb + 32 * t + 4 * j, src + 2 + 4 * t, 4);
            } else {
                memcpy(gb + 128 + 2 * j, src, 2);
                if (has_min(type)) memcpy(gb + 144 + 2 * j, src + 2, 2);
                if (file_qh(type)) qh_to_group(src + file_qh(type), gb + group_qh(type) + 4 * j);
                for (int c = 0; c < 4; c++) memcpy(gb + 32 * c + 4 * j, src + head + 4 * c, 4);
            }
        }
    }
    return 0;
}

/* Rows of x quantized per 32 values, block-major: q [nb][M][32], d, s [nb][M] float32, sum [nb][M],
 * and half [nb][M] the sums of values 0-15 and 16-31 as two int16 (low, high: Q6_K's halves). */
struct xp {
    int8_t *q;
    float *d, *s;
    int32_t *sum, *half;
    long nb, M;
};

struct quantize_call {
    const float *x;
    long K;
    struct xp *X;
};

/* Rows [lo, hi) of x quantized, block by block. */
static void quantize_body(void *ctx, long lo, long hi, int tid)
{
    const struct quantize_call *c = ctx;
    struct xp *X = c->X;
    const long M = X->M, K = c->K;
    (void)tid;
    for (long m = lo; m < hi; m++)
        for (long b = 0; b < X->nb; b++) {
            int sum, lo;
            const float db = quantize_block(c->x + m * K + 32 * b, X->q + (b * M + m) * 32, &sum, &lo);
            X->d[b * M + m] = db;
            X->s[b * M + m] = db * (float)sum;
            X->sum[b * M + m] = sum;
            X->half[b * M + m] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)(sum - lo) << 16);
        }
}

static int quantize_packed(const float *x, long M, long K, int threads, struct xp *X, void **mem)
{
    X->nb = K / 32;
    X->M = M;
    *mem = malloc((size_t)M * K + (sizeof(float) * 2 + sizeof(int32_t) * 2) * M * X->nb + 64);
    if (!*mem) return -2;
    X->q = *mem;
    X->d = (float *)((char *)*mem + ((M * K + 31) & ~31L));
    X->s = X->d + M * X->nb;
    X->sum = (int32_t *)(X->s + M * X->nb);
    X->half = X->sum + M * X->nb;
    struct quantize_call c = {x, K, X};
    const int nth = M * K >= 65536 && threads > 1 ? threads : 1;
    racer_pfor(M, (M + nth - 1) / nth, nth, quantize_body, &c);
    return 0;
}

/* Row j's 32 values of a packed K-quant sub-block ``p`` (unsigned: Q6_K's stand for v - 32). */
static void k_values(int type, const uint8_t *p, int j, uint8_t v[32])
{
    for (int i = 0; i < 32; i++) {
        const int t = i / 4, k = i % 4;
        const uint8_t byte = p[32 * (t & 3) + 4 * j + k];
        v[i] = t < 4 ? byte & 0xF : byte >> 4;
        if (type == GQ5_K) v[i] |= (uint8_t)(((p[128 + 4 * j + k] >> t) & 1) << 4);
        if (type == GQ6_K) v[i] |= (uint8_t)(((p[128 + 32 * (t >> 2) + 4 * j + k] >> (2 * (t & 3))) & 3) << 4);
    }
}

/* Sub-block b of row j of a packed K-quant group ``g`` as ``unpack`` gives a file's block. */
static void k_unpack(int type, const uint8_t *g, int j, long b, uint8_t v[32], float ws[8], float *min, int *offset)
{
    const uint8_t *h = header_at(type, g, b);
    const int s = (int)(b % 8);
    const float d = half_to_float((uint16_t)(h[2 * j] | h[2 * j + 1] << 8));
    k_values(type, block_at(type, g, b), j, v);
    if (type == GQ6_K) {
        for (int l = 0; l < 8; l++) ws[l] = d * (float)(int8_t)h[16 + 16 * s + 8 * (l / 4) + j];
        *min = 0.f;
        *offset = 32;
    } else {
        const float dmin = half_to_float((uint16_t)(h[16 + 2 * j] | h[17 + 2 * j] << 8));
        for (int l = 0; l < 8; l++) ws[l] = d * (float)h[32 + 8 * s + j];
        *min = -(dmin * (float)h[96 + 8 * s + j]);
        *offset = 0;
    }
}

/* The C code of a packed K-quant's arithmetic (above): output (row j of group ``g``, x row m). */
static float k_packed_ref(int type, const uint8_t *g, const struct xp *X, int j, long m, float bias)
{
    float acc = 0.f, msum = 0.f;
    for (long b = 0; b < X->nb; b++) {
        const uint8_t *h = header_at(type, g, b);
        const int s = (int)(b % 8);
        const long at = b * X->M + m;
        const int8_t *q = X->q + at * 32;
        uint8_t v[32];
        k_values(type, block_at(type, g, b), j, v);
        int dot[2] = {0, 0}, qs[2] = {0, 0};
        for (int i = 0; i < 32; i++) dot[i / 16] += (int)v[i] * (int)q[i], qs[i / 16] += q[i];
        int is;
        if (type == GQ6_K)
            is = (int)(int8_t)h[16 + 16 * s + j] * (dot[0] - 32 * qs[0]) + (int)(int8_t)h[24 + 16 * s + j] * (dot[1] - 32 * qs[1]);
        else
            is = (int)h[32 + 8 * s + j] * (dot[0] + dot[1]);
        const float d = half_to_float((uint16_t)(h[2 * j] | h[2 * j + 1] << 8));
        acc = fmaf(d * X->d[at], (float)is, acc);
        if (has_min(type)) {
            const float dmin = half_to_float((uint16_t)(h[16 + 2 * j] | h[17 + 2 * j] << 8));
            msum = fmaf(-(dmin * (float)h[96 + 8 * s + j]), X->s[at], msum);
        }
    }
    return (acc + msum) + bias;
}

/* The C code of the packed arithmetic: output (row j of group ``g``, x row m). */
static float quant_packed_ref(int type, const uint8_t *g, const struct xp *X, int j, long m, float bias)
{
    if (is_k(type)) return k_packed_ref(type, g, X, j, m, bias);
    const long gbytes = packed_bytes(type);
    float acc = 0.f, msum = 0.f;
    for (long b = 0; b < X->nb; b++) {
        uint8_t blk[34], v[32];
        float ws[8], min;
        int o;
        packed_block(type, g + b * gbytes, j, blk);
        unpack(type, blk, 0, v, ws, &min, &o);
        const int8_t *q = X->q + (b * X->M + m) * 32;
        /* Q8_0's values are signed bytes, read through an int8_t pointer: GCC 12 at -O3 with
         * AVX512-VNNI vectorized the cast of each uint8_t (``(int)(int8_t)v[i]``) into vpdpbusd, which
         * multiplies unsigned by signed bytes, so a negative weight counted as w + 256. */
        const int8_t *sv = (const int8_t *)v;
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += (type == GQ8_0 ? (int)sv[i] : (int)v[i]) * (int)q[i];
        isum -= value_offset(type) * X->sum[b * X->M + m];
        acc = fmaf(ws[0] * X->d[b * X->M + m], (float)isum, acc);
        if (has_min(type)) msum = fmaf(min, X->s[b * X->M + m], msum);
    }
    return (acc + msum) + bias;
}

#if defined(QUANT_AVX2)
/* Blocks ahead of the one being multiplied that a pass asks the cache for. A group's blocks stream
 * from memory once per call; with the hardware prefetcher alone, calls of 1 to 16 rows took 1.05-1.3x
 * as long (the output layer's one-row call 1.2-1.3x; AMD EPYC Zen 3, medians of 40 interleaved calls).
 * The gain was flat from 4 to 16 blocks ahead, so the distance is no tuned edge. A prefetch changes
 * no value: the same bits. 0 turns it off. */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 8
#endif
/* x rows one pass over a lone group (PASS_ROWS) or a pair of groups (PAIR_ROWS) carries: per x row
 * and group, its float32 accumulator and the integer sums of the block at hand stay in registers
 * (AVX2's 16: 2 x 4 + 2 x 4 for a pair), and the groups' values, re-read from L1 for each pass, are
 * widened once per pass. A pair shares each broadcast of x values between 16 weight rows. One thread,
 * Q4_1 576x1536 and 1536x576 at 16 rows (AMD EPYC Zen 3, side by side): pairs of 4 rows 167-178
 * GOP/s, pairs of 2 rows 148-154, lone groups of 4 rows 139-141; the kernel before (lone groups, 16
 * rows a pass, accumulators and products spilled to the stack at every block) 151-153. The rows
 * left after the passes (1 to 3) take one pass of their own. */
#define PASS_ROWS 4
#define PAIR_ROWS 4
#define MAX_ROWS 4

/* Values 4t .. 4t + 3 of the 8 rows of a group's block p, row j's in 32-bit lane j: unsigned bytes
 * (the nibble formats' values, the fifth bit included), or Q8_0's signed ones. */
static inline __attribute__((always_inline)) __m256i group_values(int type, const uint8_t *p, int t)
{
    if (type == GQ8_0) return _mm256_loadu_si256((const __m256i *)(p + 32 * t));
    const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 32 * (t & 3)));
    __m256i v = _mm256_and_si256(t < 4 ? q : _mm256_srli_epi16(q, 4), _mm256_set1_epi8(0xF));
    if (type == GQ5_0 || type == GQ5_1 || type == GQ5_K) {
        /* the fifth bits: row j's word in lane j, bit t of its byte i value 4t + i's, shifted to bit 4
         * (within each byte: 16-bit shifts by at most 4 bring no bit across into bit 4) */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + group_qh(type)));
        const __m256i at4 = t < 4 ? _mm256_slli_epi16(qh, 4 - t) : t > 4 ? _mm256_srli_epi16(qh, t - 4) : qh;
        v = _mm256_or_si256(v, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
    }
    if (type == GQ6_K) { /* the top two bits, at bits 2u, 2u + 1 (u = t % 4) of run t / 4, to bits 4-5 */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * (t >> 2)));
        const int u = t & 3;
        const __m256i at4 = u < 2 ? _mm256_slli_epi16(qh, 4 - 2 * u) : u > 2 ? _mm256_srli_epi16(qh, 2) : qh;
        v = _mm256_or_si256(v, _mm256_and_si256(at4, _mm256_set1_epi8(0x30)));
    }
    return v;
}

/* Values 4t .. 4t + 3 of G groups' blocks p[i] (group_values) in v, and as the unsigned operand of
 * the products in u: the values, or Q8_0's |w| (its sign goes onto x). */
static inline __attribute__((always_inline)) void pass_values(int type, int G, const uint8_t *const *p, int t,
                                                              __m256i *v, __m256i *u)
{
    for (int i = 0; i < G; i++) {
        v[i] = group_values(type, p[i], t);
        u[i] = type == GQ8_0 ? _mm256_sign_epi8(v[i], v[i]) : v[i];
    }
}

/* A value the compiler must take as it is at this point: it keeps a running sum's steps in the written
 * order, one step per product as it comes, where GCC 12 otherwise regrouped the sums and kept every
 * product of a block live at once (spilled to the stack). Changes no value. */
#if defined(__AVX512F__)
#define KEEP(v) __asm__("" : "+v"(v)) /* any of the 32 vector registers */
#else
#define KEEP(v) __asm__("" : "+x"(v))
#endif

/* A 32-bit value in every lane (vbroadcastss: on AMD Zen 3 about 1.3 a cycle against vpbroadcastd's 1). */
static inline __attribute__((always_inline)) __m256i bcast32(const int8_t *p)
{
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p));
}

/* A K-quant sub-block's 8 scales (bytes at p: unsigned, or Q6_K's signed) in 32-bit lanes, and the
 * same as the two int16 halves of each lane (a madd's multiplier: lane j sums both its halves' products
 * times row j's scale). */
static inline __attribute__((always_inline)) __m256i k_scales(int type, const uint8_t *p)
{
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return type == GQ6_K ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
static inline __attribute__((always_inline)) __m256i both_halves(__m256i lo, __m256i hi)
{
    return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
}

/* G consecutive groups (G <= 2; 8 weight rows each, group i at g + i * gstride) against x rows
 * m0 .. m0 + R - 1 (R <= PASS_ROWS; G and R constants where it is inlined): y[(m0 + r) * ys + 8 i ..].
 * Per x row and block, the integer sums of the G x 8 rows, one broadcast of 4 x values serving the
 * 4 products of G x 8 rows, then the float steps of every lane. */
static inline __attribute__((always_inline)) void group_pass(int type, int G, int R, const uint8_t *g, long gstride,
                                                             const struct xp *X, long m0, float *y, long ys,
                                                             const __m256 *bias)
{
    const long M = X->M;
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones; /* the 16-bit sums of AVX2 without VNNI only */
    const long dat = type == GQ8_0 ? 256 : 128; /* the 32-value formats' scales in a group's block */
    const int five = type == GQ5_0 || type == GQ5_1 || type == GQ5_K;
    (void)five;
    const long unit = is_k(type) ? k_unit(type) : packed_bytes(type); /* a block's bytes (K-quants: a sub-block's) */
    __m256 acc[2][MAX_ROWS];
    for (int i = 0; i < G; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (long b = 0; b < X->nb; b++) {
        const int8_t *xq = X->q + (b * M + m0) * 32;
        const uint8_t *p[2], *h[2];
        /* K-quants: the rows' scales of this sub-block (sc: 32-bit lanes; sc16 / hi16: as int16 halves,
         * Q6_K's two halves' apart; pair: Q6_K's (lo, hi) in each lane) */
        __m256i sc[2], sc16[2], hi16[2], pair[2];
        (void)sc, (void)sc16, (void)hi16, (void)pair;
        for (int i = 0; i < G; i++) {
            p[i] = block_at(type, g + i * gstride, b);
            h[i] = header_at(type, g + i * gstride, b);
            if (type == GQ6_K) {
                const __m256i lo = k_scales(type, h[i] + 16 + 16 * (b % 8)), hi = k_scales(type, h[i] + 24 + 16 * (b % 8));
                sc16[i] = both_halves(lo, lo);
                hi16[i] = both_halves(hi, hi);
                pair[i] = both_halves(lo, hi);
            } else if (is_k(type)) {
                sc[i] = k_scales(type, h[i] + 32 + 8 * (b % 8));
                sc16[i] = both_halves(sc[i], sc[i]);
            }
#if PREFETCH_BLOCKS > 0
            /* a block of a group: 144 to 192 bytes (Q4_0 .. Q5_1, a K-quant's sub-block) or 272 (Q8_0);
             * past a group's last block, the same block of the group after the pair (the next pass's); a
             * prefetch never faults, past the weight's end included */
            const char *ahead = (const char *)p[i] + PREFETCH_BLOCKS * unit + (b + PREFETCH_BLOCKS >= X->nb ? (G - 1) * gstride : 0);
            for (long c = 0; c < unit; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
#endif
        }
        __m256i isum[2][MAX_ROWS];
#if defined(DPBUSD)
        /* dpbusd: 4 products summed into 32 bits, one instruction (integer sums: any order, the same
         * bits). Q8_0's signed values: |w| times x with w's sign. Q6_K's two scales a block take the
         * 16-bit sums below. */
        if (type != GQ6_K) {
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                __m256i v[2], u[2];
                pass_values(type, G, p, t, v, u);
                for (int r = 0; r < R; r++) {
                    const __m256i x = bcast32(xq + 32 * r + 4 * t);
                    for (int i = 0; i < G; i++) {
                        isum[i][r] = DPBUSD(t ? isum[i][r] : _mm256_setzero_si256(), u[i],
                                            type == GQ8_0 ? _mm256_sign_epi8(x, v[i]) : x);
                        KEEP(isum[i][r]);
                    }
                }
            }
            if (is_k(type))
                for (int i = 0; i < G; i++)
                    for (int r = 0; r < R; r++) isum[i][r] = _mm256_mullo_epi32(isum[i][r], sc[i]);
        } else
#endif
        {
            __m256i s16[2][MAX_ROWS];
            (void)s16;
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                __m256i v[2], u[2];
                pass_values(type, G, p, t, v, u);
                for (int r = 0; r < R; r++) {
                    const __m256i x = bcast32(xq + 32 * r + 4 * t);
                    for (int i = 0; i < G; i++) {
                        if (type == GQ8_0 || type == GQ6_K) {
                            /* Q8_0: |w| times x with w's sign; a pair of products reaches 2 * 128 * 127.
                             * Q6_K: 6-bit values, a pair up to 2 * 63 * 127, times its half's scale
                             * (|sc| <= 128) in the madd. Each pair sum goes to 32 bits at once. */
                            const __m256i d =
                                type == GQ8_0
                                    ? _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], _mm256_sign_epi8(x, v[i])), ones)
                                    : _mm256_madd_epi16(_mm256_maddubs_epi16(v[i], x), t < 4 ? sc16[i] : hi16[i]);
                            isum[i][r] = t ? _mm256_add_epi32(isum[i][r], d) : d;
                            KEEP(isum[i][r]);
                            continue;
                        }
                        /* 16-bit sums (exact): 4-bit values, 8 products of pairs each at most 2 * 15 * 127,
                         * so any partial sum stays under 32768; 5-bit values (up to 2 * 31 * 127 a pair): 4
                         * pairs in 16 bits, then two 32-bit sums. A K-quant's madd multiplies by its
                         * sub-block's scale (<= 63: exact in 32 bits). */
                        const __m256i k = is_k(type) ? sc16[i] : ones;
                        const __m256i prod = _mm256_maddubs_epi16(v[i], x);
                        s16[i][r] = t == 0 || (five && t == 4) ? prod : _mm256_add_epi16(s16[i][r], prod);
                        KEEP(s16[i][r]);
                        if (five && t == 3) isum[i][r] = _mm256_madd_epi16(s16[i][r], k);
                        if (t == 7)
                            isum[i][r] = five ? _mm256_add_epi32(isum[i][r], _mm256_madd_epi16(s16[i][r], k))
                                              : _mm256_madd_epi16(s16[i][r], k);
                    }
                }
            }
        }
        for (int i = 0; i < G; i++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(is_k(type) ? h[i] : p[i] + dat)));
            for (int r = 0; r < R; r++) {
                __m256i is = isum[i][r];
                if (type == GQ6_K) /* 32 (sc_lo sum_lo(q) + sc_hi sum_hi(q)) */
                    is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_madd_epi16(pair[i], _mm256_set1_epi32(X->half[b * M + m0 + r])), 5));
                else if (value_offset(type))
                    is = _mm256_sub_epi32(is, _mm256_set1_epi32(value_offset(type) * X->sum[b * M + m0 + r]));
#if defined(RACER_FAULT_PACKED)
                is = _mm256_sub_epi32(_mm256_setzero_si256(), is); /* a wrong sign, for the start-up check's test */
#endif
                const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(X->d + b * M + m0 + r));
                acc[i][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(is), acc[i][r]);
            }
        }
    }
    /* the minimums' terms, a chain of their own per output (blocks in order), in a second pass over
     * the groups' minimums so that they take no register in the first */
    __m256 msum[2][MAX_ROWS];
    for (int i = 0; i < G; i++)
        for (int r = 0; r < R; r++) msum[i][r] = _mm256_setzero_ps();
    if (has_min(type))
        for (long b = 0; b < X->nb; b++) /* G x R chains side by side: their FMAs' latency overlaps */
            for (int i = 0; i < G; i++) {
                __m256 mw;
                if (is_k(type)) { /* -(dmin * m) */
                    const uint8_t *h = header_at(type, g + i * gstride, b);
                    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 16)));
                    const __m256 m = _mm256_cvtepi32_ps(k_scales(type, h + 96 + 8 * (b % 8)));
                    mw = _mm256_xor_ps(_mm256_mul_ps(dmin, m), _mm256_set1_ps(-0.f));
                } else {
                    mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + i * gstride + b * packed_bytes(type) + 144)));
                }
                for (int r = 0; r < R; r++)
                    msum[i][r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(X->s + b * M + m0 + r), msum[i][r]);
            }
    for (int i = 0; i < G; i++)
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(y + (m0 + r) * ys + 8 * i, _mm256_add_ps(_mm256_add_ps(acc[i][r], msum[i][r]), bias[i]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_512 1
/* group_pass for a pair of groups in 16 lanes (AVX-512): lanes 0-7 the first group's rows, 8-15 the
 * second's, each lane the same integer sums and float32 steps as group_pass's, so the same bits. */
#define LOAD2(p0, p1, off)                                                                                     \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)((p0) + (off)))),            \
                       _mm256_loadu_si256((const __m256i *)((p1) + (off))), 1)
static inline __attribute__((always_inline)) __m512i pair_values(int type, const uint8_t *p0, const uint8_t *p1, int t)
{
    if (type == GQ8_0) return LOAD2(p0, p1, 32 * t);
    const __m512i q = LOAD2(p0, p1, 32 * (t & 3));
    __m512i v = _mm512_and_si512(t < 4 ? q : _mm512_srli_epi16(q, 4), _mm512_set1_epi8(0xF));
    if (type == GQ5_0 || type == GQ5_1) {
        const __m512i qh = LOAD2(p0, p1, group_qh(type));
        const __m512i at4 = t < 4 ? _mm512_slli_epi16(qh, 4 - t) : t > 4 ? _mm512_srli_epi16(qh, t - 4) : qh;
        v = _mm512_or_si512(v, _mm512_and_si512(at4, _mm512_set1_epi8(0x10)));
    }
    return v;
}

static inline __attribute__((always_inline)) __m512 pair_halves(const uint8_t *p0, const uint8_t *p1, long off)
{
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + off))),
                                              _mm_loadu_si128((const __m128i *)(p1 + off)), 1);
    return _mm512_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void pair_pass512(int type, int R, const uint8_t *g, long gstride,
                                                               const struct xp *X, long m0, float *y, long ys,
                                                               const __m256 *bias)
{
    const long gbytes = packed_bytes(type), M = X->M;
    const __m512i ones = _mm512_set1_epi16(1);
    (void)ones;
    const long dat = type == GQ8_0 ? 256 : 128;
    const int five = type == GQ5_0 || type == GQ5_1;
    (void)five;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < X->nb; b++) {
        const int8_t *xq = X->q + (b * M + m0) * 32;
        const uint8_t *p0 = g + b * gbytes, *p1 = p0 + gstride;
#if PREFETCH_BLOCKS > 0
        const long skip = b + PREFETCH_BLOCKS >= X->nb ? gstride : 0; /* as group_pass's */
        for (long c = 0; c < gbytes; c += 64) {
            _mm_prefetch((const char *)p0 + PREFETCH_BLOCKS * gbytes + skip + c, _MM_HINT_T0);
            _mm_prefetch((const char *)p1 + PREFETCH_BLOCKS * gbytes + skip + c, _MM_HINT_T0);
        }
#endif
        __m512i isum[MAX_ROWS], s16[MAX_ROWS];
        (void)s16;
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512i v = pair_values(type, p0, p1, t);
            const __m512i u = type == GQ8_0 ? _mm512_abs_epi8(v) : v;
            const __mmask64 neg = type == GQ8_0 ? _mm512_movepi8_mask(v) : 0;
            for (int r = 0; r < R; r++) {
                __m512i x = _mm512_set1_epi32(load32(xq + 32 * r + 4 * t));
                if (type == GQ8_0) /* x with w's sign where w < 0 (where w = 0, |w| = 0 takes the product) */
                    x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#if defined(__AVX512VNNI__)
                isum[r] = _mm512_dpbusd_epi32(t ? isum[r] : _mm512_setzero_si512(), u, x);
                KEEP(isum[r]);
#else
                if (type == GQ8_0) {
                    const __m512i d = _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), ones);
                    isum[r] = t ? _mm512_add_epi32(isum[r], d) : d;
                    KEEP(isum[r]);
                    continue;
                }
                const __m512i prod = _mm512_maddubs_epi16(u, x);
                s16[r] = t == 0 || (five && t == 4) ? prod : _mm512_add_epi16(s16[r], prod);
                KEEP(s16[r]);
                if (five && t == 3) isum[r] = _mm512_madd_epi16(s16[r], ones);
                if (t == 7)
                    isum[r] = five ? _mm512_add_epi32(isum[r], _mm512_madd_epi16(s16[r], ones))
                                   : _mm512_madd_epi16(s16[r], ones);
#endif
            }
        }
        const __m512 dw = pair_halves(p0, p1, dat);
        for (int r = 0; r < R; r++) {
            __m512i is = isum[r];
            if (value_offset(type))
                is = _mm512_sub_epi32(is, _mm512_set1_epi32(value_offset(type) * X->sum[b * M + m0 + r]));
#if defined(RACER_FAULT_PACKED)
            is = _mm512_sub_epi32(_mm512_setzero_si512(), is);
#endif
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(X->d[b * M + m0 + r]));
            acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(is), acc[r]);
        }
    }
    __m512 msum[MAX_ROWS];
    for (int r = 0; r < R; r++) msum[r] = _mm512_setzero_ps();
    if (has_min(type))
        for (long b = 0; b < X->nb; b++) {
            const __m512 mw = pair_halves(g + b * gbytes, g + gstride + b * gbytes, 144);
            for (int r = 0; r < R; r++) msum[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(X->s[b * M + m0 + r]), msum[r]);
        }
    const __m512 bv = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(bias[0])),
                                                             _mm256_castps_si256(bias[1]), 1));
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * ys, _mm512_add_ps(_mm512_add_ps(acc[r], msum[r]), bv));
}
#undef LOAD2
#endif

/* -- AMX-INT8 tiles: a pair of groups (16 weight rows) against up to 15 x rows a block --------------
 *
 * One tdpbusd a block: the A tile holds the pass's x rows as unsigned bytes (x + 128) and a row of
 * ones, the B tile the pair's values in the layout group_values makes (row t: values 4t .. 4t + 3 of
 * the 16 weight rows, 4 bytes each, which is the instruction's own layout for B), so that C[r][n] =
 * sum((x + 128) w) and the ones row's C[15][n] = sum(w). The integer sum of the other paths is
 * C[r][n] - 128 C[15][n] (exact in 32 bits: |C| < 2^21), then the float steps of group_pass, lane by
 * lane in the same order: the same bits as every other path, and a row's bits never depend on the
 * rows beside it in the tile. The nibble formats and Q8_0 (the K-quants keep the vector path). Used
 * for calls of at least ``amx_rows`` rows (racer_quant_amx_rows: measured at start-up; 0, the
 * default, never), where the CPU has AMX-INT8 and Linux lets the process use the tiles.
 *
 * RACER_AMX_EMULATE (tests only) builds the path with the tile instructions written in C, so that a
 * machine without AMX runs its layout and float steps; only the instructions are then not the CPU's. */
#if defined(QUANT_AVX2) && ((defined(__AMX_TILE__) && defined(__AMX_INT8__)) || defined(RACER_AMX_EMULATE))
#define QUANT_AMX 1
#define AMX_ROWS 15 /* x rows a pass: the A tile's 16th row is the ones */

struct amx_cfg {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if defined(RACER_AMX_EMULATE)
static __thread struct {
    int rows, colsb;
    uint8_t d[16][64];
} emu[8];
static void emu_config(const struct amx_cfg *c)
{
    for (int t = 0; t < 8; t++) emu[t].rows = c->rows[t], emu[t].colsb = c->colsb[t];
}
static void emu_load(int t, const void *p, long stride)
{
    for (int r = 0; r < emu[t].rows; r++) memcpy(emu[t].d[r], (const uint8_t *)p + r * stride, emu[t].colsb);
}
static void emu_store(int t, void *p, long stride)
{
    for (int r = 0; r < emu[t].rows; r++) memcpy((uint8_t *)p + r * stride, emu[t].d[r], emu[t].colsb);
}
static void emu_dpbusd(int c, int a, int b) /* Intel's TDPBUSD: unsigned bytes of A times signed of B */
{
    for (int m = 0; m < emu[c].rows; m++)
        for (int n = 0; n < emu[c].colsb / 4; n++) {
            int32_t s;
            memcpy(&s, &emu[c].d[m][4 * n], 4);
            for (int k = 0; k < emu[a].colsb / 4; k++)
                for (int i = 0; i < 4; i++) s += (int32_t)emu[a].d[m][4 * k + i] * (int32_t)(int8_t)emu[b].d[k][4 * n + i];
            memcpy(&emu[c].d[m][4 * n], &s, 4);
        }
}
#define TILE_CONFIG(c) emu_config(c)
#define TILE_ZERO(t) memset(emu[t].d, 0, sizeof emu[t].d)
#define TILE_LOAD(t, p, s) emu_load(t, p, s)
#define TILE_STORE(t, p, s) emu_store(t, p, s)
#define TILE_DPBUSD(c, a, b) emu_dpbusd(c, a, b)
static int amx_usable(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>
#define TILE_CONFIG(c) _tile_loadconfig(c)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
static int amx_usable(void) /* AMX-TILE and AMX-INT8, and Linux's leave to use the tiles' state */
{
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return (d >> 24 & 1) && (d >> 25 & 1) && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
}
#endif

/* Tile 0: C (16 rows of 16 int32), 1: A (16 rows of 32 bytes), 2: B (8 rows of 64 bytes). A thread's
 * configuration is its own, loaded once (racer_tiles_quant) until the attention's tiles load theirs. */
static void amx_tiles(void)
{
    if (racer_tiles_quant) return;
    racer_tiles_quant = 1;
    struct amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 64;
    cfg.rows[1] = 16, cfg.colsb[1] = 32;
    cfg.rows[2] = 8, cfg.colsb[2] = 64;
    TILE_CONFIG(&cfg);
}

/* A pair of groups (g, g + gstride) against x rows m0 .. m0 + R - 1 (R <= AMX_ROWS). The float steps
 * in 16 lanes where the build has AVX-512 (as pair_pass512's), else in two halves of 8 (as
 * group_pass's): the same steps lane by lane either way. */
static void amx_pair_pass(int type, int R, const uint8_t *g, long gstride, const struct xp *X, long m0, float *y,
                          long ys, const __m256 *bias)
{
    const long M = X->M, unit = packed_bytes(type);
    const long dat = type == GQ8_0 ? 256 : 128;
    uint8_t a[16][32] __attribute__((aligned(64)));
    uint8_t bt[8][64] __attribute__((aligned(64)));
    int32_t c[16][16] __attribute__((aligned(64)));
    memset(a, 0, sizeof a);
    memset(a[AMX_ROWS], 1, sizeof a[AMX_ROWS]);
#if defined(QUANT_512)
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
#else
    __m256 acc[AMX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#endif
    for (long b = 0; b < X->nb; b++) {
        const uint8_t *p[2] = {g + b * unit, g + gstride + b * unit};
#if PREFETCH_BLOCKS > 0
        const long skip = b + PREFETCH_BLOCKS >= X->nb ? gstride : 0; /* as group_pass's */
        for (long o = 0; o < unit; o += 64)
            for (int i = 0; i < 2; i++) _mm_prefetch((const char *)p[i] + PREFETCH_BLOCKS * unit + skip + o, _MM_HINT_T0);
#endif
        for (int t = 0; t < 8; t++)
            for (int i = 0; i < 2; i++) _mm256_store_si256((__m256i *)(bt[t] + 32 * i), group_values(type, p[i], t));
        const int8_t *xq = X->q + (b * M + m0) * 32;
        for (int r = 0; r < R; r++)
            _mm256_store_si256((__m256i *)a[r], _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xq + 32 * r)),
                                                                 _mm256_set1_epi8((char)0x80)));
        TILE_ZERO(0);
        TILE_LOAD(1, a, 32);
        TILE_LOAD(2, bt, 64);
        TILE_DPBUSD(0, 1, 2);
        TILE_STORE(0, c, 64);
#if defined(QUANT_512)
        const __m512 dw = pair_halves(p[0], p[1], dat);
        const __m512i wsum = _mm512_slli_epi32(_mm512_load_si512(c[AMX_ROWS]), 7);
        for (int r = 0; r < R; r++) {
            __m512i is = _mm512_sub_epi32(_mm512_load_si512(c[r]), wsum);
            if (value_offset(type))
                is = _mm512_sub_epi32(is, _mm512_set1_epi32(value_offset(type) * X->sum[b * M + m0 + r]));
#if defined(RACER_FAULT_PACKED) || defined(RACER_FAULT_AMX)
            is = _mm512_sub_epi32(_mm512_setzero_si512(), is); /* a wrong sign, for the check's tests */
#endif
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(X->d[b * M + m0 + r]));
            acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(is), acc[r]);
        }
#else
        for (int i = 0; i < 2; i++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p[i] + dat)));
            const __m256i wsum = _mm256_slli_epi32(_mm256_load_si256((const __m256i *)(c[AMX_ROWS] + 8 * i)), 7);
            for (int r = 0; r < R; r++) {
                __m256i is = _mm256_sub_epi32(_mm256_load_si256((const __m256i *)(c[r] + 8 * i)), wsum);
                if (value_offset(type))
                    is = _mm256_sub_epi32(is, _mm256_set1_epi32(value_offset(type) * X->sum[b * M + m0 + r]));
#if defined(RACER_FAULT_PACKED) || defined(RACER_FAULT_AMX)
                is = _mm256_sub_epi32(_mm256_setzero_si256(), is); /* a wrong sign, for the check's tests */
#endif
                const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(X->d + b * M + m0 + r));
                acc[r][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(is), acc[r][i]);
            }
        }
#endif
    }
#if defined(QUANT_512)
    const __m512 bv = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(bias[0])),
                                                             _mm256_castps_si256(bias[1]), 1));
    for (int r = 0; r < R; r++) {
        __m512 msum = _mm512_setzero_ps(); /* pair_pass512's minimums' chain, blocks in order */
        if (has_min(type))
            for (long b = 0; b < X->nb; b++)
                msum = _mm512_fmadd_ps(pair_halves(g + b * unit, g + gstride + b * unit, 144),
                                       _mm512_set1_ps(X->s[b * M + m0 + r]), msum);
        _mm512_storeu_ps(y + (m0 + r) * ys, _mm512_add_ps(_mm512_add_ps(acc[r], msum), bv));
    }
#else
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < R; r++) {
            __m256 msum = _mm256_setzero_ps(); /* group_pass's minimums' chain, blocks in order */
            if (has_min(type))
                for (long b = 0; b < X->nb; b++)
                    msum = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + i * gstride + b * unit + 144))),
                                           _mm256_broadcast_ss(X->s + b * M + m0 + r), msum);
            _mm256_storeu_ps(y + (m0 + r) * ys + 8 * i, _mm256_add_ps(_mm256_add_ps(acc[r][i], msum), bias[i]));
        }
#endif
}
#endif


/* G groups against every x row: passes of PASS_ROWS rows (G = 1) or PAIR_ROWS (G = 2), then one of
 * the rows left. */
static inline __attribute__((always_inline)) void group_rows(int type, int G, const uint8_t *g, long gstride,
                                                             const struct xp *X, float *y, long ys, const __m256 *bias)
{
    const int step = G == 2 ? PAIR_ROWS : PASS_ROWS;
    long m = 0;
#if defined(QUANT_512)
    if (G == 2 && !is_k(type)) { /* the K-quants take group_pass's 256-bit pairs */
        for (; m + PAIR_ROWS <= X->M; m += PAIR_ROWS) pair_pass512(type, PAIR_ROWS, g, gstride, X, m, y, ys, bias);
        switch (X->M - m) {
        case 3: pair_pass512(type, 3, g, gstride, X, m, y, ys, bias); break;
        case 2: pair_pass512(type, 2, g, gstride, X, m, y, ys, bias); break;
        case 1: pair_pass512(type, 1, g, gstride, X, m, y, ys, bias); break;
        default: break;
        }
        return;
    }
#endif
    for (; m + step <= X->M; m += step) group_pass(type, G, step, g, gstride, X, m, y, ys, bias);
    switch (X->M - m) {
    case 3: group_pass(type, G, 3, g, gstride, X, m, y, ys, bias); break;
    case 2: group_pass(type, G, 2, g, gstride, X, m, y, ys, bias); break;
    case 1: group_pass(type, G, 1, g, gstride, X, m, y, ys, bias); break;
    default: break;
    }
}

#define GROUP_ROWS(T)                                                                                          \
    static void group_rows_##T(int G, const uint8_t *g, long gstride, const struct xp *X, float *y, long ys,  \
                               const __m256 *bias)                                                             \
    {                                                                                                          \
        if (G == 2)                                                                                            \
            group_rows(T, 2, g, gstride, X, y, ys, bias);                                                      \
        else                                                                                                   \
            group_rows(T, 1, g, gstride, X, y, ys, bias);                                                      \
    }
GROUP_ROWS(GQ4_0)
GROUP_ROWS(GQ4_1)
GROUP_ROWS(GQ5_0)
GROUP_ROWS(GQ5_1)
GROUP_ROWS(GQ8_0)
GROUP_ROWS(GQ4_K)
GROUP_ROWS(GQ5_K)
GROUP_ROWS(GQ6_K)
#endif

/* Calls of at least this many rows multiply pairs of groups on AMX tiles (0: none). */
static _Atomic long amx_rows = 0;

/* Whether this build has the AMX-INT8 path and the CPU and Linux let it run (asked once). */
int racer_quant_amx(void)
{
#if defined(QUANT_AMX)
    static int state = -1;
    if (state < 0) state = amx_usable();
    return state;
#else
    return 0;
#endif
}

/* Calls of at least ``rows`` rows take the AMX path where there is one (0: none). */
void racer_quant_amx_rows(long rows) { amx_rows = racer_quant_amx() ? rows : 0; }

/* ``count`` groups (1 or 2) from ``g`` (rows n0 .. n0 + 8 count - 1 of a [M, N] output) against every
 * x row. A group's outputs are the same whichever groups it is computed with. */
static void group_all(int type, int count, const uint8_t *g, const struct xp *X, float *y, long N, long n0,
                      const float *bias, int simd)
{
    const long gstride = group_bytes(type, 32 * X->nb);
#if defined(QUANT_AVX2)
    if (simd) {
        __m256 bv[2];
        for (int i = 0; i < count; i++) bv[i] = bias ? _mm256_loadu_ps(bias + n0 + 8 * i) : _mm256_setzero_ps();
#if defined(QUANT_AMX)
        const long tiles_from = amx_rows;
        if (count == 2 && !is_k(type) && tiles_from > 0 && X->M >= tiles_from) {
            amx_tiles();
            for (long m = 0; m < X->M; m += AMX_ROWS)
                amx_pair_pass(type, (int)(X->M - m < AMX_ROWS ? X->M - m : AMX_ROWS), g, gstride, X, m, y + n0, N, bv);
            return;
        }
#endif
        switch (type) {
        case GQ4_0: group_rows_GQ4_0(count, g, gstride, X, y + n0, N, bv); break;
        case GQ4_1: group_rows_GQ4_1(count, g, gstride, X, y + n0, N, bv); break;
        case GQ5_0: group_rows_GQ5_0(count, g, gstride, X, y + n0, N, bv); break;
        case GQ5_1: group_rows_GQ5_1(count, g, gstride, X, y + n0, N, bv); break;
        case GQ4_K: group_rows_GQ4_K(count, g, gstride, X, y + n0, N, bv); break;
        case GQ5_K: group_rows_GQ5_K(count, g, gstride, X, y + n0, N, bv); break;
        case GQ6_K: group_rows_GQ6_K(count, g, gstride, X, y + n0, N, bv); break;
        default: group_rows_GQ8_0(count, g, gstride, X, y + n0, N, bv); break;
        }
        return;
    }
#endif
    (void)simd;
    for (int i = 0; i < count; i++)
        for (long m = 0; m < X->M; m++)
            for (int j = 0; j < 8; j++) {
                const long n = n0 + 8 * i + j;
                y[m * N + n] = quant_packed_ref(type, g + i * gstride, X, j, m, bias ? bias[n] : 0.f);
            }
}

/* Calls of fewer x rows take their groups one at a time: a one-row call streams its weight from
 * memory, and lone groups did so faster than pairs (the 49152x576 Q8_0 output layer, one thread,
 * AMD EPYC Zen 3: pairs 1.37x as long). The same bits either way. */
#define PAIR_MIN_ROWS 2

struct packed_call {
    const int64_t *types;
    const void *const *w;
    const float *const *bias;
    float *const *y;
    const int64_t *N;
    const struct xp *X;
    int simd;
};

/* Groups [lo, hi) of 8 weight rows of a quant_packed_many call, counted across its projections. */
static void packed_body(void *ctx, long lo, long hi, int tid)
{
    const struct packed_call *c = ctx;
    (void)tid;
    for (long t = lo; t < hi;) {
        int j = 0;
        long g = t;
        while (g >= c->N[j] / 8) g -= c->N[j++] / 8;
        const int type = (int)c->types[j] - PACKED;
        /* two groups at once where the run and the projection hold both (group_rows) */
        const int count = c->X->M >= PAIR_MIN_ROWS && t + 1 < hi && g + 1 < c->N[j] / 8 ? 2 : 1;
        group_all(type, count, (const uint8_t *)c->w[j] + g * group_bytes(type, 32 * c->X->nb), c->X, c->y[j], c->N[j],
                  8 * g, c->bias ? c->bias[j] : NULL, c->simd);
        t += count;
    }
}

/* How a call hands out its groups: runs of groups claimed in turn (native_pool.c), each computed the
 * same whoever claims it. A call of at most ``stream_rows`` rows streams its weight from memory:
 * long contiguous runs (a quarter of a thread's share each) keep the hardware prefetcher on one run
 * at a time. A call of more rows computes more per byte: runs of 4 groups keep the threads even, a
 * preempted thread holding up only its run. Set at start-up by measurement (racer_quant_stream_rows,
 * verifier/tuning.py); 0: every call by runs of 4. No choice changes a value. */
static _Atomic long stream_rows = 0;
void racer_quant_stream_rows(long rows) { stream_rows = rows; }

static long packed_chunk(long groups, long M, int threads)
{
    if (M > stream_rows || threads < 2) return 4;
    return (groups + 4L * threads - 1) / (4L * threads);
}

/* racer_quant_many over packed weights (types[j] = GGML number + PACKED, N[j] a multiple of 8);
 * ``simd`` 0 runs the C code (the same bits: a test compares them). */
static int quant_packed_many(int count, const int64_t *types, const float *x, const void *const *w,
                             const float *const *bias, float *const *y, const int64_t *N, long M, long K,
                             int threads, int simd)
{
    long groups = 0;
    for (int j = 0; j < count; j++) {
        if (racer_quant_packed_size((int)types[j] - PACKED, N[j], K) < 0) return -1;
        groups += N[j] / 8;
    }
    struct xp X;
    void *mem;
    if (quantize_packed(x, M, K, threads, &X, &mem)) return -2;
    struct packed_call c = {types, w, bias, y, N, &X, simd};
    racer_pfor(groups, packed_chunk(groups, M, threads), threads, packed_body, &c);
    free(mem);
    return 0;
}

/* One packed projection by the C code (``simd`` 0) or the vector code (1): for the tests. */
int racer_quant_packed(int type, const float *x, const void *w, const float *bias, float *y, long M, long N, long K,
                       int threads, int simd)
{
    const int64_t t = type, n = N;
    return quant_packed_many(1, &t, x, &w, &bias, &y, &n, M, K, threads, simd);
}

/* -- Streaming read bandwidth -----------------------------------------------------------------------
 *
 * racer_stream_read reads ``bytes`` from p (a multiple of 64 KiB) on ``threads``
 * threads of the kernels' pool, each one contiguous run of its share, as a one-row call of the
 * block kernel streams its weights; returns a checksum of what it read (so that nothing is left
 * out). What a benchmark divides a step's weight bytes by (scripts/bench_kernels.py). */
struct read_call {
    const uint8_t *p;
    _Atomic uint64_t sum;
};

#define READ_ITEM 65536L
static void read_body(void *ctx, long lo, long hi, int tid)
{
    struct read_call *c = ctx;
    (void)tid;
    uint64_t sum = 0;
#if defined(QUANT_AVX2)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (const uint8_t *q = c->p + lo * READ_ITEM, *end = c->p + hi * READ_ITEM; q < end; q += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)q));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(q + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(q + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(q + 96)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
    sum = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#else
    const uint64_t *q = (const uint64_t *)(c->p + lo * READ_ITEM), *end = (const uint64_t *)(c->p + hi * READ_ITEM);
    for (; q < end; q++) sum ^= *q;
#endif
    atomic_fetch_xor(&c->sum, sum);
}

uint64_t racer_stream_read(const void *p, long bytes, int threads)
{
    struct read_call c = {p, 0};
    const long items = bytes / READ_ITEM, nth = threads > 0 ? threads : 1;
    racer_pfor(items, (items + nth - 1) / nth, (int)nth, read_body, &c);
    return c.sum;
}
