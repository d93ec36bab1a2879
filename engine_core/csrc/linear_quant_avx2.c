// Weight-only int8 and int4 linears (--quantization) on CPUs with AVX2, FMA and F16C but no AVX512-BF16 (AMD Zen
// 2/3, Intel before Sapphire Rapids): csrc/linear.c's int8 panels and csrc/linear_int4.c's int4 ones, read with
// fp32 FMAs. The arguments are linear()'s, format 1 (int8) or 2 (int4).
//
// Each vector of 8 weights takes one AND (int4) or sign extension (int8) and one integer-to-float conversion, which
// run beside the FMAs. (Through F16C, as fp16 subnormals, as this file did until 2026-12-02, a Zen 3 core unpacked
// 7.8 billion int4 weights a second in L2; this way 18-21.)
// - int4: a 32-byte chunk of a half (8 columns) holds, in each 32-bit lane, one column's 8 nibbles: 4 pairs' even k
//   in the low 16 bits, their odd k in the high 16 (the pair layout's two 16-bit lanes of a column). Nibble r of a
//   half, masked where it lies, converts to q * 16^r exactly, so x is stored times 16^-r (exact: a power of two) and
//   one FMA makes x * q. A lane sums its column over the group's 32 k, then adds scale * that + min * (the row's sum
//   of x over the group).
// - int8: a pair's 8 bytes sign-extend to 8 lanes (4 columns' even and odd k, the pair layout), times x's pair; a
//   lane sums over the group, then adds its scale * that; a column is its two lanes' totals added at the end.
// Every output takes these same steps in the same order whatever the tile, so a row's result never depends on its
// neighbours.
// - A tile is up to 5 rows x some halves of a panel, the partial sums in registers: one row takes the whole panel in
//   one pass, in order, prefetching 8 groups ahead (the hardware's prefetcher alone left a one-row call short of
//   the memory's speed); more rows take fewer halves at a time, those prefetching the next panel in a work item's
//   first rows. The unpacking of a vector is shared by the tile's rows; the lanes' totals live in memory, touched
//   once per group. A work item's rows go a tile at a time through all of its panel: the panel stays in L2 while
//   the rows' x (fp32, widened once per call) is read from L1 or L2.
// Against the F16C version, in turn in one process (bench.kernel_ab, 2-core AMD EPYC, Zen 3, 2026-12-02), the time
// of SmolLM2's layers in int4: 0.76x at 1 row, 0.72x at 8, 0.87x at 64, 0.99x at 2048; in int8: 0.76x, 0.86x at
// 64, 0.85x at 2048; its int8 head 0.73x at 1 row, 0.67x at 8, 0.85x at 64.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#define QA_GROUP QUANT_GROUP  // weights per scale (and min)
#define QA_LANES (2 * LINEAR_PANEL_COLS)  // a panel row's totals: int8's lanes (a column's even k, then odd k)
#define QA_TILE_ROWS 5
#define QA_AHEAD 8  // a one-row tile prefetches the group this many ahead (past the panel's end: the next's)
#define UNROLLED _Pragma("GCC unroll 12")  // loops over a tile's rows and halves: its sums stay in registers

// int4: the 8 lanes' nibble r of a chunk's 32-bit lanes (the even k; odd: of the chunk shifted right by 16) as q *
// 16^r. int8: sign-extended bytes.
static inline __attribute__((always_inline)) __m256 int4_weights(__m256i chunk, int r) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(chunk, _mm256_set1_epi32(0xF << 4 * r)));
}
static inline __attribute__((always_inline)) __m256 int8_weights(const uint8_t* bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)bytes)));
}

