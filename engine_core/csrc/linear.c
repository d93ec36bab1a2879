// Linear layers on CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bf16 in and out, fp32 sums; the weight
// in bf16, or weight-only int8 with one fp32 scale per 32 weights of a row (--quantization int8; int4 is
// csrc/linear_int4.c's), or int4 panels widened to bf16 as they go (format 4: a checkpoint's bf16 weights that lie
// on a 4-bit grid, stored as that grid); with AMX, csrc/linear_amx.c runs them all; without AVX512-BF16,
// csrc/linear_avx512.c or csrc/linear_avx2.c and csrc/linear_quant_avx2.c).
//
// A decode step's few rows are bound by reading the weights. The weight is packed once at load into panels of up
// to 48 output columns, in vdpbf16ps's pair layout: for each pair of k, the panel's columns x 2 values (three
// vectors of 16 columns). A tile of up to 8 input rows x one panel keeps 24 fp32 accumulators in registers; each
// k pair broadcasts two bf16 of a row against the three weight vectors. Every output sums its k pairs in the same
// order whatever the number of rows, so a row's result never depends on its neighbours. With one tile of rows,
// the next panel is prefetched while this one is worked on. An int8 panel holds, per group of 32 k, the int8
// weights in the same pair layout and then each lane's scale; a tile widens them to bf16(q * scale) as it goes,
// or, for more rows than one tile, the panel is widened once into a bf16 panel first. Format 4 is widened the same
// ways, so its sums are those of the bf16 weights it stands for, bit for bit. Without AVX512-BF16,
// csrc/linear_avx2.c (bf16) and csrc/linear_quant_avx2.c (int8, int4) read the same panels with fp32 FMAs (AVX2).
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#define PANEL_COLS LINEAR_PANEL_COLS  // see kernel_common.h
#define PANEL_VECS (PANEL_COLS / 16)  // 16-column vectors per panel
#define TILE_ROWS 8
#define GROUP_PAIRS (QUANT_GROUP / 2)  // int8: k pairs per scale

#if defined(__AVX512BF16__)
// Format 4 at the first k pair p of a group: the group's scales and mins of each vector spread over the widening's
// lanes (kernel_common.h's grid_lanes), which weights() then reads for the group's 16 pairs.
static inline __attribute__((always_inline)) void group_lanes(const void* panel, int fmt, int nv, int64_t p,
                                                              GridLanes* lanes) {
    if (fmt != 4 || p % GROUP_PAIRS) return;
    const float* scales = quant_scales(quant_group(panel, 4, nv, p / GROUP_PAIRS), 4, nv);
    for (int j = 0; j < nv; j++) lanes[j] = grid_lanes(scales + 16 * j, scales + 16 * (nv + j));
}

// Vector j of k pair p of a panel with nv vectors: bf16 as stored, or widened from int8 (fmt 1) or int4 (fmt 4:
// bf16(scale * q + min), kernel_common.h's int4_bf16_pairs, with the group's lanes from group_lanes); fmt and nv are
// constants after inlining.
static inline __attribute__((always_inline)) __m512bh weights(const void* panel, int fmt, int nv, int64_t p, int j,
                                                              const GridLanes* lanes) {
    if (!fmt) return (__m512bh)_mm512_loadu_si512((const uint16_t*)panel + (p * nv + j) * 32);
    const uint8_t* group = quant_group(panel, fmt, nv, p / GROUP_PAIRS);
    if (fmt == 1)
        return int8_pairs((const int8_t*)group + ((p % GROUP_PAIRS) * nv + j) * 32,
                          quant_scales(group, fmt, nv) + j * 32);
    const int64_t r = p % GROUP_PAIRS;  // the group's pair r: nibble r % 4 of load r / 4
    return int4_bf16_pairs(_mm512_loadu_si512(group + (r / 4 * nv + j) * 64), (int)(r % 4), &lanes[j],
                           nibble_table());
}

// The next panel's prefetch spread over a loop of k pairs, `step` bytes of the pf_len at pf per pair: at pair p,
// the lines up to p + 1 steps (*done: bytes sent so far). Always inlined, as kernel_common.h's prefetch helpers.
static inline __attribute__((always_inline)) void prefetch_share(const char* pf, int64_t pf_len, int64_t step,
                                                                 int64_t p, int64_t* done) {
    for (; *done < (p + 1) * step && *done < pf_len; *done += 64) _mm_prefetch(pf + *done, _MM_HINT_T0);
}

