/* The runner's CPU matrix product (common/cpu_kernels.py builds and loads this file):
 *
 *     y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])     fp32, AVX2 + FMA (AVX-512 from 4 rows
 *                                                   where the CPU has it), OpenMP
 *
 * W is stored once, at load, as panels of 16 output rows, k-major inside a panel:
 *
 *     Wp[p][k][j] = W[16 p + j][k]        (zero rows pad the last panel)
 *
 * so a panel streams from memory as one contiguous run, and one k step is two 8-lane loads of
 * W and one broadcast of x per row. Why not MKL or oneDNN: for the row counts of decode,
 * ragged decode batches and verification (1-9 rows) their products read the weights well below
 * the machine's read bandwidth, while this layout streams each panel at close to it (the
 * runner sections of docs/benchmarks.md have the measurements).
 *
 * Every output is one sequential FMA chain over k (no split sums, no horizontal reduction),
 * and a row's chain does not depend on which tile or how many other rows it was computed
 * with: a session's result is bit for bit the same alone or in any batch.
 */
#include <immintrin.h>
#include <omp.h>

#define PW 16   /* output rows per panel: two 8-lane vectors */

void tdm_pack(const float* W, long N, long K, float* Wp, int threads) {
    long P = (N + PW - 1) / PW;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long p = 0; p < P; p++)
        for (long k = 0; k < K; k++)
            for (long j = 0; j < PW; j++) {
                long n = p * PW + j;
                Wp[(p * K + k) * PW + j] = n < N ? W[n * K + k] : 0.0f;
            }
}

/* k steps (64-byte lines of a panel) ahead that tiles of 3 or more rows prefetch: those tiles
 * are compute-bound and the hardware prefetcher falls behind them; 1-2 row tiles are
 * memory-bound, the hardware prefetcher keeps up, and a software prefetch only costs them. */
#define PREFETCH_K 16

/* Rows [m0, m0 + MB) of x against panels [p0, p0 + NP) at one vector width: V vectors of
 * LANES floats a panel (AVX2 2 x 8, AVX-512 1 x 16), MB * NP * V accumulators (AVX2: at most
 * 12 of the 16 ymm registers; AVX-512: 24 of 32 zmm), the rest hold W and the broadcast. Tiles
 * of PF_ROWS rows or more prefetch: PREFETCH_K ahead in their own panels, or, given pf > 0,
 * the same lines pf panels on (the next chunk of tdm_linear's chunked pass; a prefetch past
 * the thread's panels or the array reads a line for nothing, it never faults). */
#define TILE(NAME, VEC, LANES, V, PF_ROWS, ZERO, LOAD, STORE, SET1, FMADD, MB, NP)               \
static void NAME##_##MB##_##NP(const float* restrict x, long K, const float* restrict Wp,      \
                               long p0, long m0, long N, const float* restrict bias,           \
                               float* restrict y, long pf) {                                   \
    VEC acc[MB][NP][V];                                                                         \
    _Pragma("GCC unroll 9") for (int m = 0; m < MB; m++)                                        \
    _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                        \
    _Pragma("GCC unroll 2") for (int v = 0; v < V; v++)                                         \
        acc[m][q][v] = ZERO();                                                                  \
    const float* w = Wp + p0 * K * PW;                                                          \
    const float* xr = x + m0 * K;                                                               \
    for (long k = 0; k < K; k++) {                                                              \
        VEC wv[NP][V];                                                                          \
        if (MB >= PF_ROWS && !pf) /* compute-heavy tiles: the loads are too far apart for */   \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) /* the hardware prefetcher */  \
                _mm_prefetch((const char*)(w + (q * K + k + PREFETCH_K) * PW), _MM_HINT_T0);    \
        if (MB >= PF_ROWS && pf) /* the next chunk, into L2, while this one computes */          \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                \
                _mm_prefetch((const char*)(w + ((q + pf) * K + k) * PW), _MM_HINT_T1);          \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                    \
        _Pragma("GCC unroll 2") for (int v = 0; v < V; v++)                                     \
            wv[q][v] = LOAD(w + (q * K + k) * PW + v * LANES);                                  \
        _Pragma("GCC unroll 9") for (int m = 0; m < MB; m++) {                                  \
            VEC xb = SET1(xr[m * K + k]);                                                       \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                \
            _Pragma("GCC unroll 2") for (int v = 0; v < V; v++)                                 \
                acc[m][q][v] = FMADD(wv[q][v], xb, acc[m][q][v]);                               \
        }                                                                                       \
    }                                                                                           \
    _Pragma("GCC unroll 9") for (int m = 0; m < MB; m++)                                        \
    _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                      \
        long n = (p0 + q) * PW;                                                                 \
        float out[PW];                                                                          \
        _Pragma("GCC unroll 2") for (int v = 0; v < V; v++)                                     \
            STORE(out + v * LANES, acc[m][q][v]);                                               \
        float* yr = y + (m0 + m) * N;                                                           \
        for (int j = 0; j < PW && n + j < N; j++)                                               \
            yr[n + j] = bias ? out[j] + bias[n + j] : out[j];                                   \
    }                                                                                           \
}
#define KERNEL(MB, NP) TILE(k, __m256, 8, 2, 3, _mm256_setzero_ps, _mm256_loadu_ps,              \
                            _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps, MB, NP)
