// Prefill attention tiles on Intel AMX: csrc/attend_bf16.c's plan (a tile's 16 query rows in the lanes, 16 keys a
// slice, a lane-wise online softmax), with both products on the tile unit instead of the dot instruction:
//   - scores, S^T = K Q^T (16 keys x 16 rows): the A tile is the slice's key rows read from the cache as they lie
//     (32 dims a tile, rows a cache row apart), the B tile the rows' query pairs (tile_queries: row r in column r).
//     Stored, the C tile is one vector of the 16 rows' scores per key: the layout the softmax works in;
//   - values, O += P V (16 rows x 16 dims a C tile): the A tile is the rows' bf16 weights, turned from the softmax's
//     key-major vectors into row-major pairs (weights_tile); the B tile the slice's values of keys 2k and 2k + 1
//     interleaved per dim (pair_slice, once per KV head for all its query heads). O stays in memory between slices,
//     where the softmax's rescaling reaches it; a slice adds to it on the tile unit.
// Every output is a sum in a fixed order over its own row's scores and weights, so a query row's bits never depend
// on the rest of its tile or chunk (a prefix-cache hit needs that), as in csrc/attend_bf16.c. Keys a row may not see
// get a weight of exactly 0; value rows past the context are zeros, never stale memory times 0.
// On a 2-vCPU Sapphire Rapids csrc/attend_bf16.c ran the last 2048-row chunk of an 8k prompt at ~170 GFLOP/s.
#include "kernel_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KEYS SLICE_KEYS
#define ROWS ATTEND_BF16_ROWS
#define MAX_TILES 4
#define RUN_KEYS 64  // keys a call's tiles take in turn

int attend_amx_takes(int head_dim, int block_size) {
    return head_dim % 32 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % KEYS == 0 && linear_amx_available();
}

// Tiles: 0 scores (C, keys x rows, fp32); 1 keys (A, keys x 32 dims); 2 queries (B, 16 dim pairs x rows);
// 3 weights (A, rows x keys); 4 values (B, key pairs x 16 dims); 5 output (C, rows x 16 dims, fp32).
static void configure_tiles(void) {
    static const uint8_t rows[6] = {KEYS, KEYS, 16, ROWS, KEYS / 2, ROWS};
    static const uint16_t bytes[6] = {64, 64, 64, 2 * KEYS, 64, 64};
    AmxTileConfig cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = bytes[t];
    _tile_loadconfig(&cfg);
}

