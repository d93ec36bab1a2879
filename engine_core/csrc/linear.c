// Linear layers on CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bf16 in and out, fp32 sums; the weight
// in bf16, or weight-only int8 with one fp32 scale per 32 weights of a row (--quantization int8; int4 is
// csrc/linear_int4.c's; with AMX, csrc/linear_amx.c runs all three; without AVX512-BF16, csrc/linear_avx2.c and
// csrc/linear_quant_avx2.c).
//
// A decode step's few rows are bound by reading the weights. The weight is packed once at load into panels of up
// to 48 output columns, in vdpbf16ps's pair layout: for each pair of k, the panel's columns x 2 values (three
// vectors of 16 columns). A tile of up to 8 input rows x one panel keeps 24 fp32 accumulators in registers; each
// k pair broadcasts two bf16 of a row against the three weight vectors. Every output sums its k pairs in the same
// order whatever the number of rows, so a row's result never depends on its neighbours. With one tile of rows,
// the next panel is prefetched while this one is worked on. An int8 panel holds, per group of 32 k, the int8
// weights in the same pair layout and then each lane's scale; a tile widens them to bf16(q * scale) as it goes,
// or, for more rows than one tile, the panel is widened once into a bf16 panel first. Without AVX512-BF16,
// csrc/linear_avx2.c (bf16) and csrc/linear_quant_avx2.c (int8, int4) read the same panels with fp32 FMAs (AVX2).
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#define PANEL_COLS LINEAR_PANEL_COLS  // see kernel_common.h
#define PANEL_VECS (PANEL_COLS / 16)  // 16-column vectors per panel
#define TILE_ROWS 8
#define GROUP_PAIRS (QUANT_GROUP / 2)  // int8: k pairs per scale

#if defined(__AVX512BF16__)
// Vector j of k pair p of a panel with nv vectors: bf16 as stored, or widened from int8 (q8, a constant).
static inline __attribute__((always_inline)) __m512bh weights(const void* panel, int q8, int nv, int64_t p, int j) {
    if (!q8) return (__m512bh)_mm512_loadu_si512((const uint16_t*)panel + (p * nv + j) * 32);
    const uint8_t* group = quant_group(panel, 1, nv, p / GROUP_PAIRS);
    return int8_pairs((const int8_t*)group + ((p % GROUP_PAIRS) * nv + j) * 32, quant_scales(group, 1, nv) + j * 32);
}

// The next panel's prefetch spread over a loop of k pairs, `step` bytes of the pf_len at pf per pair: at pair p,
// the lines up to p + 1 steps (*done: bytes sent so far). Always inlined, as kernel_common.h's prefetch helpers.
static inline __attribute__((always_inline)) void prefetch_share(const char* pf, int64_t pf_len, int64_t step,
                                                                 int64_t p, int64_t* done) {
    for (; *done < (p + 1) * step && *done < pf_len; *done += 64) _mm_prefetch(pf + *done, _MM_HINT_T0);
}