KERNEL(1, 4) KERNEL(1, 2) KERNEL(1, 1)
KERNEL(2, 3) KERNEL(2, 1)
KERNEL(3, 2) KERNEL(3, 1)
KERNEL(4, 1) KERNEL(5, 1) KERNEL(6, 1)

/* Panels [pa, pb) for rows [m0, m0 + mb), mb <= 6: the widest tile that fits, then narrower. */
static void block(const float* x, long K, const float* Wp, long pa, long pb, long m0, long mb,
                  long N, const float* bias, float* y, long pf) {
    long p = pa;
    switch (mb) {
    case 1:
        for (; p + 4 <= pb; p += 4) k_1_4(x, K, Wp, p, m0, N, bias, y, pf);
        for (; p + 2 <= pb; p += 2) k_1_2(x, K, Wp, p, m0, N, bias, y, pf);
        for (; p < pb; p++) k_1_1(x, K, Wp, p, m0, N, bias, y, pf);
        break;
    case 2:
        for (; p + 3 <= pb; p += 3) k_2_3(x, K, Wp, p, m0, N, bias, y, pf);
        for (; p < pb; p++) k_2_1(x, K, Wp, p, m0, N, bias, y, pf);
        break;
    case 3:
        for (; p + 2 <= pb; p += 2) k_3_2(x, K, Wp, p, m0, N, bias, y, pf);
        for (; p < pb; p++) k_3_1(x, K, Wp, p, m0, N, bias, y, pf);
        break;
    case 4: for (; p < pb; p++) k_4_1(x, K, Wp, p, m0, N, bias, y, pf); break;
    case 5: for (; p < pb; p++) k_5_1(x, K, Wp, p, m0, N, bias, y, pf); break;
    case 6: for (; p < pb; p++) k_6_1(x, K, Wp, p, m0, N, bias, y, pf); break;
    }
}

/* 12 independent FMA chains a thread on registers, `iters` times (tdm_fma_peak, at the end of
 * the file, says why); returns their sum, so the compiler keeps them all. */
#define FMA_PEAK(NAME, VEC, LANES, SET1, FMADD, ADD, STORE)                                      \
static double NAME(long iters, int threads) {                                                   \
    double total = 0;                                                                           \
    _Pragma("omp parallel num_threads(threads) reduction(+ : total)")                           \
    {                                                                                           \
        VEC a[12];                                                                              \
        const VEC m = SET1(0.999999f), c = SET1(1e-7f);                                         \
        for (int i = 0; i < 12; i++) a[i] = SET1((float)(i + omp_get_thread_num()));            \
        for (long it = 0; it < iters; it++) {                                                   \
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++)                               \
                a[i] = FMADD(a[i], m, c);                                                       \
        }                                                                                       \
        VEC s = a[0];                                                                           \
        for (int i = 1; i < 12; i++) s = ADD(s, a[i]);                                          \
        float o[LANES];                                                                         \
        STORE(o, s);                                                                            \
        for (int i = 0; i < LANES; i++) total += o[i];                                          \
    }                                                                                           \
    return total;                                                                               \
}

