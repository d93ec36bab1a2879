// Weight-only int8 linear for CPU: out[m, n] = sum_k x[m, k] * w[n, k] * scale[n, k / 32] (+ bias[n]).
// A single stream's decode step is bound by reading the weights: int8 halves the bytes of bf16.
// Each thread takes blocks of 4 weight rows and dequantizes them to bf16 (one scale per 32 weights of a row),
// into a small buffer when many input rows will reuse them; AVX512-BF16 pair dot products, fp32 sums.
#include "kernel_common.h"

#define MAX_K 8192
#define ROWS 4  // weight rows per block, and input rows per inner block
#define PREFETCH_BLOCKS 4

#if defined(__AVX512BF16__)
#define GROUP 32  // weights per scale: one AVX-512 bf16 vector

static inline __m512bh widen32(const int8_t* p, float scale) {  // 32 int8 -> bf16(q * scale)
    const __m512 s = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
}

// acc[i][j] over k for input rows x[i] and weight rows j: widened ones in wb, or (w8 given) widened here from
// int8, which saves the buffer's round trip when the rows meet a single block of inputs. mb, nb: constants.
static inline __attribute__((always_inline)) void dot_block(const uint16_t* x, int64_t ldx, int mb,
                                                            const uint16_t* wb, const int8_t* w8,
                                                            const float* sc, int64_t k_len, int nb,
                                                            float sums[ROWS][ROWS]) {
    const int64_t groups = k_len / GROUP;
    __m512 acc[ROWS][ROWS];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 32) {
        __m512bh wv[ROWS];
        for (int j = 0; j < nb; j++)
            wv[j] = w8 ? widen32(w8 + j * k_len + k, sc[j * groups + k / GROUP])
                       : (__m512bh)_mm512_loadu_si512(wb + j * k_len + k);
        for (int i = 0; i < mb; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static void widen_rows(const int8_t* w, const float* sc, int64_t k_len, int nb, uint16_t* wb) {
    for (int j = 0; j < nb; j++)
        for (int64_t k = 0; k < k_len; k += GROUP)
            _mm512_storeu_si512(wb + j * k_len + k, (__m512i)widen32(w + j * k_len + k, sc[(j * k_len + k) / GROUP]));
}

#define DOT_CASE(MB) w8 ? dot_block(xr, ldx, MB, 0, w8, sc, k_len, ROWS, sums) \
                        : dot_block(xr, ldx, MB, wb, 0, 0, k_len, ROWS, sums)
static void dot_any(const uint16_t* xr, int64_t ldx, int mb, const uint16_t* wb, const int8_t* w8, const float* sc,
                    int64_t k_len, int nb, float sums[ROWS][ROWS]) {
    if (nb == ROWS) {
        switch (mb) {
            case 4: DOT_CASE(4); break;
            case 3: DOT_CASE(3); break;
            case 2: DOT_CASE(2); break;
            default: DOT_CASE(1); break;
        }
    } else {  // the last block of a weight whose row count is not a multiple of 4
        for (int j = 0; j < nb; j++)
            for (int i = 0; i < mb; i++) {
                float one[ROWS][ROWS];
                dot_block(xr + i * ldx, ldx, 1, 0, w8 + j * k_len, sc + j * (k_len / GROUP), k_len, 1, one);
                sums[i][j] = one[0][0];
            }
    }
}

int int8_linear_available(void) { return 1; }
#else
int int8_linear_available(void) { return 0; }
#endif

// x: bf16 [m_len, k_len] with row stride ldx; w: int8 [n_len, k_len]; scale: fp32 [n_len, k_len / 32];
// bias: bf16 [n_len] or NULL; out: bf16 [m_len, n_len]. k_len must be a multiple of 32 and at most MAX_K.
void int8_linear_bf16(const uint16_t* x, int64_t ldx, int64_t m_len, const int8_t* w, const float* scale,
                      const uint16_t* bias, uint16_t* out, int64_t n_len, int64_t k_len) {
#if defined(__AVX512BF16__)
    const int64_t blocks = (n_len + ROWS - 1) / ROWS;
    _Pragma("omp parallel for schedule(static) if (n_len * k_len >= 1 << 16)")
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t wb[ROWS * MAX_K] __attribute__((aligned(64)));
        const int64_t n0 = b * ROWS;
        const int nb = n_len - n0 < ROWS ? (int)(n_len - n0) : ROWS;
        const int8_t* w8 = w + n0 * k_len;
        // Software prefetch a few blocks ahead: with the hardware prefetcher alone a single thread streamed
        // about 15 GB/s of weights here, with this about 25.
        if (b + PREFETCH_BLOCKS < blocks)
            for (int64_t o = 0; o < ROWS * k_len; o += 64)
                _mm_prefetch((const char*)(w8 + PREFETCH_BLOCKS * ROWS * k_len + o), _MM_HINT_T0);
        const float* sc = scale + n0 * (k_len / GROUP);
        const int direct = m_len <= ROWS || nb < ROWS;
        if (!direct) widen_rows(w8, sc, k_len, nb, wb);
        for (int64_t m0 = 0; m0 < m_len; m0 += ROWS) {
            const int mb = m_len - m0 < ROWS ? (int)(m_len - m0) : ROWS;
            float sums[ROWS][ROWS];
            dot_any(x + m0 * ldx, ldx, mb, wb, direct ? w8 : 0, sc, k_len, nb, sums);
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    float v = sums[i][j];
                    if (bias) v += bf16_load(bias[n0 + j]);
                    out[(m0 + i) * n_len + n0 + j] = bf16_store(v);
                }
        }
    }
#else
    (void)x, (void)ldx, (void)m_len, (void)w, (void)scale, (void)bias, (void)out, (void)n_len, (void)k_len;
#endif
}

int int8_linear_max_k(void) { return MAX_K; }