// k pair p's weights w times each row's pair, into the accumulators.
static inline __attribute__((always_inline)) void rows_pair(const uint16_t* const* xp, int64_t p, int mr, int nv,
                                                            const __m512bh* w, __m512 acc[TILE_ROWS][PANEL_VECS]) {
    for (int i = 0; i < mr; i++) {
        int32_t pair;  // x[i, 2p] and x[i, 2p + 1]; memcpy: rows need not be 4-byte aligned
        memcpy(&pair, xp[i] + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
    }
}

// k pair p of a tile of bf16 or int8 panels (format 4 goes a group at a time, tile_group): its weights times each
// row's pair, into the accumulators.
static inline __attribute__((always_inline)) void tile_pair(const uint16_t* const* xp, int64_t p, int mr,
                                                            const void* panel, int fmt, int nv,
                                                            __m512 acc[TILE_ROWS][PANEL_VECS]) {
    __m512bh w[PANEL_VECS];
    for (int j = 0; j < nv; j++) w[j] = weights(panel, fmt, nv, p, j, NULL);
    rows_pair(xp, p, mr, nv, w, acc);
}

// Format 4's group g of a tile (its 16 k pairs, in order): the group's lanes once, each load of four pairs'
// nibbles once, and each pair's nibble shift a constant. Taken pair by pair through weights(), as widen_panel
// takes them, a pair's place in its group was worked out at every pair; at one row, where a step widens every
// weight it reads, that bookkeeping took a fifth of the loop's samples.
static inline __attribute__((always_inline)) void tile_group(const uint16_t* const* xp, int64_t g, int mr,
                                                             const void* panel, int nv,
                                                             __m512 acc[TILE_ROWS][PANEL_VECS]) {
    const uint8_t* group = quant_group(panel, 4, nv, g);
    GridLanes lanes[PANEL_VECS];
    group_lanes(panel, 4, nv, g * GROUP_PAIRS, lanes);
    const __m512i table = nibble_table();
    for (int r4 = 0; r4 < GROUP_PAIRS / 4; r4++) {
        __m512i four[PANEL_VECS];
        for (int j = 0; j < nv; j++) four[j] = _mm512_loadu_si512(group + (r4 * nv + j) * 64);
#pragma GCC unroll 4
        for (int sub = 0; sub < 4; sub++) {
            __m512bh w[PANEL_VECS];
            for (int j = 0; j < nv; j++) w[j] = int4_bf16_pairs(four[j], sub, &lanes[j], table);
            rows_pair(xp, g * GROUP_PAIRS + r4 * 4 + sub, mr, nv, w, acc);
        }
    }
}

// One tile: mr rows x nv vectors of the panel over all k pairs (mr, nv, fmt: constants after inlining); pf_len
// bytes at pf (the next panel, or none) are prefetched on the way.
static inline __attribute__((always_inline)) void tile(const uint16_t* x, int64_t ldx, int mr, const void* panel,
                                                       int fmt, int nv, int64_t pairs, const uint16_t* bias,
                                                       uint16_t* out, int64_t ldo, int64_t cols, const char* pf,
                                                       int64_t pf_len) {
    __m512 acc[TILE_ROWS][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t* xp[TILE_ROWS];
    for (int i = 0; i < mr; i++) xp[i] = x + i * ldx;
    // pf_len > 0 (a call of one tile) spreads the prefetches over the k pairs (format 4, which only comes in calls
    // of one tile, over its groups, k being a multiple of 32; one loop over groups or pairs for both measured 2-3%
    // slower at 8 rows). A call of more tiles reads each panel from L2 after its first tile, and checking for
    // prefetches at every pair cost it 5-10% of its speed (a 2048-row prefill 383-391 -> 410-421 GFLOP/s without),
    // so its loop has none.
    if (fmt == 4) {
        const int64_t groups = pairs / GROUP_PAIRS, step = (pf_len + groups - 1) / groups;
        int64_t done = 0;
        for (int64_t g = 0; g < groups; g++) {
            prefetch_share(pf, pf_len, step, g, &done);
            tile_group(xp, g, mr, panel, nv, acc);
        }
    } else if (pf_len > 0) {
        const int64_t step = (pf_len + pairs - 1) / pairs;
        int64_t done = 0;
        for (int64_t p = 0; p < pairs; p++) {
            prefetch_share(pf, pf_len, step, p, &done);
            tile_pair(xp, p, mr, panel, fmt, nv, acc);
        }
    } else
        for (int64_t p = 0; p < pairs; p++) tile_pair(xp, p, mr, panel, fmt, nv, acc);
    store_linear_tile(acc, mr, nv, cols, bias, out, ldo);
}

#define TILE_CASE(MR, FMT, NV) tile(x, ldx, MR, panel, FMT, NV, pairs, bias, out, ldo, cols, pf, pf_len)
#define TILE_CASES(FMT, NV)                   \
    switch (mr) {                             \
        case 8: TILE_CASE(8, FMT, NV); break; \
        case 7: TILE_CASE(7, FMT, NV); break; \
        case 6: TILE_CASE(6, FMT, NV); break; \
        case 5: TILE_CASE(5, FMT, NV); break; \
        case 4: TILE_CASE(4, FMT, NV); break; \
        case 3: TILE_CASE(3, FMT, NV); break; \
        case 2: TILE_CASE(2, FMT, NV); break; \
        default: TILE_CASE(1, FMT, NV); break; \
    }
#define FORMAT_CASES(FMT) \
    if (nv == PANEL_VECS) TILE_CASES(FMT, PANEL_VECS) else if (nv == 2) TILE_CASES(FMT, 2) else TILE_CASES(FMT, 1)
// The last panel of a weight whose rows are not a multiple of 48 has one or two vectors: a LoRA adapter's A (8 to
// 48 columns) is only that panel, so it gets whole tiles of rows too (one row at a time, its lone accumulator chain
// ran at a fifth of the speed).
static void any_tile(const uint16_t* x, int64_t ldx, int mr, const void* panel, int fmt, int nv, int64_t pairs,
                     const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t cols, const char* pf, int64_t pf_len) {
    if (fmt == 4) FORMAT_CASES(4) else if (fmt == 1) FORMAT_CASES(1) else FORMAT_CASES(0)
}

// A quantized panel (format 1 or 4) widened into a bf16 one at `to`. Also prefetches the pf_len bytes at pf (the
// next panel), a share per k pair: the tiles that follow prefetch nothing, and at 64 rows a panel's widening waited
// for its bytes from memory (SmolLM2's int8 linears 48.6 -> 53.3 ms).
static void widen_panel(const void* panel, int fmt, int nv, int64_t pairs, uint16_t* to, const char* pf,
                        int64_t pf_len) {
    const int64_t step = (pf_len + pairs - 1) / pairs;
    int64_t done = 0;
    GridLanes lanes[PANEL_VECS];
    for (int64_t p = 0; p < pairs; p++) {
        prefetch_share(pf, pf_len, step, p, &done);
        group_lanes(panel, fmt, nv, p, lanes);
        for (int j = 0; j < nv; j++)
            _mm512_storeu_si512(to + (p * nv + j) * 32, (__m512i)weights(panel, fmt, nv, p, j, lanes));
    }
}

static void panel_linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int fmt,
                         const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (m_len <= 0) return;
    const int64_t panels = (n_len + PANEL_COLS - 1) / PANEL_COLS, pairs = k_len / 2;
    const int64_t tiles = (m_len + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t bytes_per_col = linear_bytes_per_col(fmt, k_len);
    const int widen = fmt && tiles > 1;
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
            if (wide) widen_panel(it.panel, fmt, it.nv, pairs, wide, it.next, it.next_bytes);
            for (int64_t t = it.part * tiles / row_parts; t < (it.part + 1) * tiles / row_parts; t++) {
                const int64_t m0 = t * TILE_ROWS;
                const int mr = m_len - m0 < TILE_ROWS ? (int)(m_len - m0) : TILE_ROWS;
                any_tile(x + m0 * ldx, ldx, mr, wide ? (const void*)wide : it.panel, wide ? 0 : fmt, it.nv, pairs,
                         bias ? bias + it.n0 : 0, out + m0 * ldo + it.n0, ldo, it.cols, it.next,
                         tiles == 1 ? it.next_bytes : 0);
            }
        }
        free(wide);
    }
}

