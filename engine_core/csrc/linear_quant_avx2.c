// Weight-only int8 and int4 linears (--quantization) on CPUs with AVX2, FMA and F16C but no AVX512-BF16 (AMD Zen
// 2/3, Intel before Sapphire Rapids): csrc/linear.c's int8 panels and csrc/linear_int4.c's int4 ones, read with
// fp32 FMAs. The arguments are linear()'s, format 1 (int8) or 2 (int4).
//
// Both formats keep their panels' pair layout: an 8-column half of a panel holds, for each pair of k, 16 lanes
// (column c's k = 2p in lane 2c, 2p + 1 in lane 2c + 1). One pair's 16 values become 16-bit integers u in 0..255
// (int4: a nibble, u = q; int8: u = q + 128), which are the bits of fp16 subnormals u * 2^-24: F16C converts them
// exactly, two instructions for 16 weights, no integer-to-float step. So the products keep the pair layout: a lane
// sums x[2p] * u (or x[2p + 1] * u) over a group of 32 k, and the group then adds scale * that + min * (the row's
// sum of its even, or odd, x over the group) to the lane's total (int8: min = -128 scale); a column is its two
// lanes' totals added at the end. Every output takes these same steps in the same order whatever the tile, so a
// row's result never depends on its neighbours.
// - A tile is up to 5 rows (int8: 4, whose unpacking holds a constant in a register) x some halves of a panel, the
//   partial sums in registers (12 at most): one row takes the whole panel in one pass, in order; two rows two
//   halves, more one half, those prefetching the next panel in a work item's first rows (the strided reads of a
//   half found the weights in memory otherwise: SmolLM2's linears at 8 rows 26.7 -> 23.5 ms). The unpacking of a
//   pair is shared by the tile's rows; the lanes' totals live in memory, touched once per group.
// - A work item's rows go a tile at a time through all of its panel: the panel stays in L2 while the rows' x (fp32,
//   widened once per call) is read from L1 or L2. Past 32 rows (a prefill) each panel's u are widened first, once,
//   each half's in a row, and the tiles read them instead of unpacking: the same values in the same order, so the
//   same bits. SmolLM2's linears, int4, against bf16 (csrc/linear_avx2.c) in the same runs: 1 row 7.5 ms against
//   10.9, 8 rows 23.4 against 19.9, 64 rows 135 against 140, 2048 rows 3270 against 3075.
// Dequantizing each weight first (scale * q + min, then x times it: an FMA more per 8 weights) took 7.9 ms at one
// row against 5.8; widening the int8 panel to bf16 in memory at every call, as this file's int8 once did, made int8
// twice as slow as bf16 at one row (21.5 ms against 10.5).
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#define QA_GROUP QUANT_GROUP  // weights per scale (and min)
#define QA_GROUP_PAIRS (QA_GROUP / 2)
#define QA_LANES (2 * LINEAR_PANEL_COLS)                  // a panel row's lanes: a column's even k, then odd k
#define QA_TILE_ROWS 5  // int4's; int8's 4: its unpacking holds a constant in a register, 5 rows spilled a sum
#define QA_WIDEN_ROWS 32  // more rows: each panel's u widened once per call
#define QA_PARTS 12  // partial-sum registers of a tile: 2 per row and half
#define UNROLLED _Pragma("GCC unroll 12")  // loops over a tile's rows and halves: its sums stay in registers

static inline int tile_rows(int format, int widened) {
    return format == 1 && !widened ? QA_TILE_ROWS - 1 : QA_TILE_ROWS;
}

// Pair p of a group (nv vectors) in half hh as 16 integers u, in 16-bit lanes.
static inline __attribute__((always_inline)) __m256i unpack_u(int format, const uint8_t* group, int nv, int p, int hh) {
    if (format == 1) {  // 16 bytes: the half's columns x 2
        const __m128i q = _mm_loadu_si128((const __m128i*)(group + (int64_t)p * nv * 32 + hh * 16));
        return _mm256_add_epi16(_mm256_cvtepi8_epi16(q), _mm256_set1_epi16(128));
    }
    // int4: four pairs' nibbles in each 16-bit lane of a 32-byte chunk; two shifts keep no mask in a register
    const int r = p % 4;
    const __m256i lanes = _mm256_loadu_si256((const __m256i*)(group + (p / 4 * nv + hh / 2) * 64 + hh % 2 * 32));
    return _mm256_srli_epi16(r == 3 ? lanes : _mm256_slli_epi16(lanes, 12 - 4 * r), 12);
}

// Where a widened panel (widen_panel) keeps the 16 u of pair p of group g in half hh: each half's in a row, so that
// a tile of one half reads them in order.
static inline int64_t widened_at(int64_t groups, int hh, int64_t g, int p) {
    return ((hh * groups + g) * QA_GROUP_PAIRS + p) * 16;
}