// mr rows (xf: fp32, row stride k_len, int4's times 16^-r) x nh halves of a panel of nv 16-column vectors, from half
// h0 on: adds each group's scale * partial sum (int4: + min * the row's x sum over the group, xsum) into totals (row
// stride QA_LANES); prefetches pf_len bytes at pf on the way. format, mr and nh: constants once inlined.
static inline __attribute__((always_inline)) void quant_tile(int format, const float* xf, int64_t k_len,
                                                             const float* xsum, int mr, const uint8_t* panel, int nv,
                                                             int h0, int nh, float* totals, const char* pf,
                                                             int64_t pf_len) {
    const int64_t groups = k_len / QA_GROUP, pf_step = (pf_len + groups - 1) / groups;
    const int parts = format == 1 ? 2 : 1;  // sums per row and half: int8's lanes cover 4 columns
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = g * pf_step; b < (g + 1) * pf_step && b < pf_len; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        const uint8_t* group = quant_group(panel, format, nv, g);
        if (mr == 1) {  // it reads memory faster than the hardware's prefetcher fetches it
            const int64_t gb = nv * quant_group_vec_bytes(format);
            for (int64_t b = 0; b < gb; b += 64) _mm_prefetch((const char*)group + QA_AHEAD * gb + b, _MM_HINT_T0);
        }
        const float* x = xf + g * QA_GROUP;
        __m256 part[QA_TILE_ROWS][12];  // used: mr x parts nh of them
        UNROLLED for (int i = 0; i < mr; i++)
            UNROLLED for (int h = 0; h < parts * nh; h++) part[i][h] = _mm256_setzero_ps();
        if (format == 1) {
            for (int p = 0; p < QA_GROUP / 2; p++)  // a pair of k: 16 bytes a half
                UNROLLED for (int h = 0; h < nh; h++) {
                    const uint8_t* bytes = group + (int64_t)p * nv * 32 + (h0 + h) * 16;
                    const __m256 lo = int8_weights(bytes), hi = int8_weights(bytes + 8);
                    UNROLLED for (int i = 0; i < mr; i++) {
                        const __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(x + i * k_len + 2 * p)));
                        part[i][2 * h] = _mm256_fmadd_ps(xp, lo, part[i][2 * h]);
                        part[i][2 * h + 1] = _mm256_fmadd_ps(xp, hi, part[i][2 * h + 1]);
                    }
                }
        } else {
            for (int c = 0; c < QA_GROUP / 8; c++)  // a chunk: 4 pairs of k, 32 bytes a half
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {  // even k of pairs 0-3, then odd k
                    UNROLLED for (int h = 0; h < nh; h++) {
                        const int hh = h0 + h;
                        const uint8_t* at = group + (c * nv + hh / 2) * 64 + hh % 2 * 32;
                        __m256i chunk = _mm256_loadu_si256((const __m256i*)at);
                        if (j >= 4) chunk = _mm256_srli_epi32(chunk, 16);
                        const __m256 w = int4_weights(chunk, j % 4);
                        UNROLLED for (int i = 0; i < mr; i++) {
                            const __m256 xk = _mm256_broadcast_ss(x + i * k_len + 8 * c + 2 * (j % 4) + j / 4);
                            part[i][h] = _mm256_fmadd_ps(xk, w, part[i][h]);
                        }
                    }
                }
        }
        const float* scales = quant_scales(group, format, nv);
        UNROLLED for (int q = 0; q < parts * nh; q++) {  // 8 lanes at a time
            __m256 scale, min = _mm256_setzero_ps();
            if (format == 1) {  // the lanes of columns c0 .. c0 + 3, each vector's 32 lane scales in a row
                const int c0 = 8 * h0 + 4 * q;
                scale = _mm256_loadu_ps(scales + c0 / 16 * 32 + c0 % 16 * 2);
            } else {  // columns 8 (h0 + q) on: the 16 nv scales, then as many mins
                scale = _mm256_loadu_ps(scales + 8 * (h0 + q)), min = _mm256_loadu_ps(scales + 16 * nv + 8 * (h0 + q));
            }
            UNROLLED for (int i = 0; i < mr; i++) {
                float* total = totals + i * QA_LANES + 8 * (parts * h0 + q);
                __m256 sum = _mm256_fmadd_ps(part[i][q], scale, _mm256_loadu_ps(total));
                if (format == 2) sum = _mm256_fmadd_ps(_mm256_broadcast_ss(xsum + i * groups + g), min, sum);
                _mm256_storeu_ps(total, sum);
            }
        }
    }
}

