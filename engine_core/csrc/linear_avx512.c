// bf16 linear layers on CPUs with AVX-512F but no AVX512-BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): the
// panels of csrc/linear.c read with fp32 FMAs as csrc/linear_avx2.c reads them, 16 columns a vector instead of 8.
// A 32-bit lane of a packed panel holds one column's weights for k = 2p (low half) and 2p + 1 (high half), so
// `lane << 16` and `lane & 0xFFFF0000` are its two fp32 weights: no shuffles.
// - One tile: up to 8 rows x the whole panel (three vectors of 16 columns), 24 of AVX-512's 32 registers as
//   accumulators; each k's three weight vectors are used by all the rows as soon as they are made, so a panel is
//   read from memory once for every 8 rows (a decode step's few rows read it once). AVX2 has room for 6 x 16.
// - A panel's first tile asks for its weights 8 KB ahead of its reads (into the thread's next panel at its end):
//   the hardware prefetcher alone left a decode step's few rows at about half of what a sum reads from memory here.
//   SmolLM2's 120 linears (210 MB, from memory) on a 2-core Skylake Xeon: 1 row 28.1-30.4 -> 23.3-27.0 ms, 4 rows
//   32.8 -> 25.7.
// - x is widened to fp32 once per call, in tiles of 8 rows, k-major (a k's 8 values side by side), so that a
//   tile's broadcasts read one stream; rows go in blocks whose widened x fits half of L2, each block through all of a
//   thread's panels, so that a long prompt's x is not streamed from L3 once per panel.
// Every output adds its k products one after the other in k order with the same FMAs as csrc/linear_avx2.c: the
// same bits as there, whatever the number of rows.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX512F__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL_COLS LINEAR_PANEL_COLS  // csrc/linear.c's panels: the packing is shared
#define PANEL_VECS (PANEL_COLS / 16)  // 16-column vectors per panel
#define TILE_ROWS 8
#define L2_X_BYTES (512 * 1024)  // a block of rows' widened x, kept in L2 while the panels go through it
#define PREFETCH_AHEAD 8192      // bytes of weights a panel's first tile asks for ahead of its reads

