/* The CPU's peak rate of 8-bit multiply-adds, for the block kernel's figures to be read against
 * (scripts/bench_kernels.py --blocks ... --peak builds and runs it; built with -march=native, it times
 * the instructions this CPU has).
 *
 * Each loop is the block kernel's inner step with nothing else in it: 4 bytes of x broadcast from
 * memory, multiplied with weight vectors held in registers, into 8 independent sums (enough to hide
 * the instructions' latency). AVX2: vpmaddubsw (32 products a 256-bit instruction, pairs summed to 16
 * bits) and a 16-bit add; AVX-VNNI and AVX512-VNNI: vpdpbusd (4 products summed into each 32-bit
 * lane) on 256 and on 512 bits. The weights' unpacking, the scales and the float steps the kernel
 * also needs are left out, so no kernel reaches these rates.
 *
 *     cc -O2 -march=native -pthread scripts/int8_peak.c -o int8_peak && ./int8_peak 2
 *
 * prints the clock of one busy core (a chain of dependent adds, 1 a cycle) and, per instruction,
 * the multiply-adds a second of each of N threads running at once (the best of 5 runs), and a cycle at
 * that clock. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ITERS 20000000L

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int8_t xs[8192] __attribute__((aligned(64)));

/* One loop: 8 instructions an iteration of ``macs`` products each; returns a value that depends on
 * every sum (so that none is left out). */
typedef long (*loop_fn)(void);

#define X(o) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(p + (o))))

/* A 256-bit loop: ``STEP(a, w, x)`` one instruction's products added into the sums a; ``ADD`` the
 * sums' add (16-bit for vpmaddubsw's pairs, 32-bit for vpdpbusd's). */
#define LOOP256(name, STEP, ADD)                                                                               \
    static long name(void)                                                                                     \
    {                                                                                                          \
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;    \
        const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5);                                     \
        for (long it = 0; it < ITERS; it++) {                                                                  \
            const int8_t *p = xs + (it & 127) * 32;                                                            \
            const __m256i x0 = X(0), x1 = X(4), x2 = X(8), x3 = X(12);                                         \
            a0 = STEP(a0, w0, x0), a1 = STEP(a1, w1, x0), a2 = STEP(a2, w0, x1), a3 = STEP(a3, w1, x1);        \
            a4 = STEP(a4, w0, x2), a5 = STEP(a5, w1, x2), a6 = STEP(a6, w0, x3), a7 = STEP(a7, w1, x3);        \
            __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));     \
        }                                                                                                      \
        const __m256i s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                   \
        return _mm256_extract_epi32(s, 0);                                                                     \
    }

#define MADDUBS(a, w, x) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
LOOP256(loop_maddubs, MADDUBS, _mm256_add_epi16)

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DP256(a, u, s) _mm256_dpbusd_epi32(a, u, s)
#else
#define DP256(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#endif
LOOP256(loop_dpbusd256, DP256, _mm256_add_epi32)
#endif

#if defined(__AVX512VNNI__)
#define X5(o) _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss((const float *)(p + (o)))))
static long loop_dpbusd512(void)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m512i w0 = _mm512_set1_epi8(3), w1 = _mm512_set1_epi8(5);
    for (long it = 0; it < ITERS; it++) {
        const int8_t *p = xs + (it & 127) * 32;
        const __m512i x0 = X5(0), x1 = X5(4), x2 = X5(8), x3 = X5(12);
        a0 = _mm512_dpbusd_epi32(a0, w0, x0), a1 = _mm512_dpbusd_epi32(a1, w1, x0);
        a2 = _mm512_dpbusd_epi32(a2, w0, x1), a3 = _mm512_dpbusd_epi32(a3, w1, x1);
        a4 = _mm512_dpbusd_epi32(a4, w0, x2), a5 = _mm512_dpbusd_epi32(a5, w1, x2);
        a6 = _mm512_dpbusd_epi32(a6, w0, x3), a7 = _mm512_dpbusd_epi32(a7, w1, x3);
        __asm__("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
    }
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    return _mm512_reduce_add_epi32(s);
}
#endif

struct run {
    loop_fn fn;
    double seconds;
    long sink;
};

static void *body(void *arg)
{
    struct run *r = arg;
    const double t0 = now();
    r->sink = r->fn();
    r->seconds = now() - t0;
    return NULL;
}

/* The loop on ``threads`` threads at once: the slowest thread's seconds. */
static double timed(loop_fn fn, int threads)
{
    struct run runs[64];
    pthread_t ids[64];
    for (int i = 0; i < threads; i++) {
        runs[i] = (struct run){fn, 0.0, 0};
        pthread_create(&ids[i], NULL, body, &runs[i]);
    }
    double most = 0.0;
    for (int i = 0; i < threads; i++) {
        pthread_join(ids[i], NULL);
        most = runs[i].seconds > most ? runs[i].seconds : most;
    }
    return most;
}

static double clock_ghz(void)
{
    const long n = 400000000L;
    long a = 0;
    const double t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0" : "+r"(a));
    return n / (now() - t0) / 1e9;
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (threads < 1 || threads > 64) return 2;
    for (int i = 0; i < 8192; i++) xs[i] = (int8_t)(i * 7);
    const double ghz = clock_ghz();
    printf("clock %.2f GHz\n", ghz);
    struct {
        const char *name;
        loop_fn fn;
        double macs; /* products an instruction */
    } loops[] = {
        {"vpmaddubsw-256 + vpaddw", loop_maddubs, 32},
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
        {"vpdpbusd-256", loop_dpbusd256, 32},
#endif
#if defined(__AVX512VNNI__)
        {"vpdpbusd-512", loop_dpbusd512, 64},
#endif
    };
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        double best = timed(loops[i].fn, threads); /* the best of 5: on a shared machine, the least disturbed */
        for (int k = 0; k < 4; k++) {
            const double t = timed(loops[i].fn, threads);
            best = t < best ? t : best;
        }
        const double rate = ITERS * 8 * loops[i].macs / best / 1e9;
        printf("%s %.1f %.1f\n", loops[i].name, rate, rate / ghz);
    }
    return 0;
}
