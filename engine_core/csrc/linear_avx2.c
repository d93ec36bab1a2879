// bf16 linear layers on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake): the
// panels of csrc/linear.c, read with fp32 FMAs. Weights stay bf16 in memory, half fp32's bytes: a decode step's
// few rows are bound by reading them, and torch's bf16 matmul emulates it at a quarter of fp32's speed here.
//
// A 32-bit lane of a packed panel holds one column's weights for k = 2p (low half) and 2p + 1 (high half), so
// `lane << 16` and `lane & 0xFFFF0000` are the two fp32 weights: no shuffles. x is widened to fp32 once per call.
// - Up to 12 rows take the whole 48-column panel, 1 or 2 rows a pass, 6 (or 12) accumulators: the weights
//   are read from memory once, in order (the LM head at one row: 10 -> 5 ms, torch's fp32 17 ms). SmolLM2's
//   linears at 3 to 12 rows took 16-30% less time this way than in strips (likely because a panel's first strip
//   reads one cache line in three of it from memory); from 16 rows on, the strips' 6-row tiles win.
// - More rows go through the panel in strips of 16 columns, 6 rows at a time: 12 accumulators, and each
//   k's two weight vectors are used by all 6 rows as soon as they are made, so that accumulators, weights and
//   the broadcast row value fit AVX2's 16 registers. A 4 x 24 tile needed 8 broadcasts live at once and spilled
//   them to the stack: 80-85 GFLOP/s at many rows against 120-135 for the strips (MKL's fp32 here: 110-150).
//   x is widened into tiles of 6 rows, k-major (a k's 6 values side by side), so that a tile's broadcasts read
//   one stream; and rows go in blocks whose widened x fits L2, each block through all of a thread's strips, so
//   that a long prompt's x is not streamed from L3 once per strip.
// - int8 and int4 panels are csrc/linear_quant_avx2.c's.
// Every output adds its k products one after the other in k order whatever the number of rows: a row's result
// never depends on its neighbours.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL_COLS LINEAR_PANEL_COLS  // csrc/linear.c's panels: the packing is shared
#define PANEL_VECS (PANEL_COLS / 8)   // 8-column vectors per panel
#define STRIP_ROWS 6
#define WIDE_MAX_ROWS 12  // up to this many rows: wide tiles over the whole panel, else strips
#define UNROLLED _Pragma("GCC unroll 6")  // every row and vector: a partly unrolled loop keeps sums in memory
#define L2_X_BYTES (256 * 1024)          // a block of rows' widened x, kept in L2 while the strips go through it

static inline __attribute__((always_inline)) void store_rows(const float* sums, int stride, int mr, int n,
                                                             const uint16_t* bias, uint16_t* out, int64_t ldo) {
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < n; c++)
            out[i * ldo + c] = bf16_store(sums[i * stride + c] + (bias ? bf16_load(bias[c]) : 0.f));
}

// mr (1 or 2) rows of xf (fp32, row stride k_len) x nv vectors of a panel whose k pairs are pair_u16 bf16 apart;
// writes the first n columns, bf16 (+ bias).
static inline __attribute__((always_inline)) void wide_tile(const float* xf, int64_t k_len, int mr,
                                                            const uint16_t* panel, int64_t pair_u16, int nv,
                                                            const uint16_t* bias, uint16_t* out, int64_t ldo, int n) {
    __m256 acc[2][PANEL_VECS];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < k_len / 2; p++) {
        const uint16_t* w = panel + p * pair_u16;
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
    float sums[2][PANEL_COLS];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) _mm256_storeu_ps(sums[i] + 8 * j, acc[i][j]);
    store_rows(sums[0], PANEL_COLS, mr, n, bias, out, ldo);
}

// mr (up to 6) rows x one strip of 16 columns (two vectors) starting at `strip`; xf: a tile of widened rows,
// k-major with STRIP_ROWS values per k (see widen_rows); the rest as wide_tile.
static inline __attribute__((always_inline)) void strip_tile(const float* xf, int64_t k_len, int mr,
                                                             const uint16_t* strip, int64_t pair_u16,
                                                             const uint16_t* bias, uint16_t* out, int64_t ldo, int n) {
    __m256 acc[STRIP_ROWS][2];
    UNROLLED for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < k_len / 2; p++) {
        const __m256i lanes0 = _mm256_loadu_si256((const __m256i*)(strip + p * pair_u16));
        const __m256i lanes1 = _mm256_loadu_si256((const __m256i*)(strip + p * pair_u16 + 16));
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lanes0, 16));  // k = 2p
        __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(lanes1, 16));
        UNROLLED for (int i = 0; i < mr; i++) {
            const __m256 xi = _mm256_broadcast_ss(xf + 2 * p * STRIP_ROWS + i);
            acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
        }
        w0 = _mm256_castsi256_ps(_mm256_and_si256(lanes0, high));  // k = 2p + 1
        w1 = _mm256_castsi256_ps(_mm256_and_si256(lanes1, high));
        UNROLLED for (int i = 0; i < mr; i++) {
            const __m256 xi = _mm256_broadcast_ss(xf + (2 * p + 1) * STRIP_ROWS + i);
            acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
        }
    }
    float sums[STRIP_ROWS][16];
    UNROLLED for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(sums[i], acc[i][0]);
        _mm256_storeu_ps(sums[i] + 8, acc[i][1]);
    }
    store_rows(sums[0], 16, mr, n, bias, out, ldo);
}

