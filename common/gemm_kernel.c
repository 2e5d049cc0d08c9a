/* The runner's CPU matrix product (common/gemm.py builds and loads this file):
 *
 *     y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])     fp32, AVX2 + FMA, OpenMP
 *
 * W is stored once, at load, as panels of 16 output rows, k-major inside a panel:
 *
 *     Wp[p][k][j] = W[16 p + j][k]        (zero rows pad the last panel)
 *
 * so a panel streams from memory as one contiguous run, and one k step is two 8-lane loads of
 * W and one broadcast of x per row. Why not MKL or oneDNN: for the row counts of decode,
 * ragged decode batches and verification (1-8 rows) their products read the weights at 12-17
 * GB/s on this project's 2-core AMD EPYC while a plain read streams 35 GB/s; this layout
 * reaches 25-29 GB/s for one row and stays ahead of oneDNN's prepacked weights up to 512 rows
 * (common/runner.py's module doc has the numbers).
 *
 * Every output is one sequential FMA chain over k (no split sums, no horizontal reduction),
 * and a row's chain does not depend on which tile or how many other rows it was computed
 * with: a session's result is bit for bit the same alone or in any batch.
 */
#include <immintrin.h>
#include <omp.h>

#define PW 16   /* output rows per panel: two 8-lane vectors */

void tdm_pack(const float* W, long N, long K, float* Wp) {
    long P = (N + PW - 1) / PW;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < P; p++)
        for (long k = 0; k < K; k++)
            for (long j = 0; j < PW; j++) {
                long n = p * PW + j;
                Wp[(p * K + k) * PW + j] = n < N ? W[n * K + k] : 0.0f;
            }
}

/* Rows [m0, m0 + MB) of x against panels [p0, p0 + NP): MB * NP * 2 accumulators (at most 12
 * of the 16 ymm registers, the rest hold W and the broadcast). */
#define KERNEL(MB, NP)                                                                          \
static void k_##MB##_##NP(const float* restrict x, long K, const float* restrict Wp, long p0,  \
                          long m0, long N, const float* restrict bias, float* restrict y) {    \
    __m256 acc[MB][NP][2];                                                                      \
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)                                        \
    _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                        \
        acc[m][q][0] = acc[m][q][1] = _mm256_setzero_ps();                                      \
    const float* w = Wp + p0 * K * PW;                                                          \
    const float* xr = x + m0 * K;                                                               \
    for (long k = 0; k < K; k++) {                                                              \
        __m256 wv[NP][2];                                                                       \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                  \
            wv[q][0] = _mm256_loadu_ps(w + (q * K + k) * PW);                                   \
            wv[q][1] = _mm256_loadu_ps(w + (q * K + k) * PW + 8);                               \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                  \
            __m256 xb = _mm256_broadcast_ss(xr + m * K + k);                                    \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                              \
                acc[m][q][0] = _mm256_fmadd_ps(wv[q][0], xb, acc[m][q][0]);                     \
                acc[m][q][1] = _mm256_fmadd_ps(wv[q][1], xb, acc[m][q][1]);                     \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)                                        \
    _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                      \
        long n = (p0 + q) * PW;                                                                 \
        float out[PW];                                                                          \
        _mm256_storeu_ps(out, acc[m][q][0]);                                                    \
        _mm256_storeu_ps(out + 8, acc[m][q][1]);                                                \
        float* yr = y + (m0 + m) * N;                                                           \
        for (int j = 0; j < PW && n + j < N; j++)                                               \
            yr[n + j] = bias ? out[j] + bias[n + j] : out[j];                                   \
    }                                                                                           \
}
KERNEL(1, 4) KERNEL(1, 2) KERNEL(1, 1)
KERNEL(2, 3) KERNEL(2, 1)
KERNEL(3, 2) KERNEL(3, 1)
KERNEL(4, 1) KERNEL(5, 1) KERNEL(6, 1)

/* Panels [pa, pb) for rows [m0, m0 + mb), mb <= 6: the widest tile that fits, then narrower. */
static void block(const float* x, long K, const float* Wp, long pa, long pb, long m0, long mb,
                  long N, const float* bias, float* y) {
    long p = pa;
    switch (mb) {
    case 1:
        for (; p + 4 <= pb; p += 4) k_1_4(x, K, Wp, p, m0, N, bias, y);
        for (; p + 2 <= pb; p += 2) k_1_2(x, K, Wp, p, m0, N, bias, y);
        for (; p < pb; p++) k_1_1(x, K, Wp, p, m0, N, bias, y);
        break;
    case 2:
        for (; p + 3 <= pb; p += 3) k_2_3(x, K, Wp, p, m0, N, bias, y);
        for (; p < pb; p++) k_2_1(x, K, Wp, p, m0, N, bias, y);
        break;
    case 3:
        for (; p + 2 <= pb; p += 2) k_3_2(x, K, Wp, p, m0, N, bias, y);
        for (; p < pb; p++) k_3_1(x, K, Wp, p, m0, N, bias, y);
        break;
    case 4: for (; p < pb; p++) k_4_1(x, K, Wp, p, m0, N, bias, y); break;
    case 5: for (; p < pb; p++) k_5_1(x, K, Wp, p, m0, N, bias, y); break;
    case 6: for (; p < pb; p++) k_6_1(x, K, Wp, p, m0, N, bias, y); break;
    }
}

#define MB_MAX 6         /* rows per tile */
#define PANEL_CHUNK 4    /* panels a thread keeps in L1/L2 while every 6-row block passes */

/* `threads` is the caller's (torch's) thread count: the OpenMP runtime is torch's own
 * (common/gemm.py loads this library after torch), so this shares its thread pool. */
void tdm_linear(const float* x, long M, long K, const float* Wp, long N, const float* bias,
                float* y, int threads) {
    long P = (N + PW - 1) / PW;
    if (threads > P) threads = (int)P;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long pa = P * t / T, pb = P * (t + 1) / T;
        long step = M <= MB_MAX ? pb - pa : PANEL_CHUNK;
        for (long c = pa; c < pb; c += step) {
            long ce = c + step < pb ? c + step : pb;
            for (long m0 = 0; m0 < M; m0 += MB_MAX)
                block(x, K, Wp, c, ce, m0, M - m0 < MB_MAX ? M - m0 : MB_MAX, N, bias, y);
        }
    }
}