// The same as fp32 u * 2^-24: columns 0-3 of the half (lo), 4-7 (hi); from the panel, or from its u widened once
// per call.
static inline __attribute__((always_inline)) void unpack_pair(int format, int widened, const uint16_t* wide,
                                                              const uint8_t* group, int64_t groups, int64_t g, int nv,
                                                              int p, int hh, __m256* lo, __m256* hi) {
    const __m256i u = widened ? _mm256_loadu_si256((const __m256i*)(wide + widened_at(groups, hh, g, p)))
                              : unpack_u(format, group, nv, p, hh);
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(u));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(u, 1));
}

static void widen_panel(int format, const uint8_t* panel, int nv, int64_t groups, uint16_t* wide) {
    for (int64_t g = 0; g < groups; g++)
        for (int p = 0; p < QA_GROUP_PAIRS; p++)
            for (int hh = 0; hh < 2 * nv; hh++)
                _mm256_storeu_si256((__m256i*)(wide + widened_at(groups, hh, g, p)),
                                    unpack_u(format, quant_group(panel, format, nv, g), nv, p, hh));
}

// Scale (times 2^24, undoing u's) and min of columns c0 .. c0 + 3 of a group, each twice as the lanes hold them.
static inline __attribute__((always_inline)) void group_scales(int format, const uint8_t* group, int nv, int c0,
                                                               __m256* scale, __m256* min) {
    const __m256 unscale = _mm256_set1_ps(16777216.f);
    if (format == 1) {  // each vector's 32 lane scales
        const float* lanes = quant_scales(group, 1, nv) + c0 / 16 * 32 + c0 % 16 * 2;
        const __m256 s = _mm256_loadu_ps(lanes);
        *scale = _mm256_mul_ps(s, unscale), *min = _mm256_mul_ps(s, _mm256_set1_ps(-128.f));
        return;
    }
    const float* scales = quant_scales(group, 2, nv);  // then the mins: 16 nv of each
    const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    *scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(scales + c0)), twice), unscale);
    *min = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(scales + 16 * nv + c0)), twice);
}

// mr rows (xf: fp32, row stride k_len) x nh halves of a panel of nv 16-column vectors, from half h0 on: adds each
// group's scale * partial sum + min * the row's even or odd x sum (xsum: per row, group and parity) into totals
// (row stride QA_LANES); prefetches pf_len bytes at pf on the way. format, mr and nh: constants once inlined.
static inline __attribute__((always_inline)) void quant_tile(int format, int widened, const uint16_t* wide,
                                                             const float* xf, int64_t k_len, const float* xsum,
                                                             int mr, const uint8_t* panel, int nv, int h0, int nh,
                                                             float* totals, const char* pf, int64_t pf_len) {
    const int64_t groups = k_len / QA_GROUP, pf_step = (pf_len + groups - 1) / groups;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = g * pf_step; b < (g + 1) * pf_step && b < pf_len; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        const uint8_t* group = quant_group(panel, format, nv, g);
        __m256 part[QA_TILE_ROWS][QA_PARTS];  // used: mr x 2 nh of them
        UNROLLED for (int i = 0; i < mr; i++)
            UNROLLED for (int h = 0; h < 2 * nh; h++) part[i][h] = _mm256_setzero_ps();
        for (int p0 = 0; p0 < QA_GROUP_PAIRS; p0 += 4)
            _Pragma("GCC unroll 4") for (int p = p0; p < p0 + 4; p++) {
                const int64_t k = g * QA_GROUP + 2 * p;
                UNROLLED for (int h = 0; h < nh; h++) {
                    __m256 lo, hi;
                    unpack_pair(format, widened, wide, group, groups, g, nv, p, h0 + h, &lo, &hi);
                    UNROLLED for (int i = 0; i < mr; i++) {
                        const __m256 x = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(xf + i * k_len + k)));
                        part[i][2 * h] = _mm256_fmadd_ps(x, lo, part[i][2 * h]);
                        part[i][2 * h + 1] = _mm256_fmadd_ps(x, hi, part[i][2 * h + 1]);
                    }
                }
            }
        UNROLLED for (int q = 0; q < 2 * nh; q++) {  // four columns at a time
            const int c0 = 8 * h0 + 4 * q;
            __m256 scale, min;
            group_scales(format, group, nv, c0, &scale, &min);
            UNROLLED for (int i = 0; i < mr; i++) {
                float* total = totals + i * QA_LANES + 2 * c0;
                const __m256 x = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(xsum + (i * groups + g) * 2)));
                const __m256 sum = _mm256_fmadd_ps(part[i][q], scale, _mm256_loadu_ps(total));
                _mm256_storeu_ps(total, _mm256_fmadd_ps(x, min, sum));
            }
        }
    }
}