// 3 rows or more: mr reaches strip_tile as a constant, so that its accumulators live in registers. Not inlined:
// inlined into the loops over the panel, the tile's registers spilled (70 against 125 GFLOP/s).
static __attribute__((noinline)) void strip_rows(const float* xf, int64_t k_len, int mr, const uint16_t* strip,
                                                 int64_t pair_u16, const uint16_t* bias, uint16_t* out, int64_t ldo,
                                                 int n) {
#define STRIP(MR) strip_tile(xf, k_len, MR, strip, pair_u16, bias, out, ldo, n)
    SWITCH_ROWS_1_TO_6(mr, STRIP)
#undef STRIP
}

// 1 or 2 rows (row-major in xf): the whole panel in one pass, or, in the last panel of a weight whose rows are not
// a multiple of 48, one vector at a time.
static void wide_rows(const float* xf, int64_t k_len, int mr, const uint16_t* panel, int64_t pair_u16,
                      const uint16_t* bias, uint16_t* out, int64_t ldo, int n) {
    if (n == PANEL_COLS) {
        if (mr == 2) wide_tile(xf, k_len, 2, panel, pair_u16, PANEL_VECS, bias, out, ldo, n);
        else wide_tile(xf, k_len, 1, panel, pair_u16, PANEL_VECS, bias, out, ldo, n);
        return;
    }
    for (int c0 = 0; c0 < n; c0 += 8) {
        const int cols = n - c0 < 8 ? n - c0 : 8;
        const uint16_t* b = bias ? bias + c0 : NULL;
        if (mr == 2) wide_tile(xf, k_len, 2, panel + 2 * c0, pair_u16, 1, b, out + c0, ldo, cols);
        else wide_tile(xf, k_len, 1, panel + 2 * c0, pair_u16, 1, b, out + c0, ldo, cols);
    }
}

// x (bf16) widened to fp32: up to WIDE_MAX_ROWS rows row-major (wide_rows); more in tiles of STRIP_ROWS rows,
// k-major, the last tile's missing rows left unset (strip_tile never reads them). Rows split over the threads.
static void widen_rows(const uint16_t* x, int64_t ldx, int64_t m_len, int64_t k_len, float* xf) {
    const int tiled = m_len > WIDE_MAX_ROWS;
    _Pragma("omp for schedule(static)") for (int64_t i = 0; i < m_len; i++) {
        float* to = tiled ? xf + i / STRIP_ROWS * STRIP_ROWS * k_len + i % STRIP_ROWS : xf + i * k_len;
        const int64_t step = tiled ? STRIP_ROWS : 1;
        for (int64_t k = 0; k < k_len; k++) to[k * step] = bf16_load(x[i * ldx + k]);
    }
}

// csrc/linear.c's linear() on this CPU for bf16 panels; the arguments are that function's.
void linear_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t bytes_per_col = 2 * k_len;  // the packed bytes of one weight row
    const int64_t tiles = (m_len + STRIP_ROWS - 1) / STRIP_ROWS;
    float* xf = malloc(tiles * STRIP_ROWS * k_len * sizeof(float));  // x widened once, read by every panel
    // rows per block: whole tiles of x that fit L2
    const int64_t fit = L2_X_BYTES / (k_len * (int64_t)sizeof(float)) / STRIP_ROWS * STRIP_ROWS;
    const int64_t block = m_len <= WIDE_MAX_ROWS || fit == 0 ? m_len : fit;
    // As csrc/linear.c: each block's strips are cut into shares (linear_row_parts, kernel_common.h); few rows go whole.
    const int64_t row_parts = m_len <= WIDE_MAX_ROWS ? 1 : linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        widen_rows(x, ldx, m_len, k_len, xf);
        for (int64_t m_start = 0; m_start < m_len; m_start += block) {
            const int64_t m_end = m_len - m_start < block ? m_len : m_start + block;
            const int64_t strips = (m_end - m_start + STRIP_ROWS - 1) / STRIP_ROWS;
            // each thread keeps its panels from block to block: no wait between blocks
            _Pragma("omp for schedule(static) nowait") for (int64_t item = 0; item < panels * row_parts; item++) {
                const int64_t part = item % row_parts, n0 = item / row_parts * PANEL_COLS;
                const int64_t s0 = m_start + part * strips / row_parts * STRIP_ROWS;
                const int64_t s1 = m_start + (part + 1) * strips / row_parts * STRIP_ROWS;
                const int cols = n_len - n0 < PANEL_COLS ? (int)(n_len - n0) : PANEL_COLS;
                const int64_t pair_u16 = 2 * ((cols + 15) / 16 * 16);  // the panel's columns as packed, x 2
                const uint16_t* panel = (const uint16_t*)((const char*)packed + n0 * bytes_per_col);
                const uint16_t* b = bias ? bias + n0 : NULL;
                if (m_len <= WIDE_MAX_ROWS) {
                    for (int64_t i = 0; i < m_len; i += 2)
                        wide_rows(xf + i * k_len, k_len, m_len - i < 2 ? 1 : 2, panel, pair_u16, b, out + i * ldo + n0,
                                  ldo, cols);
                    continue;
                }
                for (int c0 = 0; c0 < cols; c0 += 16)
                    for (int64_t m0 = s0; m0 < s1 && m0 < m_end; m0 += STRIP_ROWS)
                        strip_rows(xf + m0 * k_len, k_len, m_end - m0 < STRIP_ROWS ? (int)(m_end - m0) : STRIP_ROWS,
                                   panel + 2 * c0, pair_u16, b ? b + c0 : NULL, out + m0 * ldo + n0 + c0, ldo,
                                   cols - c0 < 16 ? cols - c0 : 16);
            }
        }
    }
    free(xf);
}

int linear_avx2_available(void) { return 1; }
#else
void linear_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
}
int linear_avx2_available(void) { return 0; }
#endif