// mr rows (1 to QA_TILE_ROWS) through all 2 nv halves of a panel, in tiles as wide as the registers allow; the
// tiles of more than one row prefetch pf_len bytes at pf (the next panel, in a work item's first rows).
static inline __attribute__((always_inline)) void quant_rows(int format, const float* xf, int64_t k_len,
                                                             const float* xsum, int mr, const uint8_t* panel, int nv,
                                                             float* totals, const char* pf, int64_t pf_len) {
#define QA_TILE(MR, H0, NH, PF_LEN) quant_tile(format, xf, k_len, xsum, MR, panel, nv, H0, NH, totals, pf, PF_LEN)
#define QA_HALVES(MR, NH) for (int h0 = 0; h0 < 2 * nv; h0 += NH) QA_TILE(MR, h0, NH, h0 == 0 ? pf_len : 0)
    switch (mr) {
        case 1:  // the whole panel in one pass, in order
            if (nv == 3) QA_TILE(1, 0, 6, 0);
            else if (nv == 2) QA_TILE(1, 0, 4, 0);
            else QA_TILE(1, 0, 2, 0);
            break;
        case 2: QA_HALVES(2, 2); break;
        case 3: QA_HALVES(3, format == 1 ? 1 : 2); break;
        case 4: QA_HALVES(4, format == 1 ? 1 : 2); break;
        default: QA_HALVES(5, format == 1 ? 1 : 2); break;
    }
#undef QA_TILE
#undef QA_HALVES
}
// One copy per format, each with its unpacking inlined.
static void rows_int8(const float* xf, int64_t k_len, const float* xsum, int mr, const uint8_t* panel, int nv,
                      float* totals, const char* pf, int64_t pf_len) {
    quant_rows(1, xf, k_len, xsum, mr, panel, nv, totals, pf, pf_len);
}
static void rows_int4(const float* xf, int64_t k_len, const float* xsum, int mr, const uint8_t* panel, int nv,
                      float* totals, const char* pf, int64_t pf_len) {
    quant_rows(2, xf, k_len, xsum, mr, panel, nv, totals, pf, pf_len);
}

int linear_quant_avx2_available(void) { return 1; }

void linear_quant_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format,
                       const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + LINEAR_PANEL_COLS - 1) / LINEAR_PANEL_COLS, groups = k_len / QA_GROUP;
    const int64_t tiles = (m_len + QA_TILE_ROWS - 1) / QA_TILE_ROWS;
    const int64_t bytes_per_col = linear_bytes_per_col(format, k_len);
    const float nibble_place[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};  // int4: x at k times 16^-r
    float* xf = malloc(m_len * k_len * sizeof(float));     // x widened once, read by every panel
    float* xsum = malloc(m_len * groups * sizeof(float));  // int4: per row and group, the sum of x
    _Pragma("omp parallel for schedule(static) if (m_len * k_len >= 1 << 16)") for (int64_t i = 0; i < m_len; i++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.f;
            for (int64_t k = g * QA_GROUP; k < (g + 1) * QA_GROUP; k++) {
                const float v = bf16_load(x[i * ldx + k]);
                xf[i * k_len + k] = format == 2 ? v * nibble_place[k / 2 % 4] : v;
                sum += v;
            }
            xsum[i * groups + g] = sum;
        }
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        float* totals = malloc(QA_TILE_ROWS * QA_LANES * sizeof(float));
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * row_parts; item++) {
            const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
            const int64_t first = it.part * tiles / row_parts;
            for (int64_t t = first; t < (it.part + 1) * tiles / row_parts; t++) {
                const int64_t m0 = t * QA_TILE_ROWS;
                const int mr = m_len - m0 < QA_TILE_ROWS ? (int)(m_len - m0) : QA_TILE_ROWS;
                for (int64_t e = 0; e < mr * QA_LANES; e++) totals[e] = 0.f;
                const int64_t pf_len = t == first ? it.next_bytes : 0;
                (format == 1 ? rows_int8 : rows_int4)(xf + m0 * k_len, k_len, xsum + m0 * groups, mr,
                                                      (const uint8_t*)it.panel, it.nv, totals, it.next, pf_len);
                for (int i = 0; i < mr; i++)
                    for (int64_t c = 0; c < it.cols; c++) {
                        const float* lanes = totals + i * QA_LANES;
                        const float b = bias ? bf16_load(bias[it.n0 + c]) : 0.f;
                        const float sum = format == 1 ? lanes[2 * c] + lanes[2 * c + 1] : lanes[c];
                        out[(m0 + i) * ldo + it.n0 + c] = bf16_store(sum + b);
                    }
            }
        }
        free(totals);
    }
    free(xf);
    free(xsum);
}
#else
int linear_quant_avx2_available(void) { return 0; }
void linear_quant_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format,
                       const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)format, (void)bias, (void)out, (void)ldo, (void)n_len,
        (void)k_len;
}
#endif
