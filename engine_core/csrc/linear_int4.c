// Weight-only int4 linears (--quantization int4): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bf16 in and out,
// where each group of 32 weights of a row is w = scale * q + min with q in 0..15 (asymmetric, as GGUF's Q4_1). Where
// the CPU has AMX, csrc/linear_amx.c runs these panels on its tiles instead, in the same steps.
//
// Packed as csrc/linear.c's panels (up to 48 output columns, vectors of 16, vdpbf16ps's pair layout); per panel and
// group of 32 k, for each four k pairs and vector 32 16-bit lanes, lane l holding lane l of the four pairs' layouts
// in its four nibbles (the first pair's lowest), then the vectors' 16 fp32 scales, then their 16 fp32 mins: 0.75
// bytes a weight against bf16's 2 and int8's 1.25, which is what a decode step of few rows waits for.
//
// One vpermw on a 16-entry table turns 32 nibbles into the bf16 of q, exactly, after a shift (it reads only an
// index's low 5 bits, and the table repeats; a byte per pair, widened to 16 bits first, ran 4-6% slower), so a
// group's products sum to sum x q in fp32; the output then takes scale * that + min * sum x (the row's sum over the
// group, made once per call). Every output sums its groups in the same order whatever the number of rows, so a
// row's result never depends on its neighbours. Tiles of 4 rows (the partial sums take registers; 8-row tiles
// with the outputs in L1 gained nothing) read the nibbles as they go, and the first tile of a panel prefetches the
// next. Widening each panel once for a call of many rows, as the int8 kernel does, gained nothing either
// (SmolLM2's linears at 8 and 64 rows: 12.8 and 53.4 ms widened, 8.5 and 50.9 not).
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#define Q4_PANEL_COLS LINEAR_PANEL_COLS
#define Q4_PANEL_VECS (Q4_PANEL_COLS / 16)
#define Q4_TILE_ROWS 4                      // accumulators and a group's partial sums: 2 x 4 x 3 registers
#define Q4_GROUP QUANT_GROUP              // weights per scale and min
#define Q4_GROUP_PAIRS (Q4_GROUP / 2)

#if defined(__AVX512BF16__)
// One tile: mr rows x nv vectors of a panel over all groups (mr, nv: constants after inlining); xsum: the rows'
// sums of x per group (row stride `groups`); pf_len bytes at pf (the next panel, or none) prefetched on the way.
static inline __attribute__((always_inline)) void q4_tile(const uint16_t* x, int64_t ldx, int mr,
                                                          const uint8_t* panel, int nv, int64_t groups,
                                                          const float* xsum, const uint16_t* bias, uint16_t* out,
                                                          int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    const __m512i table = nibble_table();
    __m512 acc[Q4_TILE_ROWS][Q4_PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pf_step = (pf_len + groups - 1) / groups;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = g * pf_step; b < (g + 1) * pf_step && b < pf_len; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        const uint8_t* group = quant_group(panel, 2, nv, g);
        __m512 part[Q4_TILE_ROWS][Q4_PANEL_VECS];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nv; j++) part[i][j] = _mm512_setzero_ps();
        // Four pairs a load: a 16-bit lane holds their nibbles, and vpermw reads only an index's low 5 bits (the
        // table repeats), so a constant shift is all the unpacking a pair needs.
        for (int t = 0; t < Q4_GROUP_PAIRS / 4; t++) {
            __m512i four[Q4_PANEL_VECS];
            for (int j = 0; j < nv; j++) four[j] = _mm512_loadu_si512(group + (t * nv + j) * 64);
            _Pragma("GCC unroll 4") for (int sub = 0; sub < 4; sub++) {
                const int64_t p = g * Q4_GROUP_PAIRS + 4 * t + sub;
                __m512bh w[Q4_PANEL_VECS];
                for (int j = 0; j < nv; j++)
                    w[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(four[j], 4 * sub), table);
                for (int i = 0; i < mr; i++) {
                    int32_t pair;  // x[i, 2p] and x[i, 2p + 1]; memcpy: rows need not be 4-byte aligned
                    memcpy(&pair, x + i * ldx + 2 * p, 4);
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                    for (int j = 0; j < nv; j++) part[i][j] = _mm512_dpbf16_ps(part[i][j], xb, w[j]);
                }
            }
        }
        const float* scales = quant_scales(group, 2, nv);
        for (int j = 0; j < nv; j++) {
            const __m512 scale = _mm512_loadu_ps(scales + 16 * j), min = _mm512_loadu_ps(scales + 16 * (nv + j));
            for (int i = 0; i < mr; i++) {
                acc[i][j] = _mm512_fmadd_ps(part[i][j], scale, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), min, acc[i][j]);
            }
        }
    }
    store_linear_tile(acc, mr, nv, cols, bias, out, ldo);
}