// k pair p of a tile: its weights times each row's pair, into the accumulators.
static inline __attribute__((always_inline)) void tile_pair(const uint16_t* const* xp, int64_t p, int mr,
                                                            const void* panel, int q8, int nv,
                                                            __m512 acc[TILE_ROWS][PANEL_VECS]) {
    __m512bh w[PANEL_VECS];
    for (int j = 0; j < nv; j++) w[j] = weights(panel, q8, nv, p, j);
    for (int i = 0; i < mr; i++) {
        int32_t pair;  // x[i, 2p] and x[i, 2p + 1]; memcpy: rows need not be 4-byte aligned
        memcpy(&pair, xp[i] + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
    }
}

// One tile: mr rows x nv vectors of the panel over all k pairs (mr, nv, q8: constants after inlining); pf_len
// bytes at pf (the next panel, or none) are prefetched on the way.
static inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t ldx, int mr, const void* panel,
                                                       int q8, int nv, int64_t pairs, const uint16_t* bias,
                                                       uint16_t* out, int64_t ldo, int64_t cols, const char* pf,
                                                       int64_t pf_len) {
    __m512 acc[TILE_ROWS][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t* xp[TILE_ROWS];
    for (int i = 0; i < mr; i++) xp[i] = x + i * ldx;
    // pf_len > 0 (a call of one tile) spreads the prefetches over the k pairs. A call of more tiles reads each
    // panel from L2 after its first tile, and checking for prefetches at every pair cost it 5-10% of its speed (a
    // 2048-row prefill 383-391 -> 410-421 GFLOP/s without), so its loop has none.
    if (pf_len > 0) {
        const int64_t step = (pf_len + pairs - 1) / pairs;
        int64_t done = 0;
        for (int64_t p = 0; p < pairs; p++) {
            prefetch_share(pf, pf_len, step, p, &done);
            tile_pair(xp, p, mr, panel, q8, nv, acc);
        }
    } else
        for (int64_t p = 0; p < pairs; p++) tile_pair(xp, p, mr, panel, q8, nv, acc);
    store_linear_tile(acc, mr, nv, cols, bias, out, ldo);
}

#define TILE_CASE(MR, Q8, NV) tile(x, ldx, MR, panel, Q8, NV, pairs, bias, out, ldo, cols, pf, pf_len)
#define TILE_CASES(Q8, NV)                   \
    switch (mr) {                            \
        case 8: TILE_CASE(8, Q8, NV); break; \
        case 7: TILE_CASE(7, Q8, NV); break; \
        case 6: TILE_CASE(6, Q8, NV); break; \
        case 5: TILE_CASE(5, Q8, NV); break; \
        case 4: TILE_CASE(4, Q8, NV); break; \
        case 3: TILE_CASE(3, Q8, NV); break; \
        case 2: TILE_CASE(2, Q8, NV); break; \
        default: TILE_CASE(1, Q8, NV); break; \
    }
// The last panel of a weight whose rows are not a multiple of 48 has one or two vectors: a LoRA adapter's A (8 to
// 48 columns) is only that panel, so it gets whole tiles of rows too (one row at a time, its lone accumulator chain
// ran at a fifth of the speed).
static void any_tile(const uint16_t* x, int64_t ldx, int mr, const void* panel, int q8, int nv, int64_t pairs,
                     const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    if (q8) {
        if (nv == PANEL_VECS) TILE_CASES(1, PANEL_VECS) else if (nv == 2) TILE_CASES(1, 2) else TILE_CASES(1, 1)
    } else {
        if (nv == PANEL_VECS) TILE_CASES(0, PANEL_VECS) else if (nv == 2) TILE_CASES(0, 2) else TILE_CASES(0, 1)
    }
}

// Also prefetches the pf_len bytes at pf (the next int8 panel), a share per k pair: the tiles that follow prefetch
// nothing, and at 64 rows a panel's widening waited for its bytes from memory (SmolLM2's linears 48.6 -> 53.3 ms).
static void widen_panel(const int8_t* panel, int nv, int64_t pairs, uint16_t* to, const char* pf, int64_t pf_len) {
    const int64_t step = (pf_len + pairs - 1) / pairs;
    int64_t done = 0;
    for (int64_t p = 0; p < pairs; p++) {
        prefetch_share(pf, pf_len, step, p, &done);
        for (int j = 0; j < nv; j++) _mm512_storeu_si512(to + (p * nv + j) * 32, (__m512i)weights(panel, 1, nv, p, j));
    }
}

static void panel_linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int q8,
                         const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS, pairs = k_len / 2;
    const int64_t tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t bytes_per_col = linear_bytes_per_col(q8, k_len);
    const int widen = q8 && tiles > 1;
    // Work items: a panel and a share of its row tiles (linear_row_parts, kernel_common.h).
    const int64_t row_parts = linear_row_parts(panels, tiles, omp_get_max_threads());
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        uint16_t* wide = widen ? malloc(PANEL_COLS * k_len * sizeof(uint16_t)) : NULL;
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * row_parts; item++) {
            const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
            // The next panel goes to L1 on the way: in a call of one tile (1-8 rows: bound by reading the weights)
            // over its k pairs, in an int8 call of more tiles while this panel is widened, in a bf16 call of more
            // tiles not at all (see tile). SmolLM2's 30 layers and head in bf16 at 1-8 rows: 6.7 ms with this, 7.5
            // with the hardware prefetcher alone, 8 into L2.
            if (wide) widen_panel((const int8_t*)it.panel, it.nv, pairs, wide, it.next, it.next_bytes);
            for (int64_t t = it.part * tiles / row_parts; t < (it.part + 1) * tiles / row_parts; t++) {
                const int64_t m0 = t * TILE_ROWS;
                const int mr = m_len - m0 < TILE_ROWS ? (int)(m_len - m0) : TILE_ROWS;
                any_tile(x + m0 * ldx, ldx, mr, wide ? (const void*)wide : it.panel, q8 && !wide, it.nv, pairs,
                         bias ? bias + it.n0 : 0, out + m0 * ldo + it.n0, ldo, it.cols, it.next,
                         tiles == 1 ? it.next_bytes : 0);
            }
        }
        free(wide);
    }
}

int linear_kernels_available(void) { return 1; }
int linear_int8_available(void) { return 1; }
#else
int linear_kernels_available(void) { return linear_avx2_available(); }
int linear_int8_available(void) { return linear_quant_avx2_available(); }
#endif

int linear_panel_cols(void) { return PANEL_COLS; }

// x: bf16 [m_len, k_len] with row stride ldx; packed: the weight [n_len, k_len] as panels (see the top; the last
// panel holds the remaining columns rounded up to 16, zero-filled): bf16 (format 0, k_len even), int8 (format 1) or
// int4 (format 2), k_len a multiple of 32 for both (their layouts: kernel_common.h); bias: bf16 [n_len] or NULL;
// out: bf16 [m_len, n_len] with row stride ldo. Where the CPU has AMX, every call with k_len a multiple of 32 runs
// on csrc/linear_amx.c's tiles.
void linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
            uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
#if defined(__AVX512BF16__)
    if (linear_amx(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len)) return;
    if (format == 2) linear_int4(x, ldx, m_len, packed, bias, out, ldo, n_len, k_len);
    else panel_linear(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len);
#else
    if (format == 0) linear_avx2(x, ldx, m_len, packed, bias, out, ldo, n_len, k_len);
    else linear_quant_avx2(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len);
#endif
}