// The bf16 weight [n_len, k_len] that int8 or format-4 panels stand for, widened as the tiles widen them (how
// engine_core/models/grid_weights.py checks that they stand for a checkpoint's bf16 weight, bit for bit).
void linear_widen(const void* packed, int format, int64_t n_len, int64_t k_len, uint16_t* out) {
    const int64_t bytes_per_col = linear_bytes_per_col(format, k_len), panels = (n_len + PANEL_COLS - 1) / PANEL_COLS;
    for (int64_t item = 0; item < panels; item++) {
        const PanelItem it = panel_item(packed, item, 1, n_len, bytes_per_col);
        GridLanes lanes[PANEL_VECS];
        for (int64_t p = 0; p < k_len / 2; p++) {
            group_lanes(it.panel, format, it.nv, p, lanes);
            for (int j = 0; j < it.nv; j++) {
                uint32_t pairs[16];  // column c's k pair p
                _mm512_storeu_si512(pairs, (__m512i)weights(it.panel, format, it.nv, p, j, lanes));
                for (int64_t c = 0; c < 16 && 16 * j + c < it.cols; c++)
                    memcpy(out + (it.n0 + 16 * j + c) * k_len + 2 * p, &pairs[c], 4);
            }
        }
    }
}

int linear_kernels_available(void) { return 1; }
int linear_int8_available(void) { return 1; }
int linear_grid_available(void) { return 1; }
#else
void linear_widen(const void* packed, int format, int64_t n_len, int64_t k_len, uint16_t* out) {
    (void)packed, (void)format, (void)n_len, (void)k_len, (void)out;  // never called: no grid panels here
}
int linear_kernels_available(void) { return linear_avx2_available(); }
int linear_int8_available(void) { return linear_quant_avx2_available(); }
int linear_grid_available(void) { return 0; }  // AVX2's int8 sums differ from its bf16 ones; it has no format 4
#endif