// mr rows of a tile of widened x (k-major, TILE_ROWS values per k) x nv vectors of a panel whose k pairs are
// pair_u16 bf16 apart; writes the first n columns, bf16 (+ bias).
static inline __attribute__((always_inline)) void tile(const float* xf, int64_t k_len, int mr, const uint16_t* panel,
                                                       int64_t pair_u16, int nv, const uint16_t* bias, uint16_t* out,
                                                       int64_t ldo, int n, int prefetch) {
    __m512 acc[TILE_ROWS][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < k_len / 2; p++) {
        const uint16_t* w = panel + p * pair_u16;
        const float* x = xf + 2 * p * TILE_ROWS;
        if (prefetch)
            for (int j = 0; j < nv; j++) _mm_prefetch((const char*)(w + 32 * j) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512i lanes[PANEL_VECS];
        __m512 wk[PANEL_VECS];
        for (int j = 0; j < nv; j++) {
            lanes[j] = _mm512_loadu_si512(w + 32 * j);
            wk[j] = _mm512_castsi512_ps(_mm512_slli_epi32(lanes[j], 16));  // k = 2p
        }
        for (int i = 0; i < mr; i++) {
            const __m512 xi = _mm512_set1_ps(x[i]);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm512_fmadd_ps(xi, wk[j], acc[i][j]);
        }
        for (int j = 0; j < nv; j++) wk[j] = _mm512_castsi512_ps(_mm512_and_si512(lanes[j], high));  // k = 2p + 1
        for (int i = 0; i < mr; i++) {
            const __m512 xi = _mm512_set1_ps(x[TILE_ROWS + i]);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm512_fmadd_ps(xi, wk[j], acc[i][j]);
        }
    }
    float sums[PANEL_COLS];
    for (int i = 0; i < mr; i++) {
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(sums + 16 * j, acc[i][j]);
        for (int c = 0; c < n; c++) out[i * ldo + c] = bf16_store(sums[c] + (bias ? bf16_load(bias[c]) : 0.f));
    }
}

// One tile of mr (1 to 8) rows: mr and nv reach tile() as constants, so that its loops unroll into registers.
// Not inlined into the loops over panels, whose own registers would make the tile's spill.
static __attribute__((noinline)) void tile_rows(const float* xf, int64_t k_len, int mr, const uint16_t* panel,
                                                int64_t pair_u16, int nv, const uint16_t* bias, uint16_t* out,
                                                int64_t ldo, int n, int prefetch) {
#define TILE(MR, NV) tile(xf, k_len, MR, panel, pair_u16, NV, bias, out, ldo, n, prefetch)
#define ROWS(MR)                          \
    case MR:                              \
        if (nv == 3) TILE(MR, 3);         \
        else if (nv == 2) TILE(MR, 2);    \
        else TILE(MR, 1);                 \
        break;
    switch (mr) {
        ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
    }
#undef ROWS
#undef TILE
}

// x (bf16) widened to fp32 in tiles of TILE_ROWS rows, k-major; the last tile's missing rows are left unset (tile()
// never reads them). Rows split over the threads.
static void widen_rows(const uint16_t* x, int64_t ldx, int64_t m_len, int64_t k_len, float* xf) {
    _Pragma("omp for schedule(static)") for (int64_t i = 0; i < m_len; i++) {
        float* to = xf + i / TILE_ROWS * TILE_ROWS * k_len + i % TILE_ROWS;
        for (int64_t k = 0; k < k_len; k++) to[k * TILE_ROWS] = bf16_load(x[i * ldx + k]);
    }
}

// csrc/linear.c's linear() on this CPU for bf16 panels; the arguments are that function's.
void linear_avx512(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                   uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t bytes_per_col = 2 * k_len;  // the packed bytes of one weight row
    const int64_t tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    float* xf = malloc(tiles * TILE_ROWS * k_len * sizeof(float));  // x widened once, read by every panel
    // rows per block: whole tiles of x that fit the L2 share
    const int64_t fit = L2_X_BYTES / (k_len * (int64_t)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    const int64_t block = fit == 0 ? m_len : fit;
    // As csrc/linear.c: each block's tiles are cut into shares (linear_row_parts, kernel_common.h).
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        widen_rows(x, ldx, m_len, k_len, xf);
        for (int64_t m_start = 0; m_start < m_len; m_start += block) {
            const int64_t m_end = m_len - m_start < block ? m_len : m_start + block;
            const int64_t block_tiles = (m_end - m_start + TILE_ROWS - 1) / TILE_ROWS;
            // each thread keeps its panels from block to block: no wait between blocks
            _Pragma("omp for schedule(static) nowait") for (int64_t item = 0; item < panels * row_parts; item++) {
                const int64_t part = item % row_parts, n0 = item / row_parts * PANEL_COLS;
                const int64_t t0 = m_start + part * block_tiles / row_parts * TILE_ROWS;
                const int64_t t1 = m_start + (part + 1) * block_tiles / row_parts * TILE_ROWS;
                const int cols = n_len - n0 < PANEL_COLS ? (int)(n_len - n0) : PANEL_COLS;
                const int nv = (cols + 15) / 16;
                const int64_t pair_u16 = 32 * nv;  // the panel's columns as packed, x 2
                const uint16_t* panel = (const uint16_t*)((const char*)packed + n0 * bytes_per_col);
                for (int64_t m0 = t0; m0 < t1 && m0 < m_end; m0 += TILE_ROWS)
                    tile_rows(xf + m0 * k_len, k_len, m_end - m0 < TILE_ROWS ? (int)(m_end - m0) : TILE_ROWS, panel,
                              pair_u16, nv, bias ? bias + n0 : NULL, out + m0 * ldo + n0, ldo, cols, m0 == t0);
            }
        }
    }
    free(xf);
}

int linear_avx512_available(void) { return 1; }
#else
void linear_avx512(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                   uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
}
int linear_avx512_available(void) { return 0; }
#endif
