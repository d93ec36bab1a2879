// Paged attention of a tile of prefill query rows (up to 16) over bf16 K/V with the AVX512-BF16 dot instruction.
// The tile's rows lie in the 16 fp32 lanes: lane r of every vector belongs to query row r, so nothing is ever
// summed across lanes and the online softmax is lane-wise vector work (csrc/attend_avx2.c's plan, in bf16 pairs).
// For each KV head, and each 16-key slice of the context (one block holds it):
//   - the slice's value rows of keys 2k and 2k + 1 are interleaved once into the instruction's pairs, for the
//     group's query heads;
//   - a query head's scores: per dim pair, the rows' query pairs (one vector, built once per tile) times the
//     key's pair (one broadcast straight from the cache row), 16 keys in 16 independent chains: a vector of 16
//     rows' scores per key;
//   - the online softmax of the 16 keys: maxima, sums and the rescaling factor are lane-wise;
//   - the weighted values: per dim, the weights of keys 2k and 2k + 1 (one vector of pairs, rounded to bf16 as
//     transformers' eager bf16 attention rounds them) times their two values (one broadcast).
// The plan before this one held 16 keys in the lanes: it transposed each slice's keys per tile of 8 rows and took a
// horizontal max and a scalar branch per 16 keys and query head, which left most of the dot instruction's
// throughput unused: 150-185 GFLOP/s on the last 2048-row chunk of an 8k prompt here (bench.prefill_kernel).
// q stays unscaled bf16, so each product is exact; the scale multiplies the fp32 scores. Every query row is
// computed alone, in the same order whatever else is in its tile: slices start at key 0, and keys its row may not
// see get a weight of exactly 0. Needs head_dim % 32 == 0 and block_size % 16 == 0 (attend_bf16_takes).
#include "kernel_common.h"

#if defined(__AVX512BF16__)
#define KEYS 16

int attend_bf16_takes(int head_dim, int block_size) {
    return head_dim % 32 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % KEYS == 0;
}

// The dim that pair-layout accumulator i holds, where pair_values (kernel_common.h) wrote a slice's lo vectors
// (chunks of them, then the hi ones): lo of 32-dim chunk c gives dims 32c + 8j + 0..3 of each 128-bit lane j, hi
// dims 32c + 8j + 4..7.
static inline int paired_dim(int i, int chunks) {
    const int hi = i >= 16 * chunks, lane = i % 16;
    return 32 * ((i % (16 * chunks)) / 16) + 8 * (lane / 4) + lane % 4 + 4 * hi;
}

// The values of keys 2k and 2k + 1 of a slice (rows `stride` apart; rows past n are zeros, never stale
// memory times a zero weight) as vp[k][i]: one 32-bit pair per accumulator i (paired_dim order).
static inline __attribute__((always_inline)) void pair_slice_values(const uint16_t* rows, int64_t stride, int n,
                                                                    int head_dim, uint32_t (*vp)[ATTEND_MAX_DIM]) {
    const int chunks = head_dim / 32;
    for (int k = 0; k < KEYS / 2; k++) {
        __m512i* pairs = (__m512i*)vp[k];
        if (2 * k < n)
            pair_values(rows + 2 * k * stride, 2 * k + 1 < n ? rows + (2 * k + 1) * stride : NULL, chunks, pairs,
                        pairs + chunks);
        else
            memset(pairs, 0, (size_t)head_dim * sizeof(uint32_t));
    }
}

// One query head's scores for the slice's 16 keys (key t's row at keys + t * stride): s[t] = q . key t, the
// rows' query pairs in qt[p].
static inline __attribute__((always_inline)) void score16(const __m512i* qt, const uint16_t* keys, int64_t stride,
                                                          int pairs, __m512* s) {
    __m512 a[KEYS];
    for (int t = 0; t < KEYS; t++) a[t] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const __m512bh qp = (__m512bh)qt[p];
        for (int t = 0; t < KEYS; t++) {
            const uint32_t* key = (const uint32_t*)(keys + t * stride);
            a[t] = _mm512_dpbf16_ps(a[t], qp, (__m512bh)_mm512_set1_epi32((int)key[p]));
        }
    }
    for (int t = 0; t < KEYS; t++) s[t] = a[t];
}

