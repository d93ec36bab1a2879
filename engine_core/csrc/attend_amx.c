// Prefill attention tiles on Intel AMX: csrc/attend_bf16.c's plan (a tile's 16 query rows in the lanes, the keys a
// slice at a time, a lane-wise online softmax), with both products on the tile unit instead of the dot instruction,
// 32 keys a slice (two halves of 16, each inside one cache block, as block sizes are multiples of 16):
//   - scores, S^T = K Q^T (16 keys x 16 rows per half): the A tile is the half's key rows read from the cache as they
//     lie (32 dims a tile, rows a cache row apart), the B tile the rows' query pairs (tile_queries: row r in column
//     r), which serves both halves. Stored, the C tiles are one vector of the 16 rows' scores per key: the layout
//     the softmax works in;
//   - values, transposed, O^T += V^T P^T (16 dims x 16 rows a C tile): the B tile is the rows' bf16 weights of the
//     32 keys as pairs of keys 2k, 2k + 1 per row (pair_weights: one conversion and one permutation per key pair,
//     as the softmax's vectors already hold one key's 16 rows), the A tile the slice's values turned into dims x
//     key pairs (value_tiles, once per KV head for all its query heads and tiles). O^T stays in memory between
//     slices, one vector of the 16 rows per dim, so the softmax's rescaling is one multiply per dim; a slice adds to
//     it on the tile unit, and each 16 x 16 block is transposed back into rows once, at the end.
// Every output is a sum in a fixed order over its own row's scores and weights, so a query row's bits never depend
// on the rest of its tile or chunk (a prefix-cache hit needs that), as in csrc/attend_bf16.c. Keys a row may not see
// get a weight of exactly 0; value rows past the context are zeros, never stale memory times 0.
// A call takes up to 8 tiles, which walk each run of 64 keys in turn: a KV head's keys and values are read and
// laid out once per 128 rows while they sit in the core's caches. On 2 vCPUs of an AMX Xeon the last 2048-row chunk of
// an 8k prompt ran at 158-161 GFLOP/s in csrc/attend_bf16.c, 679-718 here (bench.prefill_kernel, one layer of
// SmolLM2's heads), where the softmax's exponentials and the weights' transposes take most of the time; with 16-key
// slices (twice the tile loads and stores per key) that chunk took 53-55 ms against 45-48 in the same runs. Then
// 40.5 -> 32.9-34.1 ms: the softmax's max and sum in four independent chains (one chain of 32 dependent maxes was
// the slice's longest wait), 2^x weights (exp2_weight), four C tiles for O += P V in place of one, 8 tiles a call in
// place of 4, and no mask compares for slices every row sees whole; then 36.0-36.6 -> 29.8-31.8 ms: O += P V
// turned into O^T += V^T P^T, whose weights need one permutation per key pair where P's row-major pairs had needed a
// 16 x 16 transpose per slice and head. Prefetching the next run's rows, and value tiles laid out contiguously,
// measured no faster.
#include "kernel_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KEYS 32  // keys a slice: two halves of 16, each inside one cache block
#define HALF 16
#define ROWS ATTEND_BF16_ROWS
#define MAX_TILES 8
#define RUN_KEYS 64  // keys a call's tiles take in turn

int attend_amx_takes(int head_dim, int block_size) {
    return head_dim % 32 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % HALF == 0 && linear_amx_available();
}

