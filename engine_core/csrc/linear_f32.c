// fp32 linear layers on CPUs with AVX-512 (--dtype float32): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// torch's fp32 matmul (MKL) is fast at prefill sizes but slow at a decode step's few rows (SmolLM2's LM head at 8
// rows: 21.6 ms, 5 GB/s of weights), and it sums a row in another order below 4 rows than above, so the engine
// padded every step to 8 rows to keep a row's result independent of its neighbours. Here the weight is packed once
// at load into csrc/linear.c's panels of up to 48 output columns, laid out k-major in fp32: for each k, the
// panel's columns (three vectors of 16). A tile of up to 8 rows x one panel keeps 24 accumulators in registers;
// each k broadcasts one value of each row against the panel's three vectors. Every output adds its products one
// after the other in k order whatever the number of rows, so a row's result never depends on the rows beside it
// and one row costs no more than reading the weights. With one tile of rows, the next panel is prefetched while
// this one is worked on (as csrc/linear.c).
#include <omp.h>

#include "kernel_common.h"

#if defined(__AVX512F__)
#define PANEL_COLS LINEAR_PANEL_COLS  // see kernel_common.h
#define PANEL_VECS (PANEL_COLS / 16)  // 16-column vectors per panel
#define TILE_ROWS 8

// Row k of a tile: the panel's weights at k times each row's value, into the accumulators.
static inline __attribute__((always_inline)) void tile_k(const float* x, int64_t ldx, int64_t k, int mr,
                                                         const float* panel, int nv, __m512 acc[TILE_ROWS][PANEL_VECS]) {
    __m512 w[PANEL_VECS];
    for (int j = 0; j < nv; j++) w[j] = _mm512_loadu_ps(panel + (k * nv + j) * 16);
    for (int i = 0; i < mr; i++) {
        const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
    }
}

// One tile: mr rows x nv vectors of the panel over all k (mr, nv: constants after inlining); pf_len bytes at pf
// (the next panel, or none) are prefetched on the way, a share per k.
static inline __attribute__((always_inline)) void tile(const float* x, int64_t ldx, int mr, const float* panel, int nv,
                                                       int64_t k_len, const float* bias, float* out, int64_t ldo,
                                                       int64_t cols, const char* pf, int64_t pf_len) {
    __m512 acc[TILE_ROWS][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    if (pf_len > 0) {
        const int64_t step = (pf_len + k_len - 1) / k_len;
        int64_t done = 0;
        for (int64_t k = 0; k < k_len; k++) {
            for (; done < (k + 1) * step && done < pf_len; done += 64) _mm_prefetch(pf + done, _MM_HINT_T0);
            tile_k(x, ldx, k, mr, panel, nv, acc);
        }
    } else
        for (int64_t k = 0; k < k_len; k++) tile_k(x, ldx, k, mr, panel, nv, acc);
    for (int j = 0; j < nv; j++) {
        const int64_t c0 = 16 * j;
        if (c0 >= cols) break;
        const __mmask16 mask = cols - c0 >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c0)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(out + i * ldo + c0, mask, _mm512_add_ps(acc[i][j], b));
    }
}

#define TILE_CASE(MR, NV) tile(x, ldx, MR, panel, NV, k_len, bias, out, ldo, cols, pf, pf_len)
#define TILE_CASES(NV)                   \
    switch (mr) {                        \
        case 8: TILE_CASE(8, NV); break; \
        case 7: TILE_CASE(7, NV); break; \
        case 6: TILE_CASE(6, NV); break; \
        case 5: TILE_CASE(5, NV); break; \
        case 4: TILE_CASE(4, NV); break; \
        case 3: TILE_CASE(3, NV); break; \
        case 2: TILE_CASE(2, NV); break; \
        default: TILE_CASE(1, NV); break; \
    }
// The last panel of a weight whose rows are not a multiple of 48 has one or two vectors (a LoRA adapter's A is
// only that panel).
static void any_tile(const float* x, int64_t ldx, int mr, const float* panel, int nv, int64_t k_len, const float* bias,
                     float* out, int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    if (nv == PANEL_VECS) TILE_CASES(PANEL_VECS) else if (nv == 2) TILE_CASES(2) else TILE_CASES(1)
}

int linear_f32_available(void) { return 1; }

// x: fp32 [m_len, k_len] with row stride ldx; packed: the weight [n_len, k_len] as fp32 panels (see the top; the
// last panel holds the remaining columns rounded up to 16, zero-filled); bias: fp32 [n_len] or NULL; out: fp32
// [m_len, n_len] with row stride ldo. The work split is csrc/linear.c's (kernel_common.h).
void linear_f32(const float* x, int64_t ldx, int64_t m_len, const float* packed, const float* bias, float* out,
                int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel for schedule(static) if (linear_parallel(m_len, n_len, k_len))")
    for (int64_t item = 0; item < panels * row_parts; item++) {
        const PanelItem it = panel_item(packed, item, row_parts, n_len, 4 * k_len);
        for (int64_t t = it.part * tiles / row_parts; t < (it.part + 1) * tiles / row_parts; t++) {
            const int64_t m0 = t * TILE_ROWS;
            const int mr = m_len - m0 < TILE_ROWS ? (int)(m_len - m0) : TILE_ROWS;
            any_tile(x + m0 * ldx, ldx, mr, (const float*)it.panel, it.nv, k_len, bias ? bias + it.n0 : 0,
                     out + m0 * ldo + it.n0, ldo, it.cols, it.next, tiles == 1 ? it.next_bytes : 0);
        }
    }
}
#else
int linear_f32_available(void) { return 0; }
void linear_f32(const float* x, int64_t ldx, int64_t m_len, const float* packed, const float* bias, float* out,
                int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
}
#endif