/* ---------------------------------------------------------------------------------------------
 * The same products with AVX-512 where the CPU has it (chosen at run time, tdm_isa): a panel's
 * k step is one 16-lane load, and 32 registers hold an 8-row by 3-panel tile (24 accumulators,
 * 3 loads of W and a broadcast; AVX2's 16 ymm registers cannot, its widest is 6 rows by 1
 * panel), so up to 8 rows (a ragged decode batch of 8, an 8-token verification) share one pass
 * over the weights where AVX2's 6-row tiles read them twice. Three panels a tile rather than
 * two: 24 FMAs for every 11 loads instead of 16 for 10, and one tile a PANEL_CHUNK. Each
 * output is the same sequential FMA chain as the AVX2 kernel's, so the two give the same bits
 * (tests/unit/test_runner_gemm.py).
 * ------------------------------------------------------------------------------------------ */
#pragma GCC push_options
#pragma GCC target("avx512f")

/* AVX-512 tiles run from 4 rows, all of them compute-bound: they prefetch from 4 rows */
#define KERNEL512(MB, NP) TILE(z, __m512, 16, 1, 4, _mm512_setzero_ps, _mm512_loadu_ps,          \
                               _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps, MB, NP)
KERNEL512(1, 4) KERNEL512(1, 1) KERNEL512(2, 2) KERNEL512(2, 1) KERNEL512(3, 2) KERNEL512(3, 1)
KERNEL512(4, 3) KERNEL512(4, 1) KERNEL512(5, 3) KERNEL512(5, 1) KERNEL512(6, 3) KERNEL512(6, 1)
KERNEL512(7, 3) KERNEL512(7, 1) KERNEL512(8, 3) KERNEL512(8, 1) KERNEL512(9, 3) KERNEL512(9, 1)

/* block() for AVX-512, mb <= 9: the tile of mb rows as wide as the registers allow, then
 * one-panel tiles for what is left. 9 x 3 (27 accumulators, 3 loads of W, a broadcast: 31 of
 * the 32 zmm) is for 9 rows alone: a verification of 8 drafts feeds 9 (the last committed
 * token, then the drafts; services/verifier/spec.py), which as an 8-row tile and a 1-row tile
 * would take two passes over each chunk of the weights. */
static void block512(const float* x, long K, const float* Wp, long pa, long pb, long m0, long mb,
                     long N, const float* bias, float* y, long pf) {
    long p = pa;
#define TILES(MB, NP)                                                                           \
    case MB:                                                                                    \
        for (; p + NP <= pb; p += NP) z_##MB##_##NP(x, K, Wp, p, m0, N, bias, y, pf);          \
        for (; p < pb; p++) z_##MB##_1(x, K, Wp, p, m0, N, bias, y, pf);                       \
        break;
    switch (mb) {
    TILES(1, 4) TILES(2, 2) TILES(3, 2) TILES(4, 3) TILES(5, 3) TILES(6, 3) TILES(7, 3)
    TILES(8, 3) TILES(9, 3)
    }
#undef TILES
}

FMA_PEAK(fma_peak512, __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps,
         _mm512_storeu_ps)
#pragma GCC pop_options

/* The instruction set the products use: 512 where the CPU has AVX-512F, else 256 (AVX2).
 * tdm_set_isa(256) forces AVX2 on an AVX-512 CPU (the tests and `tandem bench runner` compare
 * the two); it returns the width in use after the call. */
static int isa_width = 0;

int tdm_isa(void) {
    if (isa_width == 0) isa_width = __builtin_cpu_supports("avx512f") ? 512 : 256;
    return isa_width;
}

int tdm_set_isa(int width) {
    isa_width = width == 512 && __builtin_cpu_supports("avx512f") ? 512 : 256;
    return isa_width;
}

#define PANEL_CHUNK 3    /* panels a thread keeps in L2 while every full-row block passes (3 x
                          * 1536 k x 64 B = 295 KB for the widest SmolLM2 product: well inside
                          * a core's L2, with room for x and the prefetched next chunk) */