// Every tile is 16 rows of 64 bytes. Scores: 0, 1 the slice's two halves (C, keys x rows, fp32); 2 queries (B, 16
// dim pairs x rows); 3 keys (A, 16 keys x 32 dims). Then values: 4 weights (A, rows x 32 keys); 0, 1, 6, 7 output
// (C, rows x 16 dims, fp32); 5, 3, 2 values (B, 16 key pairs x 16 dims).
static void configure_tiles(void) {
    AmxTileConfig cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// The slice's values as A tiles of V^T, one per 16 dims: vt[d / 16][d % 16][k] = the bf16 pair (value of key 2k,
// value of key 2k + 1) of dim d; keys past n are zeros. half[h]: the row of key 16h (NULL where n <= 16h). Each
// pair of key rows is interleaved per dim, then each 16 x 16 block of pairs transposed (swap_index_bit), once per
// KV head for all the jobs of the run.
static inline __attribute__((always_inline)) void value_tiles(const uint16_t* const* half, int64_t stride, int n,
                                                              int head_dim, uint32_t (*vt)[16][KEYS / 2]) {
    // Word 2i of a result: dim i of key 2k (a's word i), word 2i + 1: of key 2k + 1 (b's word i, index 32 + i);
    // dims 16-31 of the 32 loaded take 16 more.
    static const uint16_t first[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t second[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_loadu_si512((const void*)first), hi = _mm512_loadu_si512((const void*)second);
    for (int d = 0; d < head_dim; d += 32) {
        __m512i v[2][KEYS / 2];  // v[h][k]: the pairs of key pair k, dims d + 16h .. d + 16h + 15
        for (int k = 0; k < KEYS / 2; k++) {
            if (2 * k >= n) {
                v[0][k] = v[1][k] = _mm512_setzero_si512();
                continue;
            }
            const uint16_t* a = half[2 * k / HALF] + 2 * k % HALF * stride;  // key 2k; key 2k + 1 is the next row
            const __m512i va = _mm512_loadu_si512((const void*)(a + d));
            const __m512i vb = 2 * k + 1 < n ? _mm512_loadu_si512((const void*)(a + stride + d))
                                             : _mm512_setzero_si512();
            v[0][k] = _mm512_permutex2var_epi16(va, lo, vb);
            v[1][k] = _mm512_permutex2var_epi16(va, hi, vb);
        }
        for (int h = 0; h < 2; h++) {
            for (int b = 0; b < 4; b++) swap_index_bit(v[h], KEYS / 2, b);  // v[h][j] lane k: dim d + 16h + j
            for (int j = 0; j < 16; j++) _mm512_store_si512((void*)vt[d / 16 + h][j], v[h][j]);
        }
    }
}

// The rows one call may take: up to 8 tiles of 16, so that each slice's keys and values, read and laid out once,
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

// One tile's slice for one query head, in two parts: slice_scores computes the scores on the tile unit into s (raw,
// one vector of the 16 rows per key); slice_values folds them into the softmax and adds the weighted values to ot
// (ot[d]: dim d of the 16 rows, fp32). The caller issues the next head's scores before this head's values, so the
// tile unit works while the vector unit takes the exponentials. qt: the rows' query pairs; keys[h]: the first key
// row of half h in this KV head; halves: 1 where the tile sees none of the second half's keys (its scores and
// weights are then zeros and take no exponentials); vt: the slice's values as V^T tiles (value_tiles).
static inline __attribute__((always_inline)) void slice_scores(const __m512i* qt, const uint16_t* const* keys,
                                                               int halves, int64_t stride, int head_dim, __m512* s) {
    // Key rows past the context are stale cache memory: visible masks their scores out, whatever they hold.
    _tile_zero(0);
    _tile_zero(1);
    for (int d = 0; d < head_dim; d += 32) {
        _tile_loadd(2, &qt[d / 2], 64);
        _tile_loadd(3, keys[0] + d, stride * 2);
        _tile_dpbf16ps(0, 3, 2);
        if (halves > 1) {
            _tile_loadd(3, keys[1] + d, stride * 2);
            _tile_dpbf16ps(1, 3, 2);
        }
    }
    // Stored straight into s (a copy from a scores buffer had cost a 2 KB memcpy a slice).
    _tile_stored(0, &s[0], sizeof s[0]);
    _tile_stored(1, &s[HALF], sizeof s[0]);
}

static inline __attribute__((always_inline)) void slice_values(__m512* s, int halves, const __mmask16* visible,
                                                               __m512 vscale, uint32_t (*vt)[16][KEYS / 2],
                                                               int head_dim, __m512* m, __m512* l, __m512* ot) {
    __m512i pb[KEYS / 2];  // the B tile of the weights: row k, key pair k of the 16 rows (pair_weights)
    const __m512 c = halves > 1 ? fold_slice(s, visible, KEYS, vscale, m, l)
                                : fold_slice(s, visible, HALF, vscale, m, l);
    pair_weights(s, KEYS / 2, pb);
    if (_mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.f)))  // x * 1 is x: skip it
        for (int d = 0; d < head_dim; d++) ot[d] = _mm512_mul_ps(ot[d], c);
    // O^T += V^T P^T, 64 dims at a time in four C tiles (0, 1, 6, 7), each with its own A tile (5, 3, 2, 5 again),
    // so that the products overlap: one C tile for all dims made each load wait for the store before it.
    _tile_loadd(4, pb, sizeof pb[0]);
    for (int d = 0; d < head_dim; d += 64) {
        const int wide = head_dim - d >= 64;  // else 32 dims are left (head_dim % 32 == 0)
        _tile_loadd(0, &ot[d], 64);
        _tile_loadd(5, vt[d / 16], sizeof vt[0][0]);
        _tile_loadd(1, &ot[d + 16], 64);
        _tile_loadd(3, vt[d / 16 + 1], sizeof vt[0][0]);
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 3, 4);
        if (wide) {
            _tile_loadd(6, &ot[d + 32], 64);
            _tile_loadd(2, vt[d / 16 + 2], sizeof vt[0][0]);
            _tile_loadd(7, &ot[d + 48], 64);
            _tile_dpbf16ps(6, 2, 4);
            _tile_loadd(5, vt[d / 16 + 3], sizeof vt[0][0]);
            _tile_dpbf16ps(7, 5, 4);
        }
        _tile_stored(0, &ot[d], 64);
        _tile_stored(1, &ot[d + 16], 64);
        if (wide) {
            _tile_stored(6, &ot[d + 32], 64);
            _tile_stored(7, &ot[d + 48], 64);
        }
    }
}

