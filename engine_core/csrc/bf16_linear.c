// bf16 linear for decode rows on CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 sums.
// A decode step's few rows are bound by reading the weights; oneDNN computes, then reads, and at 16 rows streamed
// them at about half the memory's speed. Here the weight is packed once at load into panels of up to 48 columns,
// in vdpbf16ps's pair layout: for each pair of k, 48 columns x 2 bf16 (three vectors). A tile of up to 8 input
// rows x one panel keeps 24 fp32 accumulators in registers; each k pair broadcasts two bf16 of a row against the
// three weight vectors. Every output sums its k pairs in the same order whatever the number of rows, so a row's
// result never depends on its neighbours. The next panel is prefetched while this one is worked on.
#include "kernel_common.h"

#define PANEL_VECS 3  // 16-column vectors per panel
#define PANEL_COLS (16 * PANEL_VECS)
#define TILE_ROWS 8

#if defined(__AVX512BF16__)
// One tile: MR rows (a constant after inlining) x NV vectors of the panel, over all k pairs.
static inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t ldx, int mr, const uint16_t* panel,
                                                       int nv, int64_t pairs, const uint16_t* bias, uint16_t* out,
                                                       int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    __m512 acc[TILE_ROWS][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    const int32_t* xp[TILE_ROWS];
    for (int i = 0; i < mr; i++) xp[i] = (const int32_t*)(x + i * ldx);
    const int64_t stride = 32 * nv;  // uint16 per k pair of this panel
    int64_t pf_off = 0;
    const int64_t pf_step = (pf_len + pairs - 1) / pairs;  // bytes of the next panel to prefetch per k pair
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t* wp = panel + p * stride;
        __m512bh w[PANEL_VECS];
        for (int j = 0; j < nv; j++) w[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
        for (; pf_off < (p + 1) * pf_step && pf_off < pf_len; pf_off += 64) _mm_prefetch(pf + pf_off, _MM_HINT_T0);
        for (int i = 0; i < mr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[i][p]);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
        }
    }
    for (int j = 0; j < nv; j++) {
        const int64_t c0 = 16 * j;
        if (c0 >= cols) break;
        const __mmask16 mask = cols - c0 >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c0)) - 1);
        const __m512 b = bias ? vload_bf16_masked(bias + c0, mask) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(out + i * ldo + c0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
    }
}

#define TILE_CASE(MR, NV) tile(x, ldx, MR, panel, NV, pairs, bias, out, ldo, cols, pf, pf_len)
static void any_tile(const uint16_t* x, int64_t ldx, int mr, const uint16_t* panel, int nv, int64_t pairs,
                     const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    if (nv == PANEL_VECS) {
        switch (mr) {
            case 8: TILE_CASE(8, 3); break;
            case 7: TILE_CASE(7, 3); break;
            case 6: TILE_CASE(6, 3); break;
            case 5: TILE_CASE(5, 3); break;
            case 4: TILE_CASE(4, 3); break;
            case 3: TILE_CASE(3, 3); break;
            case 2: TILE_CASE(2, 3); break;
            default: TILE_CASE(1, 3); break;
        }
    } else {  // the last panel of a weight whose rows are not a multiple of 48: rare, one row at a time
        for (int i = 0; i < mr; i++) {
            if (nv == 2) tile(x + i * ldx, ldx, 1, panel, 2, pairs, bias, out + i * ldo, ldo, cols, pf, pf_len);
            else tile(x + i * ldx, ldx, 1, panel, 1, pairs, bias, out + i * ldo, ldo, cols, pf, pf_len);
        }
    }
}

int bf16_linear_available(void) { return 1; }
#else
int bf16_linear_available(void) { return 0; }
#endif

int bf16_linear_panel_cols(void) { return PANEL_COLS; }

// x: bf16 [m_len, k_len] with row stride ldx; packed: the weight [n_len, k_len] as panels (see the top; the last
// panel holds the remaining columns rounded up to 16, zero-filled); bias: bf16 [n_len] or NULL; out: bf16
// [m_len, n_len] with row stride ldo. k_len must be even.
void bf16_linear(const uint16_t* x, int64_t ldx, int64_t m_len, const uint16_t* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
#if defined(__AVX512BF16__)
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS, pairs = k_len / 2;
    const int64_t padded_n = (n_len + 15) / 16 * 16;
    if (m_len <= 0) return;
    const int64_t tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    _Pragma("omp parallel for schedule(static) if (n_len * k_len >= 1 << 16)")
    for (int64_t b = 0; b < panels; b++) {
        const int64_t n0 = b * PANEL_COLS;
        const int64_t cols = n_len - n0 < PANEL_COLS ? n_len - n0 : PANEL_COLS;
        const int nv = (int)((cols + 15) / 16);
        const uint16_t* panel = packed + n0 * k_len;
        // The next panel goes to L1 in shares spread over this panel's row tiles. SmolLM2's 30 layers and head
        // at 1-8 rows: 6.7 ms with this, 7.5 with the hardware prefetcher alone, 8 prefetching into L2 instead.
        const int64_t next_n0 = n0 + PANEL_COLS;
        const int64_t next_cols = padded_n - next_n0 < PANEL_COLS ? padded_n - next_n0 : PANEL_COLS;
        const char* next = (const char*)(packed + next_n0 * k_len);
        const int64_t next_bytes = next_cols > 0 ? next_cols * k_len * 2 : 0;
        const int64_t share = (next_bytes / tiles + 63) / 64 * 64;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * TILE_ROWS;
            const int mr = m_len - m0 < TILE_ROWS ? (int)(m_len - m0) : TILE_ROWS;
            const int64_t pf_start = t * share < next_bytes ? t * share : next_bytes;
            const int64_t pf_len = next_bytes - pf_start < share ? next_bytes - pf_start : share;
            any_tile(x + m0 * ldx, ldx, mr, panel, nv, pairs, bias ? bias + n0 : 0, out + m0 * ldo + n0, ldo, cols,
                     next + pf_start, pf_len);
        }
    }
#else
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
#endif
}