// mr rows (1 to tile_rows) through all 2 nv halves of a panel, in tiles as wide as the registers allow; the tiles
// of more than one row prefetch pf_len bytes at pf (the next panel, in a work item's first rows).
static inline __attribute__((always_inline)) void quant_rows(int format, int widened, const uint16_t* wide,
                                                             const float* xf, int64_t k_len, const float* xsum, int mr,
                                                             const uint8_t* panel, int nv, float* totals,
                                                             const char* pf, int64_t pf_len) {
#define QA_TILE(MR, H0, NH, PF_LEN) \
    quant_tile(format, widened, wide, xf, k_len, xsum, MR, panel, nv, H0, NH, totals, pf, PF_LEN)
#define QA_HALVES(MR, NH) for (int h0 = 0; h0 < 2 * nv; h0 += NH) QA_TILE(MR, h0, NH, h0 == 0 ? pf_len : 0)
    switch (mr) {
        case 1:  // the whole panel in one pass, in order
            if (nv == 3) QA_TILE(1, 0, 6, 0);
            else if (nv == 2) QA_TILE(1, 0, 4, 0);
            else QA_TILE(1, 0, 2, 0);
            break;
        case 2: QA_HALVES(2, 2); break;
        case 3: QA_HALVES(3, 1); break;
        case 4: QA_HALVES(4, 1); break;
        default: QA_HALVES(5, 1); break;
    }
#undef QA_TILE
#undef QA_HALVES
}
// One copy per format and source, each with its unpacking inlined.
#define QA_ROWS(NAME, FORMAT, WIDENED)                                                                              \
    static void NAME(const uint16_t* wide, const float* xf, int64_t k_len, const float* xsum, int mr,               \
                     const uint8_t* panel, int nv, float* totals, const char* pf, int64_t pf_len) {                 \
        quant_rows(FORMAT, WIDENED, wide, xf, k_len, xsum, mr, panel, nv, totals, pf, pf_len);                      \
    }
QA_ROWS(rows_int8, 1, 0)
QA_ROWS(rows_int4, 2, 0)
QA_ROWS(rows_widened_int8, 1, 1)
QA_ROWS(rows_widened_int4, 2, 1)
#undef QA_ROWS

int linear_quant_avx2_available(void) { return 1; }

void linear_quant_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format,
                       const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + LINEAR_PANEL_COLS - 1) / LINEAR_PANEL_COLS, groups = k_len / QA_GROUP;
    const int widened = m_len > QA_WIDEN_ROWS, rows = tile_rows(format, widened);
    const int64_t tiles = (m_len + rows - 1) / rows;
    const int64_t bytes_per_col = linear_bytes_per_col(format, k_len);
    float* xf = malloc(m_len * k_len * sizeof(float));         // x widened once, read by every panel
    float* xsum = malloc(m_len * groups * 2 * sizeof(float));  // per row and group: the sums of even and odd x
    _Pragma("omp parallel for schedule(static) if (m_len * k_len >= 1 << 16)") for (int64_t i = 0; i < m_len; i++)
        for (int64_t g = 0; g < groups; g++) {
            float even = 0.f, odd = 0.f;
            for (int64_t k = g * QA_GROUP; k < (g + 1) * QA_GROUP; k += 2) {
                xf[i * k_len + k] = bf16_load(x[i * ldx + k]), xf[i * k_len + k + 1] = bf16_load(x[i * ldx + k + 1]);
                even += xf[i * k_len + k], odd += xf[i * k_len + k + 1];
            }
            xsum[(i * groups + g) * 2] = even, xsum[(i * groups + g) * 2 + 1] = odd;
        }
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        float* totals = malloc(QA_TILE_ROWS * QA_LANES * sizeof(float));
        uint16_t* wide = widened ? malloc(groups * QA_GROUP_PAIRS * QA_LANES * sizeof(uint16_t)) : NULL;
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * row_parts; item++) {
            const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
            const int64_t first = it.part * tiles / row_parts;
            if (widened) widen_panel(format, (const uint8_t*)it.panel, it.nv, groups, wide);
            for (int64_t t = first; t < (it.part + 1) * tiles / row_parts; t++) {
                const int64_t m0 = t * rows;
                const int mr = m_len - m0 < rows ? (int)(m_len - m0) : rows;
                for (int64_t e = 0; e < mr * QA_LANES; e++) totals[e] = 0.f;
                const int64_t pf_len = t == first ? it.next_bytes : 0;
                (widened ? (format == 1 ? rows_widened_int8 : rows_widened_int4) : format == 1 ? rows_int8 : rows_int4)(
                    wide, xf + m0 * k_len, k_len, xsum + m0 * groups * 2, mr, (const uint8_t*)it.panel, it.nv, totals,
                    it.next, pf_len);
                for (int i = 0; i < mr; i++)
                    for (int64_t c = 0; c < it.cols; c++) {
                        const float* lanes = totals + i * QA_LANES + 2 * c;
                        const float b = bias ? bf16_load(bias[it.n0 + c]) : 0.f;
                        out[(m0 + i) * ldo + it.n0 + c] = bf16_store(lanes[0] + lanes[1] + b);
                    }
            }
        }
        free(totals);
        free(wide);
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