/* `threads` is the caller's (torch's) thread count: the OpenMP runtime is torch's own
 * (common/cpu_kernels.py loads this library after torch), so this shares its thread pool. */
void tdm_linear(const float* x, long M, long K, const float* Wp, long N, const float* bias,
                float* y, int threads) {
    long P = (N + PW - 1) / PW;
    if (threads > P) threads = (int)P;
    /* AVX-512 from 4 rows on: its 8-row tiles read the weights once for a batch of 7-8 rows
     * (AVX2 reads them twice: a 6-row tile and the rest), and its 4-6 row tiles cover three
     * panels where AVX2's cover one. 1-3 rows are memory-bound and stay AVX2: wider vectors
     * do not read memory faster. */
    int wide = M >= 4 && tdm_isa() == 512;
    long mb_max = wide ? (M == 9 ? 9 : 8) : 6;   /* rows per tile (9: block512's comment) */
    void (*blk)(const float*, long, const float*, long, long, long, long, long, const float*,
                float*, long) = wide ? block512 : block;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long pa = P * t / T, pb = P * (t + 1) / T;
        long step = M <= mb_max ? pb - pa : PANEL_CHUNK;
        for (long c = pa; c < pb; c += step) {
            long ce = c + step < pb ? c + step : pb;
            /* past one tile of rows, the remainder tile passes first: its pass is memory-bound
             * and streams the chunk from DRAM at the hardware prefetcher's pace, then the full
             * tiles, compute-bound, run from L2 (a compute-bound pass first would stream the
             * chunk more slowly). Every output is the same FMA chain either way. */
            long rem = M > mb_max ? M % mb_max : 0, full = M - rem;
            /* the first full tile's pass (compute-bound, from L2) prefetches the next chunk
             * into L2, so every pass but a thread's first runs from L2 while memory streams
             * (1-6 rows take one pass, with no chunks to prefetch) */
            long pf = ce < pb && M > mb_max ? ce - c : 0;
            if (rem)
                blk(x, K, Wp, c, ce, full, rem, N, bias, y, 0);
            for (long m0 = 0; m0 < full; m0 += mb_max)
                blk(x, K, Wp, c, ce, m0, full - m0 < mb_max ? full - m0 : mb_max, N, bias, y,
                    m0 == 0 ? pf : 0);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * The rest of a decoder layer around the products, one call each instead of ~25 torch ops a
 * layer (with oneDNN's products they added ~8 ms to a 46 ms decode step: `tandem bench runner`).
 * ------------------------------------------------------------------------------------------ */
#include <math.h>
#include <stdlib.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp over 8 lanes: Cody-Waite range reduction by ln 2 and Cephes' degree-6 polynomial
 * (about 1 ulp over the float range; expf itself cost 6-10 ns a call, most of SwiGLU's time).
 * Below -88.4 it returns 0, above 88.4 infinity. */
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                               _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float v[8] = {x};
    _mm256_storeu_ps(v, exp8(_mm256_loadu_ps(v)));
    return v[0];
}

static void norm_row(const float* xr, long H, const float* w, float eps, float* yr) {
    __m256 acc = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= H; j += 8) {
        __m256 v = _mm256_loadu_ps(xr + j);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; j < H; j++) ss += xr[j] * xr[j];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (j = 0; j < H; j++) yr[j] = (xr[j] * r) * w[j];
}

/* y[t] = (x[t] * rsqrt(mean(x[t]^2) + eps)) * w, per row; w holds 1 + w for Gemma's norms. */
void tdm_rms_norm(const float* x, long T, long H, const float* w, float eps, float* y,
                  int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (long t = 0; t < T; t++) norm_row(x + t * H, H, w, eps, y + t * H);
}

/* The residual step and the next norm in one pass: xo = x + a, y = rms_norm(xo) * w. */
void tdm_add_rms_norm(const float* x, const float* a, long T, long H, const float* w,
                      float eps, float* xo, float* y, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (long t = 0; t < T; t++) {
        for (long j = 0; j < H; j++) xo[t * H + j] = x[t * H + j] + a[t * H + j];
        norm_row(xo + t * H, H, w, eps, y + t * H);
    }
}

/* y[t, j] = silu(gu[t, j]) * gu[t, inter + j]: SwiGLU on a fused gate|up product. */
void tdm_silu_mul(const float* gu, long T, long inter, float* y, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (long t = 0; t < T; t++) {
        const float* g = gu + t * 2 * inter;
        float* yr = y + t * inter;
        long j = 0;
        for (; j + 8 <= inter; j += 8) {
            __m256 a = _mm256_loadu_ps(g + j);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
            __m256 sl = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(sl, _mm256_loadu_ps(g + inter + j)));
        }
        for (; j < inter; j++) yr[j] = g[j] / (1.0f + exp1(-g[j])) * g[inter + j];
    }
}

/* Attention of NH (1-3) consecutive query heads q [NH][hd] that share one K/V head (GQA), over
 * S keys K, V [S][hd] (vis: NULL, or 0 for a key the queries do not see), written to
 * dst [NH][hd]; sc: room for NH * (S + 8) scores.
 *
 * Each head's arithmetic is what it would be alone (tests/unit/test_runner_gemm.py): a key's
 * score is one FMA chain over the features (8 lanes) and a horizontal sum; each output feature
 * one FMA chain over the visible keys in order (a key whose weight underflowed to 0 adds 0 x v,
 * the same value). What the heads share is the loads: a K row and a V row are read once for
 * the group, with NH heads' arithmetic on them while the rows PF_KEYS ahead are prefetched.
 * For a ragged batch the rows come from memory (each session's own cache); a head at a time,
 * the first head's passes streamed them with little arithmetic per byte and the others re-read
 * them from cache. The max over the scores runs 8 lanes at a time (exact in any order; the
 * scalar loop is one long dependency chain, for no gain in exactness). */
#define PF_KEYS 8
static inline __attribute__((always_inline)) void attend_heads(
        const float* q, const float* K, const float* V, long S, long hd,
        const unsigned char* vis, float scale, float* sc, float* dst, const int NH) {
    long ss = S + 8;
    /* scores, four keys at a time: NH x 4 independent chains */
    long j = 0;
    for (; j + 4 <= S; j += 4) {
        __m256 a[3][4];
        for (int g = 0; g < NH; g++)
            for (int c = 0; c < 4; c++) a[g][c] = _mm256_setzero_ps();
        const float* k0 = K + j * hd;
        for (long b = 0; b < 4 * hd; b += 16)
            _mm_prefetch((const char*)(k0 + PF_KEYS * hd + b), _MM_HINT_T0);
        for (long d = 0; d < hd; d += 8) {
            __m256 kd[4];
            for (int c = 0; c < 4; c++) kd[c] = _mm256_loadu_ps(k0 + c * hd + d);
            for (int g = 0; g < NH; g++) {
                __m256 qd = _mm256_loadu_ps(q + g * hd + d);
                for (int c = 0; c < 4; c++) a[g][c] = _mm256_fmadd_ps(qd, kd[c], a[g][c]);
            }
        }
        for (int g = 0; g < NH; g++)
            for (int c = 0; c < 4; c++) sc[g * ss + j + c] = hsum8(a[g][c]) * scale;
    }
    for (; j < S; j++)
        for (int g = 0; g < NH; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (long d = 0; d < hd; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d),
                                      _mm256_loadu_ps(K + j * hd + d), acc);
            sc[g * ss + j] = hsum8(acc) * scale;
        }
    /* per head: the max over the visible keys (8 lanes at a time: a max is exact in any
     * order), exp(score - max) with masked keys exactly 0, and their sum. The sum gives key j
     * (counted from `first`) lane j % 8 whatever S is, and sums the lanes once at the end: a
     * query's sum then has the same bits however many keys past its own the call holds (its
     * prefill's chunking: masked keys and padding lanes add exactly 0), which the prefix
     * cache's exactness needs (tests/unit/test_chunk_invariance.py). */
    float inv[3];
    for (int g = 0; g < NH; g++) {
        float* sg = sc + g * ss;
        if (vis)
            for (j = 0; j < S; j++)
                if (!vis[j]) sg[j] = -INFINITY;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (j = 0; j + 8 <= S; j += 8)
            vmax = _mm256_max_ps(_mm256_loadu_ps(sg + j), vmax);   /* NaN: kept out */
        float mx = hmax8(vmax);
        for (; j < S; j++)
            if (sg[j] > mx) mx = sg[j];
        __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
        for (j = 0; j + 8 <= S; j += 8) {
            __m256 v = _mm256_loadu_ps(sg + j);
            __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            v = _mm256_and_ps(exp8(_mm256_sub_ps(v, vmx)), keep);
            _mm256_storeu_ps(sg + j, v);
            vsum = _mm256_add_ps(vsum, v);
        }
        if (j < S) {   /* the last keys as one more block, its lanes past S at exactly 0 */
            float t[8];
            for (int l = 0; l < 8; l++) t[l] = j + l < S ? sg[j + l] : -INFINITY;
            __m256 v = _mm256_loadu_ps(t);
            __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            v = _mm256_and_ps(exp8(_mm256_sub_ps(v, vmx)), keep);
            _mm256_storeu_ps(t, v);
            for (int l = 0; j + l < S; l++) sg[j + l] = t[l];
            vsum = _mm256_add_ps(vsum, v);
        }
        inv[g] = 1.0f / hsum8(vsum);
    }
    /* out = sum_j p_j V_j / sum, 32 features of every head in registers while V streams */
    for (long d0 = 0; d0 < hd; d0 += 32) {
        int nc = hd - d0 >= 32 ? 4 : (int)((hd - d0) / 8);
        __m256 acc[3][4];
        for (int g = 0; g < NH; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
        for (long jj = 0; jj < S; jj++) {
            if (vis && !vis[jj]) continue;
            const float* vr = V + jj * hd + d0;
            if (d0 == 0)
                for (long b = 0; b < hd; b += 16)
                    _mm_prefetch((const char*)(V + (jj + PF_KEYS) * hd + b), _MM_HINT_T0);
            if (nc == 4) {
                __m256 vd[4];
                for (int c = 0; c < 4; c++) vd[c] = _mm256_loadu_ps(vr + 8 * c);
                for (int g = 0; g < NH; g++) {
                    __m256 pv = _mm256_set1_ps(sc[g * ss + jj]);
                    for (int c = 0; c < 4; c++) acc[g][c] = _mm256_fmadd_ps(pv, vd[c], acc[g][c]);
                }
            } else {
                for (int g = 0; g < NH; g++) {
                    __m256 pv = _mm256_set1_ps(sc[g * ss + jj]);
                    for (int c = 0; c < nc; c++)
                        acc[g][c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), acc[g][c]);
                }
            }
        }
        for (int g = 0; g < NH; g++) {
            __m256 vinv = _mm256_set1_ps(inv[g]);
            for (int c = 0; c < nc; c++)
                _mm256_storeu_ps(dst + g * hd + d0 + 8 * c, _mm256_mul_ps(acc[g][c], vinv));
        }
    }
}

