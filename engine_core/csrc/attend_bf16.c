// Paged attention of a tile of prefill query rows (up to 8) over bf16 K/V, scoring 16 keys at a time.
// For each 16-key slice of a block and each KV head:
//   - the keys are transposed once (keys_as_lanes) so that lane t of vector p holds key t's dims 2p and 2p + 1,
//     the pair layout of vdpbf16ps: one instruction per dim pair and query head then scores all 16 keys in
//     fp32, with no horizontal sum per key (those were most of the row-at-a-time kernels' time);
//   - after a 16-lane online-softmax step, the values of two keys are interleaved into the instruction's pairs, and
//     every row and query head of the tile adds both keys' weighted values in one instruction per 16 dims, with
//     the weights rounded to bf16 (as in csrc/decode_bf16.c; 2048 query rows over 4096 keys: 70 -> 49 ms a layer).
// q stays unscaled bf16, so each product is exact; the scale multiplies the fp32 scores. Needs head_dim % 32 == 0
// and block_size % 16 == 0 (attend_bf16_takes); the callers keep their row-at-a-time paths for other shapes.
#include "kernel_common.h"

#if defined(__AVX512BF16__)
// Up to 16 bf16 key rows of one head (rows `stride` elements apart; rows past n read as zero), transposed
// to out[pairs]: lane t of out[p] holds row t's elements 2p and 2p + 1. pairs = head_dim / 2, a multiple of 16.
// Each 16 x 16 tile of 32-bit pairs is transposed by four butterfly rounds; round b swaps b x b sub-blocks.
static inline void keys_as_lanes(const uint16_t* rows, int64_t stride, int n, int pairs, __m512i* out) {
    static const int32_t lo[4][16] = {
        {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
        {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
    static const int32_t hi[4][16] = {
        {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
        {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    for (int c = 0; c < pairs; c += 16) {
        __m512i* r = out + c;
        for (int t = 0; t < 16; t++)
            r[t] = t < n ? _mm512_loadu_si512((const void*)(rows + t * stride + 2 * c)) : _mm512_setzero_si512();
        for (int round = 0, b = 1; round < 4; round++, b <<= 1) {
            const __m512i vlo = _mm512_loadu_si512((const void*)lo[round]);
            const __m512i vhi = _mm512_loadu_si512((const void*)hi[round]);
            for (int i = 0; i < 16; i++) {
                if (i & b) continue;
                const __m512i a = r[i], d = r[i + b];
                r[i] = _mm512_permutex2var_epi32(a, vlo, d);
                r[i + b] = _mm512_permutex2var_epi32(a, vhi, d);
            }
        }
    }
}
int attend_bf16_takes(int head_dim, int block_size) {
    return head_dim % 32 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % 16 == 0;
}

// Rows r of the tile sit at positions first_pos + r and see keys [0, first_pos + r]; q rows are q_row_stride
// elements apart; out rows are num_q_heads * head_dim apart. rows <= ATTEND_MAX_ROWS, group <= ATTEND_MAX_GROUP.
// head_dim = 32 * chunks; inlined for each common chunk count, so that the compiler unrolls the loops over a row.
static inline __attribute__((always_inline)) void tile(
    const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
    int64_t first_pos, int rows, uint16_t* out, int num_q_heads, int num_kv_heads, const int chunks, int block_size,
    float scale) {
    const int head_dim = 32 * chunks, group = num_q_heads / num_kv_heads, pairs = head_dim / 2;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;
    const int64_t context = first_pos + rows;  // keys the last row sees
    // Accumulators in the order of add_paired_values (kernel_common.h).
    __m512 lo[rows][num_q_heads][chunks], hi[rows][num_q_heads][chunks], l[rows][num_q_heads];
    __m512i v_lo[8][chunks], v_hi[8][chunks];  // the slice's values of one head, paired by keys
    __m512i keys[ATTEND_MAX_DIM / 2];
    float m[rows][num_q_heads];
    // One slice of one KV head, in two passes over the tile's (row, query head) pairs, so that the pairs'
    // independent work overlaps instead of each pair waiting on its own chain (scores -> max -> e^x -> sums).
    float w[ATTEND_MAX_ROWS][ATTEND_MAX_GROUP][16];
    __m512 correction[ATTEND_MAX_ROWS][ATTEND_MAX_GROUP];
    int visible[ATTEND_MAX_ROWS];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < num_q_heads; i++) {
            for (int c = 0; c < chunks; c++) lo[r][i][c] = hi[r][i][c] = _mm512_setzero_ps();
            m[r][i] = NO_SCORE; l[r][i] = _mm512_setzero_ps();
        }
    for (int64_t start = 0; start < context; start += 16) {
        const int64_t b = start / block_size, in_block = start % block_size;
        const uint16_t* kb = k_cache + table[b] * block_elems + in_block * stride;
        const uint16_t* vb = v_cache + table[b] * block_elems + in_block * stride;
        const int n = (int)(context - start < 16 ? context - start : 16);
        for (int r = 0; r < rows; r++) {  // keys of this slice row r may see: a prefix of it
            const int64_t seen = first_pos + r + 1 - start;
            visible[r] = seen <= 0 ? 0 : seen > n ? n : (int)seen;
        }
        // The same slice of the next block is fetched while this one is used, a row at a time.
        const int64_t next = start + block_size < context ? table[b + 1] * block_elems + in_block * stride : -1;
        for (int h = 0; h < num_kv_heads; h++) {
            keys_as_lanes(kb + h * head_dim, stride, n, pairs, keys);
            for (int k = 0; k < (n + 1) / 2; k++) {  // value rows of keys 2k and 2k + 1 in the pair layout
                if (h == 0 && next >= 0)
                    for (int t = 2 * k; t < 2 * k + 2 && t < n; t++)
                        prefetch_rows(k_cache + next + t * stride, v_cache + next + t * stride, stride * 2);
                const uint16_t* row = vb + 2 * k * stride + h * head_dim;
                pair_values(row, 2 * k + 1 < n ? row + stride : NULL, chunks, v_lo[k], v_hi[k]);
            }
            for (int r = 0; r < rows; r++) {  // scores and softmax
                if (!visible[r]) continue;
                const uint32_t* qr = (const uint32_t*)(q + r * q_row_stride);
                for (int g = 0; g < group; g++) {
                    const int i = h * group + g;
                    const uint32_t* qh = qr + i * pairs;
                    __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    for (int p = 0; p < pairs; p += 4)  // four chains: a dot product takes several cycles
                        for (int c = 0; c < 4; c++) {
                            const __m512bh qp = (__m512bh)_mm512_set1_epi32(qh[p + c]);
                            s[c] = _mm512_dpbf16_ps(s[c], (__m512bh)keys[p + c], qp);
                        }
                    const __m512 sum = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
                    const __m512 scores = _mm512_mul_ps(sum, vscale);
                    correction[r][g] = softmax16(scores, visible[r], &m[r][i], &l[r][i], w[r][g]);
                }
            }
            for (int r = 0; r < rows; r++)  // weighted values into the accumulators, two keys per instruction
                for (int g = 0; g < (visible[r] ? group : 0); g++)
                    add_paired_values(lo[r][h * group + g], hi[r][h * group + g], correction[r][g], w[r][g], v_lo[0],
                                      v_hi[0], (visible[r] + 1) / 2, chunks);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < num_q_heads; i++) {
            uint16_t* o = out + ((int64_t)r * num_q_heads + i) * head_dim;
            const float sum = _mm512_reduce_add_ps(l[r][i]);
            const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
            for (int c = 0; c < chunks; c++) store_unpaired_bf16(lo[r][i][c], hi[r][i][c], inv, o + 32 * c);
        }
}

void attend_bf16_tile(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int64_t* table, int64_t first_pos, int rows, uint16_t* out, int num_q_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale) {
#define TILE(CHUNKS) tile(q, q_row_stride, k_cache, v_cache, table, first_pos, rows, out, num_q_heads, num_kv_heads, \
                          CHUNKS, block_size, scale)
    switch (head_dim / 32) {
        case 2: TILE(2); break;  // heads of 64
        case 4: TILE(4); break;  // heads of 128
        default: TILE(head_dim / 32);
    }
#undef TILE
}
#else
int attend_bf16_takes(int head_dim, int block_size) { (void)head_dim; (void)block_size; return 0; }
#endif