// acc[i] = acc[i] * c + the weighted values of the slice: pw[k] holds each row's bf16 weights of keys 2k and
// 2k + 1, vp[k][i] their values of accumulator i. 16 accumulators at a time, in 16 chains.
static inline __attribute__((always_inline)) void add_values16(__m512* acc, __m512 c, int rescale, const __m512i* pw,
                                                               uint32_t (*vp)[ATTEND_MAX_DIM], int head_dim) {
    for (int i0 = 0; i0 < head_dim; i0 += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; j++) a[j] = rescale ? _mm512_mul_ps(acc[i0 + j], c) : acc[i0 + j];
        for (int k = 0; k < KEYS / 2; k++)
            for (int j = 0; j < 16; j++)
                a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)pw[k], (__m512bh)_mm512_set1_epi32((int)vp[k][i0 + j]));
        for (int j = 0; j < 16; j++) acc[i0 + j] = a[j];
    }
}

// Rows r of the tile sit at positions first_pos + r and see keys [0, first_pos + r] (with a sliding window, its
// last `window` of them); q rows are q_row_stride elements apart; out rows are num_q_heads * head_dim apart.
// rows <= ATTEND_BF16_ROWS.
void attend_bf16_tile(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int64_t* table, int64_t first_pos, int rows, uint16_t* out, int num_q_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale, int64_t window) {
    const int group = num_q_heads / num_kv_heads, pairs = head_dim / 2;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;
    const int64_t context = first_pos + rows;  // keys the last row of the tile sees
    __m512i qt[group][pairs];
    __m512 acc[group][head_dim], m[group], l[group], s[KEYS];
    __attribute__((aligned(64))) uint32_t vp[KEYS / 2][ATTEND_MAX_DIM];
    const TileSight sight = tile_sight(first_pos, rows, window);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h = 0; h < num_kv_heads; h++) {
        for (int g = 0; g < group; g++) {
            tile_queries(q + (h * group + g) * head_dim, q_row_stride, rows, pairs, qt[g]);
            for (int i = 0; i < head_dim; i++) acc[g][i] = _mm512_setzero_ps();
            m[g] = _mm512_set1_ps(NO_SCORE), l[g] = _mm512_setzero_ps();
        }
        for (int64_t start = window_walk_start(first_pos + 1, window, KEYS); start < context; start += KEYS) {
            const int n = (int)(context - start < KEYS ? context - start : KEYS);
            const int64_t at = table[start / block_size] * block_elems + start % block_size * stride + h * head_dim;
            pair_slice_values(v_cache + at, stride, n, head_dim, vp);
            __mmask16 visible[KEYS];
            slice_visible(sight, start, KEYS, visible);
            for (int g = 0; g < group; g++) {
                score16(qt[g], k_cache + at, stride, pairs, s);
                const __m512 c = fold_slice(s, visible, KEYS, vscale, &m[g], &l[g]);
                __m512i pw[KEYS / 2];
                pair_weights(s, KEYS / 2, pw);
                const int rescale = _mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.f)) != 0;  // x * 1 is x: skip it
                add_values16(acc[g], c, rescale, pw, vp, head_dim);
            }
        }
        for (int g = 0; g < group; g++) {
            float inv[16], sums[16];
            _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));  // l >= 1: the max's own weight
            for (int i = 0; i < head_dim; i++) {
                _mm512_storeu_ps(sums, acc[g][i]);
                const int d = paired_dim(i, head_dim / 32);
                for (int r = 0; r < rows; r++)
                    out[((int64_t)r * num_q_heads + h * group + g) * head_dim + d] = bf16_store(sums[r] * inv[r]);
            }
        }
    }
}
#else
int attend_bf16_takes(int head_dim, int block_size) { (void)head_dim; (void)block_size; return 0; }
#endif