/* One layer's attention for a ragged batch of segments (sessions), after the q|k|v product.
 *
 *   qkv   [T, row] rows of the product; q at column 0 ([nh, hd]), k at nh*hd, v at (nh+nkv)*hd
 *   cos, sin  [T, rot]: each token's RoPE rows (rotate-half over the first rot features)
 *   seg   [nseg][4]: first row in T, n new tokens, cache position p, first visible key
 *   kv    [nseg]: the layer's buffer [2, nkv, cap, hd] of the segment; cap [nseg]
 *   mask  [nseg]: NULL (every key in [first, p + n) visible) or bool [n, p + n - first]
 *   out   [T, nh * hd]
 *
 * RoPE is applied to q in place and to k on its way into the cache; new K/V rows are stored in
 * token order at p, p + 1, ... Softmax runs in float32 over the visible keys only. */
void tdm_attention(const float* qkv_in, long T, long row, long nh, long nkv, long hd,
                   const float* cos, const float* sin, long rot,
                   long nseg, const long* seg, float* const* kv, const long* cap,
                   const unsigned char* const* mask, float scale, float* out, int threads) {
    float* qkv = (float*)qkv_in;
    long half = rot / 2, groups = nh / nkv;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* RoPE, and the new K/V into each segment's cache */
        #pragma omp for schedule(static)
        for (long s = 0; s < nseg; s++) {
            long off = seg[4 * s], n = seg[4 * s + 1], p = seg[4 * s + 2];
            float* K = kv[s];
            float* V = K + nkv * cap[s] * hd;
            for (long i = 0; i < n; i++) {
                float* r = qkv + (off + i) * row;
                const float* c = cos + (off + i) * rot;
                const float* sn = sin + (off + i) * rot;
                for (long h = 0; h < nh + nkv; h++) {
                    float* x = r + h * hd;
                    float* dst = h < nh ? x : K + ((h - nh) * cap[s] + p + i) * hd;
                    for (long d = 0; d < half; d++) {
                        float a = x[d], b = x[d + half];
                        dst[d] = a * c[d] - b * sn[d];
                        dst[d + half] = b * c[d + half] + a * sn[d + half];
                    }
                    if (h >= nh)
                        for (long d = rot; d < hd; d++) dst[d] = x[d];
                }
                const float* v = r + (nh + nkv) * hd;
                for (long h = 0; h < nkv; h++)
                    for (long d = 0; d < hd; d++) V[(h * cap[s] + p + i) * hd + d] = v[h * hd + d];
            }
        }
        /* the implicit barrier of `omp for`: every cache row is written before any is read */
        /* an item: one new token of a segment against one K/V head and the query heads of
         * its group (attend_heads, up to 3 at a time), so each K and V row is read once for
         * the group, from memory, with the group's arithmetic on it while the next rows
         * stream in (a head at a time streamed the rows for the first head, then re-read them
         * from cache for the others) */
        long smax = 0;   /* the most keys a segment's tokens see: one score buffer a thread */
        for (long s = 0; s < nseg; s++)
            if (seg[4 * s + 2] + seg[4 * s + 1] - seg[4 * s + 3] > smax)
                smax = seg[4 * s + 2] + seg[4 * s + 1] - seg[4 * s + 3];
        float* sc = malloc(sizeof(float) * (size_t)(3 * (smax + 8)));
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < (T * nkv); item++) {
            long t = item / nkv, kvh = item % nkv, s = 0;
            while (s + 1 < nseg && seg[4 * s] + seg[4 * s + 1] <= t) s++;   /* token t's segment */
            long off = seg[4 * s], p = seg[4 * s + 2], first = seg[4 * s + 3];
            long i = t - off, S = p + seg[4 * s + 1] - first;
            const float* K = kv[s] + (kvh * cap[s] + first) * hd;
            const float* V = kv[s] + ((nkv + kvh) * cap[s] + first) * hd;
            const unsigned char* vis = mask[s] ? mask[s] + i * S : NULL;
            for (long h = kvh * groups; h < (kvh + 1) * groups; h += 3) {
                long hs = (kvh + 1) * groups - h < 3 ? (kvh + 1) * groups - h : 3;
                const float* q = qkv + (off + i) * row + h * hd;
                float* dst = out + (off + i) * nh * hd + h * hd;
                if (hs == 3) attend_heads(q, K, V, S, hd, vis, scale, sc, dst, 3);
                else if (hs == 2) attend_heads(q, K, V, S, hd, vis, scale, sc, dst, 2);
                else attend_heads(q, K, V, S, hd, vis, scale, sc, dst, 1);
            }
        }
        free(sc);
    }
}

