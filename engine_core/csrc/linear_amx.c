// Linears on Intel AMX (Sapphire Rapids and later), reading csrc/linear.c's panels: for each k pair, each 16-column
// vector of a bf16 panel holds its 16 columns x 2 values, which is one row of an AMX B tile. So a B tile is 16 k
// pairs (a chunk of 32 k) of one vector, its rows strided by the panel's vectors; an A tile is up to 16 input rows x
// 32 k; three C tiles hold 16 rows x the panel's 48 columns in fp32. Each output sums its chunks in k order, each
// chunk in the hardware's fixed order, whatever the number of rows (a block of fewer than 16 rows configures shorter
// tiles), so a row's bits never depend on its neighbours, as with csrc/linear.c's tiles.
//
// Quantized panels are widened into that bf16 layout: int8 to bf16(q * scale) and format 4 (int4 summed as bf16) to
// bf16(fma(q, scale, min)), as csrc/linear.c's tiles widen them, and then summed over all of k as bf16 weights are;
// int4 to its exact q, each run of chunks (32 k) that share their scales and mins (one chunk, or a checkpoint's
// whole group) into C tiles zeroed for it, then scaled and shifted on the vectors as csrc/linear_int4.c's tiles do
// for each group. A call of many rows widens each panel once; a call of one block of rows widens a chunk at a time, in L1, just ahead of its tiles (the
// whole panel first had gone to L2 and back: SmolLM2's linears at 1 row in int4 13.1 ms, against 8.9 on
// linear_int4.c's tiles). One row still pays for storing every widened weight and loading it back, which the
// AVX-512 tiles never do: a single stream's int4 decode step about 15% slower (see the README).
//
// Where the CPU has AMX (compiled in, and the kernel lets the process use its tile registers), linear() sends every
// call with k a multiple of 32 here (all quantized ones), and the rest to csrc/linear.c: one weight always takes the
// same path, at any number of rows. On a 2-vCPU Sapphire Rapids the AVX512-BF16 tiles ran 2048-row prefills at 190
// GFLOP/s in bf16 and int8, 167 in int4; oneDNN's AMX matmul at 1.4-2.0 TFLOP/s.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCK_ROWS 16
#define CHUNK_K 32  // k per tile step: 16 pairs; a quantized format's group
#define NV (LINEAR_PANEL_COLS / 16)
#define CHUNK_BYTES (CHUNK_K * LINEAR_PANEL_COLS * 2)  // a chunk of a full panel in bf16

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

// What a chunk prefetches as it is widened: its own bytes `ahead` on, which past the panel's end are the next
// panel's (a thread's panels follow one another in memory), spread over the `parts` steps of its widening. int8 and
// format 4, whose widening is most of their work, look 4 KB ahead: sending the next panel's share in one burst at
// each chunk's start had left their widening waiting for memory (SmolLM2's grid linears at one row, one thread,
// 14.2 -> 11.3 ms; two threads, one row to 16, 8-14% less time than one panel ahead). int4, widened to its exact q in
// two operations, gets through its bytes sooner and looks a panel ahead (its LM head at one row took 15% less time so).
#define WIDENED_AHEAD 4096
typedef struct {
    const char* at;
    int64_t next, end, part;
} ChunkPrefetch;
static inline ChunkPrefetch chunk_prefetch(const uint8_t* group, int64_t bytes, int64_t ahead, int parts) {
    return (ChunkPrefetch){(const char*)group + ahead, 0, bytes, (bytes + parts - 1) / parts};
}
// Step i of the widening: the prefetches up to i + 1 parts of the chunk's bytes.
static inline __attribute__((always_inline)) void prefetch_part(ChunkPrefetch* c, int i) {
    for (const int64_t until = (i + 1) * c->part; c->next < until && c->next < c->end; c->next += 64)
        _mm_prefetch(c->at + c->next, _MM_HINT_T0);
}

