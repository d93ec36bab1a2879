// fp32 linear layers on CPU (--dtype float32): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), with AVX-512, or
// with AVX2 + FMA.
//
// torch's fp32 matmul (MKL) is fast at prefill sizes but slow at a decode step's few rows (SmolLM2's LM head at 8
// rows: 21.6 ms, 5 GB/s of weights), and it sums a row in another order below 4 rows than above, so the engine
// padded every step to 8 rows to keep a row's result independent of its neighbours. Here the weight is packed once
// at load into csrc/linear.c's panels of up to 48 output columns, laid out k-major in fp32: for each k, the
// panel's columns. Every output adds its products one after the other in k order, from zero, with FMAs, then adds
// the bias, whatever the number of rows and whichever of the tiles below computes it: a row's result never depends
// on the rows beside it (nor on the ISA: an FMA rounds the same everywhere), and one row costs no more than
// reading the weights.
// - AVX-512: a tile of up to 8 rows x one panel keeps 24 accumulators in registers; each k broadcasts one value of
//   each row against the panel's three vectors. With one tile of rows, the next panel is prefetched while this one
//   is worked on (as csrc/linear.c).
// - AVX2 (16 registers), as csrc/linear_avx2.c: up to 12 rows take whole panels, 1 or 2 rows a pass (12
//   accumulators, each k's weight vectors used as they are loaded); more rows go through the panel in strips of 16
//   columns, 6 rows at a time (12 accumulators, each k's row values broadcast as they are used). Strips at 2 rows
//   took 34-37 ms for SmolLM2's linears and head against 19-21 for whole panels.
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
        const __mmask16 mask = first_lanes(cols - c0);
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

#define PANEL_TILE(x, ldx, mr, m_len, it, k_len, bias, out, ldo, pf, pf_len) \
    any_tile(x, ldx, mr, (const float*)(it).panel, (it).nv, k_len, bias, out, ldo, (it).cols, pf, pf_len)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PANEL_COLS LINEAR_PANEL_COLS
#define TILE_ROWS 6
#define UNROLLED _Pragma("GCC unroll 6")  // every row and vector: a partly unrolled loop keeps sums in memory

// mr rows x nv vectors of 8 columns of a panel whose k rows are ldw floats apart; writes the first `cols` columns
// (+ bias). mr x nv <= 12, and the rest of the 16 registers hold, for 1 or 2 rows, the rows' broadcast values and
// one weight vector at a time, for more rows the k's weight vectors and one broadcast at a time.
static inline __attribute__((always_inline)) void tile8(const float* x, int64_t ldx, int mr, const float* w,
                                                        int64_t ldw, int nv, int64_t k_len, const float* bias,
                                                        float* out, int64_t ldo, int cols) {
    __m256 acc[TILE_ROWS][PANEL_COLS / 8];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_len; k++) {
        if (mr <= 2) {
            __m256 xk[2];
            UNROLLED for (int i = 0; i < mr; i++) xk[i] = _mm256_broadcast_ss(x + i * ldx + k);
            UNROLLED for (int j = 0; j < nv; j++) {
                const __m256 wj = _mm256_loadu_ps(w + k * ldw + 8 * j);
                UNROLLED for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(xk[i], wj, acc[i][j]);
            }
            continue;
        }
        __m256 wk[PANEL_COLS / 8];
        UNROLLED for (int j = 0; j < nv; j++) wk[j] = _mm256_loadu_ps(w + k * ldw + 8 * j);
        UNROLLED for (int i = 0; i < mr; i++) {
            const __m256 xi = _mm256_broadcast_ss(x + i * ldx + k);
            UNROLLED for (int j = 0; j < nv; j++) acc[i][j] = _mm256_fmadd_ps(xi, wk[j], acc[i][j]);
        }
    }
    float sums[TILE_ROWS][PANEL_COLS];
    UNROLLED for (int i = 0; i < mr; i++)
        UNROLLED for (int j = 0; j < nv; j++) _mm256_storeu_ps(sums[i] + 8 * j, acc[i][j]);
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < cols; c++) out[i * ldo + c] = sums[i][c] + (bias ? bias[c] : 0.f);
}

// Not inlined, so that each case's accumulators stay in registers (csrc/linear_avx2.c measured the spill).
static __attribute__((noinline)) void strip_rows(const float* x, int64_t ldx, int mr, const float* w, int64_t ldw,
                                                 int64_t k_len, const float* bias, float* out, int64_t ldo, int cols) {
#define STRIP(MR) tile8(x, ldx, MR, w, ldw, 2, k_len, bias, out, ldo, cols)
    SWITCH_ROWS_1_TO_6(mr, STRIP)
#undef STRIP
}

// 1 or 2 rows over a whole panel of nv vectors of 8 columns (6, or 4 or 2 in a weight's last panel).
static __attribute__((noinline)) void wide_rows(const float* x, int64_t ldx, int mr, const float* panel, int nv,
                                                int64_t k_len, const float* bias, float* out, int64_t ldo, int cols) {
#define WIDE(NV)                                                                      \
    if (mr == 2) tile8(x, ldx, 2, panel, 8 * NV, NV, k_len, bias, out, ldo, cols); \
    else tile8(x, ldx, 1, panel, 8 * NV, NV, k_len, bias, out, ldo, cols)
    if (nv == 6) WIDE(6); else if (nv == 4) WIDE(4); else WIDE(2);
#undef WIDE
}

// mr rows x one panel of nv16 vectors of 16 columns (the first `cols` of them real): whole panels for a call of few
// rows (wide), else strips.
static void panel_tile(const float* x, int64_t ldx, int mr, const float* panel, int nv16, int64_t k_len,
                       const float* bias, float* out, int64_t ldo, int64_t cols, int wide) {
    if (wide) {
        for (int i = 0; i < mr; i += 2)
            wide_rows(x + i * ldx, ldx, mr - i < 2 ? 1 : 2, panel, 2 * nv16, k_len, bias, out + i * ldo, ldo, (int)cols);
        return;
    }
    for (int c0 = 0; c0 < cols; c0 += 16)
        strip_rows(x, ldx, mr, panel + c0, 16 * nv16, k_len, bias ? bias + c0 : NULL, out + c0, ldo,
                   cols - c0 < 16 ? (int)(cols - c0) : 16);
}
#define WIDE_MAX_ROWS 12  // up to this many rows in a call: whole panels
#define PANEL_TILE(x, ldx, mr, m_len, it, k_len, bias, out, ldo, pf, pf_len) \
    panel_tile(x, ldx, mr, (const float*)(it).panel, (it).nv, k_len, bias, out, ldo, (it).cols, m_len <= WIDE_MAX_ROWS)
#endif

#if defined(PANEL_TILE)
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
            PANEL_TILE(x + m0 * ldx, ldx, mr, m_len, it, k_len, bias ? bias + it.n0 : 0, out + m0 * ldo + it.n0, ldo,
                       it.next, tiles == 1 ? it.next_bytes : 0);
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