/* One whole decoder layer of the pre-norm SwiGLU families (Llama, Mistral, Qwen2/3, Phi-3) for
 * a ragged batch, with no Python between its steps:
 *
 *   h = norm(x); qkv = h Wqkv (+ b); [q/k norms]; attention (RoPE, K/V writes)
 *   a = att Wo (+ b); xo = x + a; h = norm(xo); m = silu(h Wg) * (h Wu); xo += m Wd (+ b)
 *
 * w: the layer's tensors by index (LW_*; a missing bias or q/k norm is NULL), the products in
 * panel layout. dims: H, nh, nkv, hd, inter. scratch: T * (2 H + qkv + nh hd + 3 inter) floats.
 * The attention arguments are tdm_attention's. */
enum { LW_IN_NORM, LW_Q_NORM, LW_K_NORM, LW_PRE_MLP_NORM, LW_QKV, LW_QKV_B, LW_O, LW_O_B,
       LW_GATE_UP, LW_GATE_UP_B, LW_DOWN, LW_DOWN_B, LW_COUNT };

void tdm_layer(const float* x, float* xo, long T, const float* const* w, const long* dims,
               float eps, const float* cos, const float* sin, long rot, long nseg,
               const long* seg, float* const* kv, const long* cap,
               const unsigned char* const* mask, float scale, float* scratch, int threads) {
    long H = dims[0], nh = dims[1], nkv = dims[2], hd = dims[3], inter = dims[4];
    long QKV = (nh + 2 * nkv) * hd;
    float* h = scratch;
    float* qkv = h + T * H;
    float* att = qkv + T * QKV;
    float* a = att + T * nh * hd;
    float* gu = a + T * H;
    float* m = gu + T * 2 * inter;
    tdm_rms_norm(x, T, H, w[LW_IN_NORM], eps, h, threads);
    tdm_linear(h, T, H, w[LW_QKV], QKV, w[LW_QKV_B], qkv, threads);
    if (w[LW_Q_NORM]) {
        #pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
        for (long t = 0; t < T; t++)
            for (long hh = 0; hh < nh + nkv; hh++) {
                float* r = qkv + t * QKV + hh * hd;
                norm_row(r, hd, hh < nh ? w[LW_Q_NORM] : w[LW_K_NORM], eps, r);
            }
    }
    tdm_attention(qkv, T, QKV, nh, nkv, hd, cos, sin, rot, nseg, seg, kv, cap, mask, scale, att,
                  threads);
    tdm_linear(att, T, nh * hd, w[LW_O], H, w[LW_O_B], a, threads);
    tdm_add_rms_norm(x, a, T, H, w[LW_PRE_MLP_NORM], eps, xo, h, threads);
    tdm_linear(h, T, H, w[LW_GATE_UP], 2 * inter, w[LW_GATE_UP_B], gu, threads);
    tdm_silu_mul(gu, T, inter, m, threads);
    tdm_linear(m, T, inter, w[LW_DOWN], H, w[LW_DOWN_B], a, threads);
    for (long i = 0; i < T * H; i++) xo[i] += a[i];
}