// Chunk g of a quantized panel of nv vectors widened into B tiles at `to` (16 pairs x nv vectors of 64 bytes): int8
// to bf16(q * scale) and format 4 to bf16(scale * q + min), as csrc/linear.c's tiles widen them, int4 to bf16(q),
// exact, prefetching ahead on the way (chunk_prefetch).
static inline __attribute__((always_inline)) void widen_chunk(int format, const char* quant, int nv, int64_t chunks,
                                                              int64_t g, char* to) {
    const uint8_t* group = quant_group(quant, format, nv, g);
    const float* sm = quant_scales(group, format, nv);
    const int64_t bytes = nv * quant_group_vec_bytes(format);
    if (format == 1) {
        ChunkPrefetch fetch = chunk_prefetch(group, bytes, WIDENED_AHEAD, CHUNK_K / 2);
        for (int p = 0; p < CHUNK_K / 2; p++) {
            prefetch_part(&fetch, p);
            for (int j = 0; j < nv; j++)
                _mm512_store_si512(to + (p * nv + j) * 64,
                                   (__m512i)int8_pairs((const int8_t*)group + (p * nv + j) * 32, sm + j * 32));
        }
        return;
    }
    const __m512i table = nibble_table();
    GridLanes lanes[NV];
    for (int j = 0; format == 4 && j < nv; j++) lanes[j] = grid_lanes(sm + 16 * j, sm + 16 * (nv + j));
    ChunkPrefetch fetch = chunk_prefetch(group, bytes, format == 4 ? WIDENED_AHEAD : chunks * bytes, CHUNK_K / 8 * nv);
    for (int t = 0; t < CHUNK_K / 8; t++)  // four pairs in each 16-bit lane
        for (int j = 0; j < nv; j++) {
            prefetch_part(&fetch, t * nv + j);
            const __m512i four = _mm512_loadu_si512(group + (t * nv + j) * 64);
            if (format == 4)
                for (int sub = 0; sub < 4; sub++)
                    _mm512_store_si512(to + ((4 * t + sub) * nv + j) * 64,
                                       (__m512i)int4_bf16_pairs(four, sub, &lanes[j], table));
            else
                for (int sub = 0; sub < 4; sub++)
                    _mm512_store_si512(to + ((4 * t + sub) * nv + j) * 64,
                                       _mm512_permutexvar_epi16(_mm512_srli_epi16(four, 4 * sub), table));
        }
}

// A panel as a block reads it. bf16: `wide` is the packed panel, its chunks of B tiles back to back. Quantized:
// `wide` is the panel widened for the call, or NULL in a call of one block of rows, where each chunk is widened into
// buf two chunks before the block reaches it (four chunks' room, in turn), so that its stores have reached L1 when
// its tile loads come (widened as it was reached or one chunk ahead, the loads waited for them: one-row calls were
// slower); `quant` is the packed panel, whose int4 scales and mins a block reads in place.
typedef struct {
    const char *wide, *quant;
    char* buf;
    int format;
    int64_t chunks;
    const uint8_t* starts;  // int4: 1 where chunk g starts a run (run_starts)
} Panel;

// Chunk g's B tiles, and for int4 its scales then mins (nv x 16 fp32 each) at *sm.
static inline __attribute__((always_inline)) const char* chunk(const Panel* p, int nv, int64_t g, const float** sm) {
    if (p->format == 2) *sm = quant_scales(quant_group(p->quant, 2, nv, g), 2, nv);
    if (p->wide) return p->wide + g * (CHUNK_BYTES / NV) * nv;
    if (g == 0) {
        widen_chunk(p->format, p->quant, nv, p->chunks, 0, p->buf);
        if (p->chunks > 1) widen_chunk(p->format, p->quant, nv, p->chunks, 1, p->buf + CHUNK_BYTES);
    }
    if (g + 2 < p->chunks)
        widen_chunk(p->format, p->quant, nv, p->chunks, g + 2, p->buf + ((g + 2) & 3) * CHUNK_BYTES);
    return p->buf + (g & 3) * CHUNK_BYTES;
}

// C tiles 0 to nv - 1 += A (tile 3, loaded from x) x the chunk's B tiles at b.
static inline __attribute__((always_inline)) void chunk_product(const uint16_t* x, int64_t ldx, const char* b,
                                                                int nv) {
    const int64_t stride = nv * 64;  // bytes from one k pair of a vector to the next
    _tile_loadd(3, x, ldx * 2);
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

static inline __attribute__((always_inline)) void zero_c(int nv) {
    _tile_zero(0);
    if (nv > 1) _tile_zero(1);
    if (nv > 2) _tile_zero(2);
}

static inline __attribute__((always_inline)) void store_c(int nv, float (*c)[LINEAR_PANEL_COLS]) {
    _tile_stored(0, &c[0][0], sizeof c[0]);
    if (nv > 1) _tile_stored(1, &c[0][16], sizeof c[0]);
    if (nv > 2) _tile_stored(2, &c[0][32], sizeof c[0]);
}

// An int4 panel's runs (see block): starts[g] = 1 where chunk g's scales and mins (nv x 16 fp32 each) are not
// chunk g - 1's, bit for bit. Found once per panel, not per block of rows.
static void run_starts(const char* quant, int nv, int64_t chunks, uint8_t* starts) {
    const float* prev = quant_scales(quant_group(quant, 2, nv, 0), 2, nv);
    starts[0] = 1;
    for (int64_t g = 1; g < chunks; g++) {
        const float* sm = quant_scales(quant_group(quant, 2, nv, g), 2, nv);
        __mmask16 differ = 0;
        for (int j = 0; j < 2 * nv; j++)
            differ |= _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(sm + 16 * j), _mm512_loadu_si512(prev + 16 * j));
        starts[g] = differ != 0;
        prev = sm;
    }
}