int linear_panel_cols(void) { return PANEL_COLS; }
// Calls of up to this many rows read a linear's grid panels where it has them (engine_core/models/grid_weights.py),
// more rows its bf16 panels: one AMX block, or without AMX one tile of this file. Few rows wait for the weights'
// bytes, which the grid cuts to a third; more are bound by the tiles, and the grid's widening (about 8 vector
// operations per 32 weights) only added to them: on AMX SmolLM2's decode step at 32 rows 29.9 -> 31.4 ms, at 16
// rows 20.2 -> 16.6. This file widens a panel for more than one tile into a bf16 copy first, which on an AMD EPYC
// (Zen 5) made SmolLM2's linears and head at 9-16 rows slower than its bf16 panels (16 rows: 10.4-10.6 against
// 8.9-9.1 ms), at 8 rows faster (6.2 against 7.0-7.5; bench/results/grid_rows_no_amx_2026-12-01.txt).
int linear_grid_rows(void) { return linear_amx_available() ? GRID_ROWS : TILE_ROWS; }

// x: bf16 [m_len, k_len] with row stride ldx; packed: the weight [n_len, k_len] as panels (see the top; the last
// panel holds the remaining columns rounded up to 16, zero-filled): bf16 (format 0, k_len even), int8 (format 1),
// int4 (format 2) or int4 summed as bf16 (format 4, only with AVX512-BF16), k_len a multiple of 32 for the
// quantized ones (their layouts: kernel_common.h); bias: bf16 [n_len] or NULL;
// out: bf16 [m_len, n_len] with row stride ldo. Where the CPU has AMX, every call with k_len a multiple of 32 runs
// on csrc/linear_amx.c's tiles.
void linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
            uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
#if defined(__AVX512BF16__)
    if (linear_amx(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len)) return;
    if (format == 2) linear_int4(x, ldx, m_len, packed, bias, out, ldo, n_len, k_len);
    else panel_linear(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len);
#else
    if (format == 0 && linear_avx512_available()) linear_avx512(x, ldx, m_len, packed, bias, out, ldo, n_len, k_len);
    else if (format == 0) linear_avx2(x, ldx, m_len, packed, bias, out, ldo, n_len, k_len);
    else linear_quant_avx2(x, ldx, m_len, packed, format, bias, out, ldo, n_len, k_len);
#endif
}
