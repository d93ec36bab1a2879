// bf16 linear layers on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake): the
// panels of csrc/linear.c, read with fp32 FMAs. Weights stay bf16 in memory, half fp32's bytes: a decode step's
// few rows are bound by reading them, and torch's bf16 matmul emulates it at a quarter of fp32's speed here.
//
// A 32-bit lane of a packed panel holds one column's weights for k = 2p (low half) and 2p + 1 (high half), so
// `lane << 16` and `lane & 0xFFFF0000` are the two fp32 weights: no shuffles. A tile of up to 4 input rows
// (x widened to fp32 once per call) x 24 columns keeps 12 accumulators in registers; 1 or 2 rows take the whole
// 48-column panel in one pass (the LM head at one row: 10 -> 5 ms, torch's fp32 17 ms). Widening a panel to
// fp32 once for many rows, as csrc/linear.c does for int8, made prefill slower here (231 -> 197 tok/s). Every
// output adds its k products one after the other in k order whatever the number of rows: a row's result never
// depends on its neighbours.
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL_COLS LINEAR_PANEL_COLS  // csrc/linear.c's panels: the packing is shared
#define TILE_ROWS 4
#define TILE_VECS 3  // 8-column vectors per tile: half a panel, or the whole panel for 1 or 2 rows
#define WIDE_VECS (PANEL_COLS / 8)
#define UNROLLED _Pragma("GCC unroll 4")

// mr rows of xf (fp32, row stride k_len) x nv vectors starting at vector v0 of a panel whose k pairs are
// pair_u16 bf16 apart; writes bf16 out (+ bias) for the first `cols` columns of the panel.
static inline __attribute__((always_inline)) void tile(const float* xf, int64_t k_len, int mr, const uint16_t* panel,
                                                       int64_t pair_u16, int v0, int nv, const uint16_t* bias,
                                                       uint16_t* out, int64_t ldo, int64_t cols) {
    __m256 acc[TILE_ROWS][WIDE_VECS];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t pairs = k_len / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t* w = panel + p * pair_u16 + 16 * v0;
        UNROLLED for (int j = 0; j < nv; j++) {
            const __m256i lanes = _mm256_loadu_si256((const __m256i*)(w + 16 * j));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(lanes, high));
            UNROLLED for (int i = 0; i < mr; i++) {
                acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf + i * k_len + 2 * p), even, acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xf + i * k_len + 2 * p + 1), odd, acc[i][j]);
            }
        }
    }
    // Out of registers in unrolled loops only: a variable index would keep the sums in memory inside the k loop.
    float sums[TILE_ROWS][8 * WIDE_VECS];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) _mm256_storeu_ps(sums[i] + 8 * j, acc[i][j]);
    const int64_t c0 = 8 * v0;
    const int n = cols - c0 < 8 * nv ? (int)(cols - c0) : 8 * nv;
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < n; c++)
            out[i * ldo + c0 + c] = bf16_store(sums[i][c] + (bias ? bf16_load(bias[c0 + c]) : 0.f));
}

#define TILE_CASE(MR, NV) tile(xf, k_len, MR, panel, pair_u16, v0, NV, bias, out, ldo, cols)
static void any_tile(const float* xf, int64_t k_len, int mr, const uint16_t* panel, int64_t pair_u16, int v0, int nv,
                     const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols) {
    // mr and nv as constants, so that the accumulators live in registers
    if (nv == 6 && mr == 2) TILE_CASE(2, 6);
    else if (nv == 6) TILE_CASE(1, 6);
    else if (nv == 3) {
        switch (mr) {
            case 4: TILE_CASE(4, 3); break;
            case 3: TILE_CASE(3, 3); break;
            case 2: TILE_CASE(2, 3); break;
            default: TILE_CASE(1, 3); break;
        }
    } else {
        for (int i = 0; i < mr; i++) {  // the last vectors of a weight whose rows are not a multiple of 48
            if (nv == 2) tile(xf + i * k_len, k_len, 1, panel, pair_u16, v0, 2, bias, out + i * ldo, ldo, cols);
            else tile(xf + i * k_len, k_len, 1, panel, pair_u16, v0, 1, bias, out + i * ldo, ldo, cols);
        }
    }
}

// csrc/linear.c's linear() for bf16 panels on this CPU; the arguments are that function's.
void linear_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const uint16_t* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS, tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    float* xf = malloc(m_len * k_len * sizeof(float));  // x widened once, read by every panel
    const int parallel = n_len * k_len >= 1 << 16;
    _Pragma("omp parallel if (parallel)") {
        _Pragma("omp for schedule(static)") for (int64_t i = 0; i < m_len; i++)
            for (int64_t k = 0; k < k_len; k++) xf[i * k_len + k] = bf16_load(x[i * ldx + k]);
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < panels; b++) {
            const int64_t n0 = b * PANEL_COLS;
            const int64_t cols = n_len - n0 < PANEL_COLS ? n_len - n0 : PANEL_COLS;
            const int64_t padded = (cols + 15) / 16 * 16;  // the panel's columns as packed
            const uint16_t* panel = packed + n0 * k_len;
            const int vecs = (int)((cols + 7) / 8);
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t m0 = t * TILE_ROWS;
                const int mr = m_len - m0 < TILE_ROWS ? (int)(m_len - m0) : TILE_ROWS;
                const int step = mr <= 2 && vecs == WIDE_VECS ? WIDE_VECS : TILE_VECS;  // one pass over the panel
                for (int v0 = 0; v0 < vecs; v0 += step) {
                    const int nv = vecs - v0 < step ? vecs - v0 : step;
                    any_tile(xf + m0 * k_len, k_len, mr, panel, 2 * padded, v0, nv, bias ? bias + n0 : NULL,
                             out + m0 * ldo + n0, ldo, cols);
                }
            }
        }
    }
    free(xf);
}

int linear_avx2_available(void) { return 1; }
#else
void linear_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const uint16_t* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
}
int linear_avx2_available(void) { return 0; }
#endif