// acc += a run of int4 chunks' products (stored in part) x their scale + the rows' sums of x over the run's k
// (xsum, row stride `chunks`, from chunk r0 to r1) x their min, on the vectors, in linear_int4.c's order.
static inline __attribute__((always_inline)) void scale_run(const float (*part)[LINEAR_PANEL_COLS], const float* sm,
                                                            const float* xsum, int64_t chunks, int64_t r0, int64_t r1,
                                                            int mr, int nv, __m512 (*acc)[NV]) {
    __m512 scale[NV], min[NV];
    for (int j = 0; j < nv; j++) scale[j] = _mm512_loadu_ps(sm + 16 * j), min[j] = _mm512_loadu_ps(sm + 16 * (nv + j));
    for (int i = 0; i < mr; i++) {
        float xs = xsum[i * chunks + r0];
        for (int64_t r = r0 + 1; r < r1; r++) xs += xsum[i * chunks + r];
        const __m512 row_sum = _mm512_set1_ps(xs);
        for (int j = 0; j < nv; j++) {
            acc[i][j] = _mm512_fmadd_ps(_mm512_load_ps(&part[i][16 * j]), scale[j], acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(row_sum, min[j], acc[i][j]);
        }
    }
}

// One block: mr rows x the panel's nv vectors over all `chunks` chunks of k (nv: a constant after inlining). bf16
// and int8 sum every chunk in the C tiles, stored in c at the end. int4 sums a run of chunks in C tiles zeroed for
// it, as long as each chunk's scales and mins are its first's (a 4-bit checkpoint's group of 128 k is a run of 4
// chunks; weights quantized here, each chunk its own scales, make runs of one), then adds the run's part * scale +
// the row's sum of x over the run (xsum) * min to acc on the vectors. Which chunks form a run depends on the
// weights alone, so a row's bits still never depend on its neighbours; a run of one is computed as before.
static inline __attribute__((always_inline)) void block(const uint16_t* x, int64_t ldx, int mr, const Panel* p,
                                                        int nv, int64_t chunks, const float* xsum,
                                                        float (*c)[LINEAR_PANEL_COLS], __m512 (*acc)[NV]) {
    if (p->format != 2) {
        const float* sm = NULL;
        zero_c(nv);
        for (int64_t g = 0; g < chunks; g++) chunk_product(x + g * CHUNK_K, ldx, chunk(p, nv, g, &sm), nv);
        store_c(nv, c);
        return;
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    // A run's products are stored in c's half `half` when it ends, and scaled when the next run ends: the tile
    // unit works on the next run while the vectors wait for the last one's stores.
    const float *run_sm = NULL, *stored_sm = NULL;
    int64_t run0 = 0, stored0 = 0, stored1 = 0;
    int half = 0;
    for (int64_t g = 0; g <= chunks; g++) {
        const float* sm = NULL;
        const char* b = g < chunks ? chunk(p, nv, g, &sm) : NULL;
        const int ends = g > 0 && (g == chunks || p->starts[g]);  // the run [run0, g)
        const float* ended_sm = run_sm;
        const int64_t ended0 = run0;
        if (ends) store_c(nv, c + half * BLOCK_ROWS);
        if (g < chunks) {
            if (g == 0 || ends) zero_c(nv), run_sm = sm, run0 = g;
            chunk_product(x + g * CHUNK_K, ldx, b, nv);
        }
        if (ends) {
            if (stored_sm)
                scale_run(c + (half ^ 1) * BLOCK_ROWS, stored_sm, xsum, chunks, stored0, stored1, mr, nv, acc);
            stored_sm = ended_sm, stored0 = ended0, stored1 = g, half ^= 1;
        }
    }
    scale_run(c + (half ^ 1) * BLOCK_ROWS, stored_sm, xsum, chunks, stored0, stored1, mr, nv, acc);
}

// A thread's scratch of at least `bytes`, kept between calls (a call's widened panels: about 1 MB at most).
static void* scratch(int64_t bytes) {
    static __thread void* buf;
    static __thread int64_t size;
    if (bytes > size) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        size = bytes;
    }
    return buf;
}

// 1 if it ran the call (k a multiple of 32, AMX usable), else 0 and nothing done. format: csrc/linear.c's (0 bf16,
// 1 int8, 2 int4, 4 int4 summed as bf16).
int linear_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
               uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    if ((format > 2 && format != 4) || k_len % CHUNK_K || !linear_amx_available()) return 0;
    if (m_len <= 0) return 1;
    const int64_t panels = (n_len + LINEAR_PANEL_COLS - 1) / LINEAR_PANEL_COLS, chunks = k_len / CHUNK_K;
    const int64_t blocks = (m_len + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t row_parts = linear_row_parts(panels, blocks, omp_get_max_threads());
    const int64_t wide_bytes = chunks * CHUNK_BYTES, bytes_per_col = linear_bytes_per_col(format, k_len);
    // Where x fits in half of L2, a thread takes its items one panel at a time, all its blocks of rows in turn (the
    // panel is read from memory once, x from L2). Beyond that, a group of panels (1 MB of weights, which stay
    // in L2) at a time, each block of rows across the whole group before the next (its rows of x stay in L1, and each
    // row's outputs are written in long runs): one panel at a time had read x from memory again for every panel,
    // which on SmolLM2's 2048-row prefills took the tile unit to half of oneDNN's speed. No order moves a bit: each
    // block is computed alone.
    const int64_t group = amx_item_group(m_len, k_len, wide_bytes, row_parts);  // in items
    const int stream = format && blocks == 1;  // widen a chunk at a time (see the top)
    float* xsum = NULL;
    if (format == 2) {
        xsum = malloc(m_len * chunks * sizeof(float));
        linear_int4_group_sums(x, ldx, m_len, chunks, xsum);
    }
    _Pragma("omp parallel if (linear_parallel(m_len, n_len, k_len))") {
        float c[2 * BLOCK_ROWS][LINEAR_PANEL_COLS] __attribute__((aligned(64)));  // int4 takes two halves
        __m512 acc[BLOCK_ROWS][NV];
        int configured = 0;  // the rows the tiles are configured for (each thread has its own tile state)
        const int64_t items = panels * row_parts, threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t mine_end = items * (me + 1) / threads;
        // Quantized panels, widened; for int4 then the group's panels' runs (run_starts).
        const int64_t wide_len = stream ? 4 * CHUNK_BYTES : group * wide_bytes;
        char* wide = !format ? NULL : scratch(wide_len + (format == 2 ? group * chunks : 0));
        uint8_t* starts = format == 2 ? (uint8_t*)wide + wide_len : NULL;
        for (int64_t g0 = items * me / threads; g0 < mine_end; g0 += group) {
            const int64_t g_end = g0 + group < mine_end ? g0 + group : mine_end;
            for (int64_t item = g0; starts && item < g_end; item++) {
                const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
                run_starts(it.panel, it.nv, chunks, starts + (item - g0) * chunks);
            }
            for (int64_t item = g0; format && !stream && item < g_end; item++) {  // the group's panels widened
                const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
                char* to = wide + (item - g0) * wide_bytes;
                for (int64_t g = 0; g < chunks; g++)
                    widen_chunk(format, it.panel, it.nv, chunks, g, to + g * (CHUNK_BYTES / NV) * it.nv);
            }
            for (int64_t t = 0; t < blocks; t++) {
                const int64_t m0 = t * BLOCK_ROWS;
                const int mr = m_len - m0 < BLOCK_ROWS ? (int)(m_len - m0) : BLOCK_ROWS;
                for (int64_t item = g0; item < g_end; item++) {
                    const int64_t part = item % row_parts;
                    if (t < part * blocks / row_parts || t >= (part + 1) * blocks / row_parts) continue;
                    const PanelItem it = panel_item(packed, item, row_parts, n_len, bytes_per_col);
                    const Panel p = {!format ? it.panel : stream ? NULL : wide + (item - g0) * wide_bytes, it.panel,
                                     wide, format, chunks, starts ? starts + (item - g0) * chunks : NULL};
                    if (mr != configured) configure(configured = mr);
                    const float* xs = xsum ? xsum + m0 * chunks : NULL;
                    if (it.nv == NV) block(x + m0 * ldx, ldx, mr, &p, NV, chunks, xs, c, acc);
                    else if (it.nv == 2) block(x + m0 * ldx, ldx, mr, &p, 2, chunks, xs, c, acc);
                    else block(x + m0 * ldx, ldx, mr, &p, 1, chunks, xs, c, acc);
                    store_linear_tile(format == 2 ? acc : (__m512(*)[NV])c, mr, it.nv, it.cols, bias ? bias + it.n0 : 0,
                                      out + m0 * ldo + it.n0, ldo);
                }
            }
        }
        if (configured) _tile_release();
    }
    free(xsum);
    return 1;
}
#else
int linear_amx_available(void) { return 0; }
int linear_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
               uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len) {
    (void)x, (void)ldx, (void)m_len, (void)packed, (void)format, (void)bias, (void)out, (void)ldo, (void)n_len;
    (void)k_len;
    return 0;
}
#endif
