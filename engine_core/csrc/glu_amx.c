// A gated MLP's first half in one call on Intel AMX: out = act(x W_gate^T + b_gate) * (x W_up^T + b_up), from the
// merged gate_up linear's bf16 panels (csrc/linear.c's layout; gate the first `half` output columns, up the next).
// The unfused path writes the [rows, 2 * half] product and act_and_mul reads it back: at a 2048-row prefill of
// SmolLM2 that intermediate is 12.6 MB, past L2, and act_and_mul ran at the memory's speed. Here each step takes two
// blocks of 16 rows against one gate vector and its up vector, and the activation runs on the tiles' sums.
// Bit for bit the unfused path: gate and up rounded to bf16 with their bias first, then act16 as act_and_mul
// applies it (csrc/layers.c), rounded, times up, rounded.
#include <omp.h>

#include "kernel_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BLOCK_ROWS 16
#define CHUNK_K 32

// Tiles 0-3: C (mr rows x 16 fp32: rows 0-15 gate, rows 0-15 up, rows 16-31 gate, rows 16-31 up); 4-5: A (the two
// blocks of rows, mr x 32 bf16); 6-7: B (gate, up: 16 pairs x 16 columns x 2).
static void configure(int mr) {
    AmxTileConfig cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = t < 6 ? (uint8_t)mr : CHUNK_K / 2, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// Where the 16-column vector j of an n-column weight lies in its panels: the first k pair's 64 bytes, and the bytes
// from one k pair to the next (the panel's vectors x 64).
typedef struct {
    const char* at;
    int64_t stride;
} PanelVector;
static inline PanelVector panel_vector(const void* packed, int64_t j, int64_t n_len, int64_t k_len) {
    const int64_t n0 = j * 16 / LINEAR_PANEL_COLS * LINEAR_PANEL_COLS, padded_n = (n_len + 15) / 16 * 16;
    const int64_t nv = (padded_n - n0 < LINEAR_PANEL_COLS ? padded_n - n0 : LINEAR_PANEL_COLS) / 16;
    PanelVector v = {(const char*)packed + n0 * 2 * k_len + (j * 16 - n0) / 16 * 64, nv * 64};
    return v;
}

// Gate vector j and up vector j over all of k for one block of mr rows, or two of 16 (blocks = 2: each B tile then
// serves both, and nothing waits on a tile in use): c[r] = gate, then up, of row r.
static inline __attribute__((always_inline)) void glu_block(const uint16_t* x, int64_t ldx, PanelVector gate,
                                                            PanelVector up, int blocks, int64_t k_len,
                                                            float (*c)[32]) {
    _tile_zero(0);
    _tile_zero(1);
    if (blocks > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK_K) {
        _tile_loadd(4, x + k0, ldx * 2);
        _tile_loadd(6, gate.at + k0 / 2 * gate.stride, gate.stride);
        _tile_loadd(7, up.at + k0 / 2 * up.stride, up.stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (blocks > 1) {
            _tile_loadd(5, x + BLOCK_ROWS * ldx + k0, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, &c[0][0], sizeof c[0]);
    _tile_stored(1, &c[0][16], sizeof c[0]);
    if (blocks > 1) {
        _tile_stored(2, &c[BLOCK_ROWS][0], sizeof c[0]);
        _tile_stored(3, &c[BLOCK_ROWS][16], sizeof c[0]);
    }
}

// The outputs of rows 0 .. rows - 1: columns 16j .. 16j + 16.
static inline void glu_store(float (*c)[32], int rows, const uint16_t* bias_gate, const uint16_t* bias_up, int gelu,
                             uint16_t* out, int64_t ldo) {
    const __m512 bg = bias_gate ? vload_bf16(bias_gate) : _mm512_setzero_ps();
    const __m512 bu = bias_up ? vload_bf16(bias_up) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++) {
        const __m512 gate = vwiden_bf16((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&c[i][0]), bg)));
        const __m512 up = vwiden_bf16((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&c[i][16]), bu)));
        const __m512 act = vwiden_bf16((__m256i)_mm512_cvtneps_pbh(act16(gate, gelu)));
        _mm256_storeu_si256((__m256i*)(out + i * ldo), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, up)));
    }
}

// 1 if it ran the call (AMX usable, k % 32 == 0, half % 16 == 0), else 0 and nothing done. packed: the merged
// weight's bf16 panels (2 * half output columns); bias: its 2 * half values, or NULL; out: [m_len, half].
int glu_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias, uint16_t* out,
            int64_t ldo, int64_t half, int64_t k_len, int gelu) {
    if (k_len % CHUNK_K || half % 16 || !linear_amx_available()) return 0;
    if (m_len <= 0) return 1;
    const int64_t vectors = half / 16, blocks = (m_len + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t row_parts = linear_row_parts(vectors, blocks, omp_get_max_threads());
    const int64_t group = amx_item_group(m_len, k_len, 2 * 16 * 2 * k_len, row_parts);  // as csrc/linear_amx.c
    _Pragma("omp parallel if (linear_parallel(m_len, 2 * half, k_len))") {
        float c[2 * BLOCK_ROWS][32] __attribute__((aligned(64)));
        int configured = 0;
        const int64_t items = vectors * row_parts, threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t mine_end = items * (me + 1) / threads;
        for (int64_t g0 = items * me / threads; g0 < mine_end; g0 += group) {
            const int64_t g_end = g0 + group < mine_end ? g0 + group : mine_end;
            for (int64_t t0 = 0; t0 < blocks; t0 += 2)  // blocks of rows in pairs: t0 and t0 + 1
                for (int64_t item = g0; item < g_end; item++) {
                    const int64_t part = item % row_parts, j = item / row_parts;
                    const int64_t first = part * blocks / row_parts, end = (part + 1) * blocks / row_parts;
                    const PanelVector gate = panel_vector(packed, j, 2 * half, k_len);
                    const PanelVector up = panel_vector(packed, vectors + j, 2 * half, k_len);
                    const uint16_t* bias_gate = bias ? bias + 16 * j : NULL;
                    const uint16_t* bias_up = bias ? bias + half + 16 * j : NULL;
                    if (t0 >= first && t0 + 1 < end && (t0 + 2) * BLOCK_ROWS <= m_len) {  // two whole blocks
                        if (configured != BLOCK_ROWS) configure(configured = BLOCK_ROWS);
                        glu_block(x + t0 * BLOCK_ROWS * ldx, ldx, gate, up, 2, k_len, c);
                        glu_store(c, 2 * BLOCK_ROWS, bias_gate, bias_up, gelu, out + t0 * BLOCK_ROWS * ldo + 16 * j,
                                  ldo);
                        continue;
                    }
                    for (int64_t t = t0; t < t0 + 2 && t < blocks; t++) {
                        if (t < first || t >= end) continue;
                        const int64_t m0 = t * BLOCK_ROWS;
                        const int mr = m_len - m0 < BLOCK_ROWS ? (int)(m_len - m0) : BLOCK_ROWS;
                        if (mr != configured) configure(configured = mr);
                        glu_block(x + m0 * ldx, ldx, gate, up, 1, k_len, c);
                        glu_store(c, mr, bias_gate, bias_up, gelu, out + m0 * ldo + 16 * j, ldo);
                    }
                }
        }
        if (configured) _tile_release();
    }
    return 1;
}
#else
int glu_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias, uint16_t* out,
            int64_t ldo, int64_t half, int64_t k_len, int gelu) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)half, (void)k_len;
    (void)gelu;
    return 0;
}
#endif