#define Q4_CASE(MR, NV) q4_tile(x, ldx, MR, panel, NV, groups, xsum, bias, out, ldo, cols, pf, pf_len)
#define Q4_CASES(NV)                   \
    switch (mr) {                      \
        case 4: Q4_CASE(4, NV); break; \
        case 3: Q4_CASE(3, NV); break; \
        case 2: Q4_CASE(2, NV); break; \
        default: Q4_CASE(1, NV); break; \
    }
static void q4_any_tile(const uint16_t* x, int64_t ldx, int mr, const uint8_t* panel, int nv,
                        int64_t groups, const float* xsum, const uint16_t* bias, uint16_t* out, int64_t ldo,
                        int64_t cols, const char* pf, int64_t pf_len) {
    if (nv == Q4_PANEL_VECS) Q4_CASES(Q4_PANEL_VECS) else if (nv == 2) Q4_CASES(2) else Q4_CASES(1)
}

// Each row's sum of x over each group of 32 k, fp32, in one order: xsum[row * groups + g].
void linear_int4_group_sums(const uint16_t* x, int64_t ldx, int64_t m_len, int64_t groups, float* xsum) {
    _Pragma("omp parallel for schedule(static) if (m_len * groups >= 4096)") for (int64_t i = 0; i < m_len; i++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t* row = x + i * ldx + g * Q4_GROUP;
            xsum[i * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(vload_bf16(row), vload_bf16(row + 16)));
        }
}

int linear_int4_available(void) { return 1; }

// x: bf16 [m_len, k_len] with row stride ldx; packed: the weight [n_len, k_len] as described at the top (k_len a
// multiple of 32; the last panel's columns rounded up to 16, zero-filled); bias: bf16 [n_len] or NULL; out: bf16
// [m_len, n_len] with row stride ldo.
void linear_int4(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + Q4_PANEL_COLS - 1) / Q4_PANEL_COLS, groups = k_len / Q4_GROUP;
    const int64_t tiles = (m_len + Q4_TILE_ROWS - 1) / Q4_TILE_ROWS;
    const int64_t bytes_per_col = linear_bytes_per_col(2, k_len);
    float* xsum = malloc(m_len * groups * sizeof(float));
    linear_int4_group_sums(x, ldx, m_len, groups, xsum);
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel for schedule(static) if (linear_parallel(m_len, n_len, k_len))")
    for (int64_t item = 0; item < panels * row_parts; item++) {
        const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
        const int64_t first = it.part * tiles / row_parts;
        for (int64_t t = first; t < (it.part + 1) * tiles / row_parts; t++) {
            const int64_t m0 = t * Q4_TILE_ROWS;
            const int mr = m_len - m0 < Q4_TILE_ROWS ? (int)(m_len - m0) : Q4_TILE_ROWS;
            q4_any_tile(x + m0 * ldx, ldx, mr, (const uint8_t*)it.panel, it.nv, groups, xsum + m0 * groups,
                        bias ? bias + it.n0 : 0, out + m0 * ldo + it.n0, ldo, it.cols, it.next,
                        t == first ? it.next_bytes : 0);
        }
    }
    free(xsum);
}
#else
// Without AVX512-BF16, linear() takes csrc/linear_quant_avx2.c's kernel (where the CPU has AVX2, FMA and F16C).
int linear_int4_available(void) { return linear_quant_avx2_available(); }
#endif
