// bf16 linears on Intel AMX (Sapphire Rapids and later), reading csrc/linear.c's panels as they are: for each k
// pair, each 16-column vector of a panel holds its 16 columns x 2 values, which is one row of an AMX B tile. So a
// B tile is 16 k pairs (32 k) of one vector, its rows strided by the panel's vectors; an A tile is up to 16 input
// rows x 32 k; three C tiles hold 16 rows x the panel's 48 columns in fp32. Each output sums its 32-k chunks in k
// order, each chunk in the hardware's fixed order, whatever the number of rows (a block of fewer than 16 rows
// configures shorter tiles), so a row's bits never depend on its neighbours, as with csrc/linear.c's tiles.
//
// Where the CPU has AMX (compiled in, and the kernel lets the process use its tile registers), linear() sends every
// bf16 call with k a multiple of 32 here, and the rest to csrc/linear.c: one weight always takes the same path, at
// any number of rows. On a 2-vCPU Sapphire Rapids the AVX512-BF16 tiles ran 2048-row prefills at 190 GFLOP/s, oneDNN's
// AMX matmul at 1.4-2.0 TFLOP/s.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCK_ROWS 16
#define CHUNK_K 32  // k per tile step: 16 pairs
#define NV (LINEAR_PANEL_COLS / 16)

static int amx_usable = -1;  // -1: not asked yet

// Whether this process may use AMX: Linux hands the tile registers out on request (else they fault).
// ROSEINFER_AMX=0 keeps every call on csrc/linear.c's tiles (to compare them, or to rule AMX out).
int linear_amx_available(void) {
    if (amx_usable < 0) {
        const char* env = getenv("ROSEINFER_AMX");
        amx_usable = !(env && env[0] == '0') && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_usable;
}

// Tiles 0-2: C, one per vector (mr rows x 16 fp32); 3: A (mr rows x 32 bf16); 4-6: B (16 pairs x 16 columns x 2).
static void configure(int mr) {
    AmxTileConfig cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) cfg.rows[t] = (uint8_t)mr, cfg.colsb[t] = 64;
    cfg.rows[3] = (uint8_t)mr, cfg.colsb[3] = 2 * CHUNK_K;
    for (int t = 4; t < 7; t++) cfg.rows[t] = CHUNK_K / 2, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// One block: mr rows x the panel's nv vectors over all of k (nv: a constant after inlining).
static inline __attribute__((always_inline)) void block(const uint16_t* x, int64_t ldx, const char* panel, int nv,
                                                        int64_t k_len, float (*c)[LINEAR_PANEL_COLS]) {
    _tile_zero(0);
    if (nv > 1) _tile_zero(1);
    if (nv > 2) _tile_zero(2);
    const int64_t stride = nv * 64;  // bytes from one k pair of a vector to the next
    for (int64_t k0 = 0; k0 < k_len; k0 += CHUNK_K) {
        const char* b = panel + k0 / 2 * stride;
        _tile_loadd(3, x + k0, ldx * 2);
        _tile_loadd(4, b, stride);
        _tile_dpbf16ps(0, 3, 4);
        if (nv > 1) {
            _tile_loadd(5, b + 64, stride);
            _tile_dpbf16ps(1, 3, 5);
        }
        if (nv > 2) {
            _tile_loadd(6, b + 128, stride);
            _tile_dpbf16ps(2, 3, 6);
        }
    }
    _tile_stored(0, &c[0][0], sizeof c[0]);
    if (nv > 1) _tile_stored(1, &c[0][16], sizeof c[0]);
    if (nv > 2) _tile_stored(2, &c[0][32], sizeof c[0]);
}

// 1 if it ran the call (bf16 panels, k a multiple of 32, AMX usable), else 0 and nothing done.
int linear_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
               uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if (k_len % CHUNK_K || !linear_amx_available()) return 0;
    if (m_len <= 0) return 1;
    const int64_t panels = (n_len + LINEAR_PANEL_COLS - 1) / LINEAR_PANEL_COLS;
    const int64_t blocks = (m_len + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t row_parts = linear_row_parts(panels, blocks, omp_get_max_threads());
    // Where x fits in half of L2, a thread takes its items one panel at a time, all its blocks of rows in turn (the
    // panel is read from memory once, x from L2). Beyond that, a group of panels (1 MB of weights, which stay
    // in L2) at a time, each block of rows across the whole group before the next (its rows of x stay in L1, and each
    // row's outputs are written in long runs): one panel at a time had read x from memory again for every panel,
    // which on SmolLM2's 2048-row prefills took the tile unit to half of oneDNN's speed. No order moves a bit: each
    // block is computed alone.
    const int64_t group = amx_item_group(m_len, k_len, LINEAR_PANEL_COLS * 2 * k_len, row_parts);  // in items
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        float c[BLOCK_ROWS][LINEAR_PANEL_COLS] __attribute__((aligned(64)));
        int configured = 0;  // the rows the tiles are configured for (each thread has its own tile state)
        const int64_t items = panels * row_parts, threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t mine_end = items * (me + 1) / threads;
        for (int64_t g0 = items * me / threads; g0 < mine_end; g0 += group) {
            const int64_t g_end = g0 + group < mine_end ? g0 + group : mine_end;
            for (int64_t t = 0; t < blocks; t++) {
                const int64_t m0 = t * BLOCK_ROWS;
                const int mr = m_len - m0 < BLOCK_ROWS ? (int)(m_len - m0) : BLOCK_ROWS;
                for (int64_t item = g0; item < g_end; item++) {
                    const int64_t part = item % row_parts;
                    if (t < part * blocks / row_parts || t >= (part + 1) * blocks / row_parts) continue;
                    const PanelItem it = panel_item(packed, item, row_parts, n_len, 2 * k_len);
                    if (mr != configured) configure(configured = mr);
                    if (it.nv == NV) block(x + m0 * ldx, ldx, it.panel, NV, k_len, c);
                    else if (it.nv == 2) block(x + m0 * ldx, ldx, it.panel, 2, k_len, c);
                    else block(x + m0 * ldx, ldx, it.panel, 1, k_len, c);
                    store_linear_tile((__m512(*)[NV])c, mr, it.nv, it.cols, bias ? bias + it.n0 : 0,
                                      out + m0 * ldo + it.n0, ldo);
                }
            }
        }
        if (configured) _tile_release();
    }
    return 1;
}
#else
int linear_amx_available(void) { return 0; }
int linear_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
               uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)bias, (void)out, (void)ldo, (void)n_len, (void)k_len;
    return 0;
}
#endif