// One tile's slice of a run: its tile, its slice in the run, the halves it sees and its rows' view of the keys.
typedef struct {
    int tile, slice, halves;
    __mmask16 visible[KEYS];
} Job;

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
    __m512 ot[tiles][group][head_dim], m[tiles][group], l[tiles][group];  // ot[d]: dim d of the tile's 16 rows
    __attribute__((aligned(64))) uint32_t vt[RUN_KEYS / KEYS][ATTEND_MAX_DIM / 16][16][KEYS / 2];
    TileSight sight[tiles];
    int64_t walk[tiles], seen[tiles];  // each tile's slices: [walk, seen)
    int tile_rows[tiles];
    for (int i = 0; i < tiles; i++) {
        tile_rows[i] = rows - ROWS * i < ROWS ? rows - ROWS * i : ROWS;
        sight[i] = tile_sight(first_pos + ROWS * i, tile_rows[i], window);
        walk[i] = window_walk_start(first_pos + ROWS * i + 1, window, KEYS);
        seen[i] = first_pos + ROWS * i + tile_rows[i];
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    configure_tiles();
    for (int h = 0; h < num_kv_heads; h++) {
        for (int i = 0; i < tiles; i++)
            for (int g = 0; g < group; g++) {
                tile_queries(q + ROWS * i * q_row_stride + (h * group + g) * head_dim, q_row_stride, tile_rows[i],
                             pairs, qt[i][g]);
                memset(ot[i][g], 0, sizeof ot[i][g]);
                m[i][g] = _mm512_set1_ps(NO_SCORE), l[i][g] = _mm512_setzero_ps();
            }
        // The keys a run of slices at a time: each tile takes the run's slices in turn while their keys and
        // values stay in this core's caches.
        for (int64_t run = walk[0]; run < context; run += RUN_KEYS) {
            const int64_t end = context - run < RUN_KEYS ? context : run + RUN_KEYS;
            const uint16_t* keys[RUN_KEYS / KEYS][2];
            int halves[RUN_KEYS / KEYS];
            for (int64_t start = run; start < end; start += KEYS) {
                const int j = (int)((start - run) / KEYS), n = (int)(context - start < KEYS ? context - start : KEYS);
                const uint16_t* values[2] = {NULL, NULL};
                halves[j] = n > HALF ? 2 : 1;
                for (int x = 0; x < halves[j]; x++) {
                    const int64_t at = key_row(table, start + HALF * x, block_size, block_elems, stride) + h * head_dim;
                    keys[j][x] = k_cache + at, values[x] = v_cache + at;
                }
                value_tiles(values, stride, n, head_dim, vt[j]);
            }
            // The run's jobs, a tile's slice each: every query head of the group in turn, each head's scores
            // issued before the previous head's values (the next slice's first head after the last one's).
            Job jobs[MAX_TILES * RUN_KEYS / KEYS];
            int count = 0;
            for (int i = 0; i < tiles; i++)
                for (int64_t start = run > walk[i] ? run : walk[i]; start < end && start < seen[i]; start += KEYS) {
                    Job* job = &jobs[count++];
                    job->tile = i, job->slice = (int)((start - run) / KEYS);
                    slice_visible(sight[i], start, KEYS, job->visible);
                    job->halves = seen[i] - start > HALF ? halves[job->slice] : 1;
                }
            __m512 s[2][KEYS];  // this head's scores and the next one's
            for (int n = -1; n < count * group; n++) {
                if (n + 1 < count * group) {
                    const Job* next = &jobs[(n + 1) / group];
                    slice_scores(qt[next->tile][(n + 1) % group], keys[next->slice], next->halves, stride, head_dim,
                                 s[(n + 1) & 1]);
                }
                if (n < 0) continue;
                const Job* job = &jobs[n / group];
                const int i = job->tile, g = n % group;
                slice_values(s[n & 1], job->halves, job->visible, vscale, vt[job->slice], head_dim, &m[i][g],
                             &l[i][g], ot[i][g]);
            }
        }
        // Each dim's 16 rows divided by the rows' sums (lane-wise), then each 16 x 16 block transposed into rows.
        for (int i = 0; i < tiles; i++)
            for (int g = 0; g < group; g++) {
                const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[i][g]);  // l >= 1: the max's own weight
                for (int d = 0; d < head_dim; d += 16) {
                    __m512i v[16];
                    for (int j = 0; j < 16; j++) v[j] = (__m512i)_mm512_mul_ps(ot[i][g][d + j], inv);
                    for (int b = 0; b < 4; b++) swap_index_bit(v, 16, b);  // v[r] lane j: row r, dim d + j
                    for (int r = 0; r < tile_rows[i]; r++)
                        _mm256_storeu_si256(
                            (__m256i*)(out + ((int64_t)(ROWS * i + r) * num_q_heads + h * group + g) * head_dim + d),
                            (__m256i)_mm512_cvtneps_pbh((__m512)v[r]));
                }
            }
    }
    _tile_release();
}
#else
int attend_amx_takes(int head_dim, int block_size) { (void)head_dim, (void)block_size; return 0; }
int attend_amx_rows(int group, int head_dim) { (void)group, (void)head_dim; return 0; }
#endif