/* Layers [0, n) of a forward in one call, x and xo taking turns (no Python and no ctypes call
 * between layers: ~25 us a layer on the project's VMs): layer l runs tdm_layer with its
 * tensors w + l LW_COUNT, dims + 5 l, RoPE rows cos[l] and sin[l] (rot[l] wide), its window's
 * segment table seg[l] and masks mask[l], and the segments' cache buffers kv + l nseg
 * (capacities cap + l nseg). Returns where the output is: 0 in x, 1 in xo. */
int tdm_layers(long n, float* x, float* xo, long T, const float* const* w, const long* dims,
               float eps, const float* const* cos, const float* const* sin, const long* rot,
               long nseg, const long* const* seg, float* const* kv, const long* cap,
               const unsigned char* const* const* mask, float scale, float* scratch,
               int threads) {
    for (long l = 0; l < n; l++)
        tdm_layer(l % 2 ? xo : x, l % 2 ? x : xo, T, w + l * LW_COUNT, dims + 5 * l, eps, cos[l],
                  sin[l], rot[l], nseg, seg[l], kv + l * nseg, cap + l * nseg, mask[l], scale,
                  scratch, threads);
    return (int)(n % 2);
}

/* The machine's fp32 FMA throughput, for the bench's compute floor (bench/runner_limits.py),
 * at the width the products use (tdm_isa): each thread runs 12 independent FMA chains on
 * registers (enough to cover the FMA latency on both pipes) `iters` times. Returns the FLOP
 * done; the chains' sum goes to fma_sink, so the compiler keeps them all. */
static volatile double fma_sink;

FMA_PEAK(fma_peak256, __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps,
         _mm256_storeu_ps)

double tdm_fma_peak(long iters, int threads) {
    int lanes = tdm_isa() == 512 ? 16 : 8;
    fma_sink = lanes == 16 ? fma_peak512(iters, threads) : fma_peak256(iters, threads);
    return 12.0 * lanes * 2 * iters * threads;
}