// The slice's values as the B tiles want them: vp[k][d] = the bf16 pair (value of key 2k, value of key 2k + 1) of
// dim d, dims in order; keys past n are zeros.
static inline __attribute__((always_inline)) void pair_slice(const uint16_t* rows, int64_t stride, int n,
                                                             int head_dim, uint32_t (*vp)[ATTEND_MAX_DIM]) {
    // Word 2i of a result: dim i of key 2k (a's word i), word 2i + 1: of key 2k + 1 (b's word i, index 32 + i);
    // dims 16-31 of the 32 loaded take 16 more.
    static const uint16_t first[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t second[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_loadu_si512((const void*)first), hi = _mm512_loadu_si512((const void*)second);
    for (int k = 0; k < KEYS / 2; k++)
        for (int d = 0; d < head_dim; d += 32) {
            const __m512i a = 2 * k < n ? _mm512_loadu_si512((const void*)(rows + 2 * k * stride + d))
                                        : _mm512_setzero_si512();
            const __m512i b = 2 * k + 1 < n ? _mm512_loadu_si512((const void*)(rows + (2 * k + 1) * stride + d))
                                            : _mm512_setzero_si512();
            _mm512_store_si512((void*)&vp[k][d], _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512((void*)&vp[k][d + 16], _mm512_permutex2var_epi16(a, hi, b));
        }
}

// The slice's weights as an A tile: pa[r][k] = row r's bf16 pair of keys 2k and 2k + 1, rounded as transformers'
// eager bf16 attention rounds them. cvtne2ps_pbh gives w[k] with row r's weight of key 2k in word r, of key 2k + 1
// in word 16 + r; an 8 x 16 transpose of pairs follows, in three steps that each swap bit b of the vector index
// (k) with bit b of the 32-bit lane (r). After them vector v holds row v in lanes 0-7 and row v + 8 in lanes 8-15.
static inline __attribute__((always_inline)) void weights_tile(const __m512* s, uint32_t (*pa)[KEYS / 2]) {
    // Step 0 pairs x = w[v] (v even) with y = w[v + 1] and also forms the pairs: lane L of the new x is row L's pair
    // of x where L is even, of y (row L - 1) where odd; lane L of the new y row L + 1's of x where even, row L's of y
    // where odd. As words of the two (32 + i is y's word i): word 2L + h from word 16h + (L & ~1) or 16h + (L | 1).
    static const uint16_t pair_x[32] = {0, 16, 32, 48, 2,  18, 34, 50, 4,  20, 36, 52, 6,  22, 38, 54,
                                        8, 24, 40, 56, 10, 26, 42, 58, 12, 28, 44, 60, 14, 30, 46, 62};
    static const uint16_t pair_y[32] = {1, 17, 33, 49, 3,  19, 35, 51, 5,  21, 37, 53, 7,  23, 39, 55,
                                        9, 25, 41, 57, 11, 27, 43, 59, 13, 29, 45, 61, 15, 31, 47, 63};
    // Steps 1 and 2 (bit 2, 4) on 32-bit lanes: the new x takes lane i from x where bit b of i is clear, else y's
    // lane i & ~bit; the new y x's lane i | bit, else y's lane i. 16 + i is y's lane i.
    static const int32_t to_x[2][16] = {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}};
    static const int32_t to_y[2][16] = {{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                                        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}};
    __m512i w[KEYS / 2];
    const __m512i px = _mm512_loadu_si512((const void*)pair_x), py = _mm512_loadu_si512((const void*)pair_y);
    for (int v = 0; v < KEYS / 2; v += 2) {
        const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(s[2 * v + 1], s[2 * v]);
        const __m512i y = (__m512i)_mm512_cvtne2ps_pbh(s[2 * v + 3], s[2 * v + 2]);
        w[v] = _mm512_permutex2var_epi16(x, px, y);
        w[v + 1] = _mm512_permutex2var_epi16(x, py, y);
    }
    for (int b = 1; b < 3; b++) {
        const int bit = 1 << b;
        const __m512i ix = _mm512_loadu_si512((const void*)to_x[b - 1]);
        const __m512i iy = _mm512_loadu_si512((const void*)to_y[b - 1]);
        for (int v = 0; v < KEYS / 2; v++)
            if (!(v & bit)) {
                const __m512i x = w[v], y = w[v | bit];
                w[v] = _mm512_permutex2var_epi32(x, ix, y);
                w[v | bit] = _mm512_permutex2var_epi32(x, iy, y);
            }
    }
    for (int v = 0; v < KEYS / 2; v++) {
        _mm256_store_si256((__m256i*)pa[v], _mm512_castsi512_si256(w[v]));
        _mm256_store_si256((__m256i*)pa[v + 8], _mm512_extracti64x4_epi64(w[v], 1));
    }
}

// The rows one call may take: up to 4 tiles of 16, so that each slice's keys and values, read and paired once,
// serve them all (at 8k keys a KV head's K and V fill this CPU's L2), as many as fit a 256 KiB stack.
int attend_amx_rows(int group, int head_dim) {
    const int64_t tile_state = (int64_t)group * (head_dim / 2 * 64 + ROWS * head_dim * 4);  // queries + outputs
    const int64_t tiles = (256 << 10) / tile_state;
    return ROWS * (int)(tiles < 1 ? 1 : tiles > MAX_TILES ? MAX_TILES : tiles);
}

// Where key `key` of a sequence lies in a cache of its block table.
static inline int64_t key_row(const int64_t* table, int64_t key, int block_size, int64_t block_elems,
                              int64_t stride) {
    return table[key / block_size] * block_elems + key % block_size * stride;
}

// One tile's slice for one query head: scores on the tile unit, the softmax, the weighted values added to o
// (16 rows x head_dim fp32, row-major); qt: the rows' query pairs; at: the slice's first key row of this KV head.
static inline __attribute__((always_inline)) void attend_slice(const __m512i* qt, const uint16_t* keys,
                                                               int64_t stride, const __mmask16* visible,
                                                               __m512 vscale, uint32_t (*vp)[ATTEND_MAX_DIM],
                                                               int head_dim, __m512* m, __m512* l, float* o) {
    __attribute__((aligned(64))) float scores[KEYS][ROWS], factor[ROWS];
    __attribute__((aligned(64))) uint32_t pa[ROWS][KEYS / 2];
    __m512 s[KEYS];
    // Key rows past the context are stale cache memory: visible masks their scores out, whatever they hold.
    _tile_zero(0);
    for (int d = 0; d < head_dim; d += 32) {
        _tile_loadd(1, keys + d, stride * 2);
        _tile_loadd(2, &qt[d / 2], 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores, sizeof scores[0]);
    for (int t = 0; t < KEYS; t++) s[t] = _mm512_load_ps(scores[t]);
    const __m512 c = fold_slice(s, visible, vscale, m, l);
    weights_tile(s, pa);
    if (_mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.f))) {  // x * 1 is x: skip it
        _mm512_store_ps(factor, c);
        for (int r = 0; r < ROWS; r++)
            for (int d = 0; d < head_dim; d += 16)
                _mm512_store_ps(o + r * head_dim + d,
                                _mm512_mul_ps(_mm512_load_ps(o + r * head_dim + d), _mm512_set1_ps(factor[r])));
    }
    _tile_loadd(3, pa, sizeof pa[0]);
    for (int d = 0; d < head_dim; d += 16) {
        _tile_loadd(5, o + d, head_dim * 4);
        _tile_loadd(4, &vp[0][d], sizeof vp[0]);
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(5, o + d, head_dim * 4);
    }
}

// Rows r of the call sit at positions first_pos + r and see keys [0, first_pos + r] (with a sliding window, its
// last `window` of them); q rows are q_row_stride elements apart; out rows are num_q_heads * head_dim apart.
// rows <= attend_amx_rows(group, head_dim): tiles of 16 (the last one shorter), each walking the keys it sees.
void attend_amx_tile(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int64_t* table, int64_t first_pos, int rows, uint16_t* out, int num_q_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale, int64_t window) {
    const int group = num_q_heads / num_kv_heads, pairs = head_dim / 2, tiles = (rows + ROWS - 1) / ROWS;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;
    const int64_t context = first_pos + rows;  // keys the last row sees
    __m512i qt[tiles][group][pairs];
    __m512 o[tiles][group][ROWS * head_dim / 16], m[tiles][group], l[tiles][group];  // o: rows x head_dim
    __attribute__((aligned(64))) uint32_t vp[RUN_KEYS / KEYS][KEYS / 2][ATTEND_MAX_DIM];
    TileSight sight[tiles];
    int64_t walk[tiles], seen[tiles];  // each tile's slices: [walk, seen)
    for (int i = 0; i < tiles; i++) {
        const int n = rows - ROWS * i < ROWS ? rows - ROWS * i : ROWS;
        sight[i] = tile_sight(first_pos + ROWS * i, n, window);
        walk[i] = window_walk_start(first_pos + ROWS * i + 1, window, KEYS), seen[i] = first_pos + ROWS * i + n;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    configure_tiles();
    for (int h = 0; h < num_kv_heads; h++) {
        for (int i = 0; i < tiles; i++)
            for (int g = 0; g < group; g++) {
                const int n = rows - ROWS * i < ROWS ? rows - ROWS * i : ROWS;
                tile_queries(q + ROWS * i * q_row_stride + (h * group + g) * head_dim, q_row_stride, n, pairs,
                             qt[i][g]);
                memset(o[i][g], 0, sizeof o[i][g]);
                m[i][g] = _mm512_set1_ps(NO_SCORE), l[i][g] = _mm512_setzero_ps();
            }
        // The keys a run of slices at a time: each tile takes the run's slices in turn while their keys and
        // values stay in this core's caches.
        for (int64_t run = walk[0]; run < context; run += RUN_KEYS) {
            const int64_t end = context - run < RUN_KEYS ? context : run + RUN_KEYS;
            for (int64_t start = run; start < end; start += KEYS) {
                const int n = (int)(context - start < KEYS ? context - start : KEYS);
                pair_slice(v_cache + key_row(table, start, block_size, block_elems, stride) + h * head_dim, stride,
                           n, head_dim, vp[(start - run) / KEYS]);
            }
            for (int i = 0; i < tiles; i++)
                for (int64_t start = run > walk[i] ? run : walk[i]; start < end && start < seen[i]; start += KEYS) {
                    const uint16_t* keys = k_cache + key_row(table, start, block_size, block_elems, stride) +
                                           h * head_dim;
                    __mmask16 visible[KEYS];
                    slice_visible(sight[i], start, visible);
                    for (int g = 0; g < group; g++)
                        attend_slice(qt[i][g], keys, stride, visible, vscale, vp[(start - run) / KEYS], head_dim,
                                     &m[i][g], &l[i][g], (float*)o[i][g]);
                }
        }
        for (int i = 0; i < tiles; i++)
            for (int g = 0; g < group; g++) {
                float inv[ROWS];
                _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[i][g]));  // l >= 1: the max's own weight
                const float* oi = (const float*)o[i][g];
                for (int r = 0; r < ROWS && ROWS * i + r < rows; r++) {
                    uint16_t* row = out + ((int64_t)(ROWS * i + r) * num_q_heads + h * group + g) * head_dim;
                    for (int d = 0; d < head_dim; d += 16)
                        _mm256_storeu_si256((__m256i*)(row + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                                                     _mm512_load_ps(oi + r * head_dim + d),
                                                                     _mm512_set1_ps(inv[r]))));
                }
            }
    }
    _tile_release();
}
#else
int attend_amx_takes(int head_dim, int block_size) { (void)head_dim, (void)block_size; return 0; }
int attend_amx_rows(int group, int head_dim) { (void)group, (void)head_dim; return 0; }
#endif
