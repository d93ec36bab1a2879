// Decode attention (one query row per sequence, all heads) over paged bf16 K/V, 16 keys at a time, with the dot
// instruction of AVX512-BF16 on both sides; paged_decode_bf16 (csrc/paged_decode.c) hands it the whole call when
// head_dim % 32 == 0.
//   - scores: vdpbf16ps multiplies a key row in place with the unscaled bf16 query (each product exact in fp32),
//     leaving one vector of partial sums per key; sum_lanes16 adds 16 keys' vectors into one vector of their
//     scores with about three shuffles per key, where a horizontal sum per key took about nine;
//   - softmax: 16 lanes at once (softmax16), the scale applied to the fp32 scores;
//   - values: the rows of two keys are interleaved into the instruction's pair layout, and each query head adds
//     both keys' weighted values in one instruction per 16 dims, with the weights rounded to bf16 (as
//     transformers' eager bf16 attention rounds them before its matmul with V); sums stay fp32.
// Against the key-at-a-time vector path, SmolLM2's 30 layers (9/3 heads of 64) at batch 64 and 192 keys went
// from 11.0 to 8.1 ms (26 to 35 GB/s from memory, of the 40 that streaming the same blocks reaches).
// Work items are sequences, and parts of SPLIT_KEYS keys of longer ones, combined at the end: a lone sequence of
// 4096 keys (30 layers) took 4.9 ms in one thread, 3.4 ms in parts. Consecutive rows on the same blocks (a
// request's draft rows, the outputs a recompute replays) share a work item and each slice's loads, each row
// keeping its own arithmetic: 1536 replayed rows of one sequence (513 to 2048 keys, 30 layers) 1.63 -> 1.43 s,
// 5 draft rows at 4096 keys 18.7 -> 16.4 ms.
#include <omp.h>
#include <stdlib.h>

#include "kernel_common.h"

#if defined(__AVX512BF16__)

// A sequence longer than this many keys is attended in parts of this size (rounded to whole blocks), each by
// any thread, then combined: one long sequence alone would leave every thread but one idle.
#define SPLIT_KEYS 512
// Rows attended together in one work item at most, and the bytes of their accumulators (L1 holds them beside a slice).
#define GROUP_ROWS 8
#define GROUP_STATE_BYTES 32768

// What a block's work fetches ahead: the same rows of the next block into L1, and this block's share of the
// blocks of the sequence the thread likely takes next (far) into L2.
typedef struct {
    const uint16_t *k_cache, *v_cache;
    int64_t next;  // element offset of the next block (this one for the last block)
    const int64_t* far_table;
    int64_t far_from, far_to, block_elems, stride;
    int block_size;
} Ahead;

// Share `slot` of `slots` of the prefetches for the 16 rows from s0: the slice's work calls it at evenly spread
// points rather than in one burst, which holds up the demand loads waiting for the same miss buffers (all of a
// slice's at once: 19 ms for the 30 layers above instead of 8.4).
static inline __attribute__((always_inline)) void prefetch_share(const Ahead* a, int s0, int slot, int slots) {
    const int end = s0 + 16 < a->block_size ? s0 + 16 : a->block_size;
    for (int t = s0 + slot * 16 / slots; t < s0 + (slot + 1) * 16 / slots && t < end; t++) {
        const int64_t row = t * a->stride;
        prefetch_rows(a->k_cache + a->next + row, a->v_cache + a->next + row, a->stride * 2);
        for (int64_t f = a->far_from; f < a->far_to; f++)
            prefetch_rows_l2(a->k_cache + a->far_table[f] * a->block_elems + row,
                             a->v_cache + a->far_table[f] * a->block_elems + row, a->stride * 2);
    }
}

// One query row of a work item: its keys in the item's part, and where its result goes: the normalized output to
// out, or with `part` its state there instead (per query head: the running max, the sum of weights, the
// unnormalized output).
typedef struct {
    const uint16_t* q;
    int64_t keys;
    uint16_t* out;
    float* part;
    int skip;  // keys at the part's start before the row's sliding window: weight 0
} Row;

// The value rows of a slice's first `keys` keys (of 16) paired by keys into lo, hi ([pairs][chunks]).
static inline __attribute__((always_inline)) void pair_slice(const uint16_t* v_rows, int keys, int64_t stride,
                                                             int chunks, __m512i* lo, __m512i* hi) {
    for (int k = 0; k < (keys + 1) / 2; k++)
        pair_values(v_rows + 2 * k * stride, 2 * k + 1 < keys ? v_rows + (2 * k + 1) * stride : NULL, chunks,
                    lo + k * chunks, hi + k * chunks);
}

// `count` query rows over the first keys of `table` (each row its own count), head_dim = 32 * chunks. The rows
// share each slice's loads (and its paired values) but keep their own arithmetic: a row's result is bit for bit
// what it gets alone. Inlined for each common chunk count and for one row, so that the compiler unrolls the
// loops over a row and keeps a slice's 16 score vectors and a head's accumulators in registers.
// far_table/far_len: the work this thread likely takes next, pulled into L2 a share per block of this.
static inline __attribute__((always_inline)) void attend_rows(
    const Row* rows, const int count, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
    int num_q_heads, int num_kv_heads, const int chunks, int block_size, float scale, const int64_t* far_table,
    int64_t far_len) {
    const int group = num_q_heads / num_kv_heads, head_dim = 32 * chunks;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;
    // Accumulators in the order of add_paired_values (kernel_common.h).
    __m512 lo[count][num_q_heads][chunks], hi[count][num_q_heads][chunks], l[count][num_q_heads];  // l: softmax sums per lane
    __m512i v_lo[8 * chunks], v_hi[8 * chunks];  // one slice's values of one head, paired by keys
    __m512i own_lo[8 * chunks], own_hi[8 * chunks];  // the same cut at a row's last key, where it ends earlier
    float m[count][num_q_heads], w[DECODE_MAX_GROUP][16];
    __m512 correction[DECODE_MAX_GROUP];
    int64_t len = 0;
    for (int r = 0; r < count; r++) {
        len = rows[r].keys > len ? rows[r].keys : len;
        for (int i = 0; i < num_q_heads; i++) {
            for (int c = 0; c < chunks; c++) lo[r][i][c] = hi[r][i][c] = _mm512_setzero_ps();
            m[r][i] = NO_SCORE; l[r][i] = _mm512_setzero_ps();
        }
    }
    const int64_t blocks = (len + block_size - 1) / block_size, far_blocks = (far_len + block_size - 1) / block_size;
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t b = start / block_size;
        const uint16_t* kb = k_cache + table[b] * block_elems;
        const uint16_t* vb = v_cache + table[b] * block_elems;
        const Ahead ahead = {k_cache, v_cache, table[start + block_size < len ? b + 1 : b] * block_elems, far_table,
                             b * far_blocks / blocks, (b + 1) * far_blocks / blocks, block_elems, stride, block_size};
        const int n = (int)(len - start < block_size ? len - start : block_size);
        for (int s0 = 0; s0 < n; s0 += 16) {
            const int keys = n - s0 < 16 ? n - s0 : 16;  // of the longest row; a row's own are the first of them
            for (int h = 0; h < num_kv_heads; h++) {
                const uint16_t* k_rows = kb + s0 * stride + h * head_dim;
                const uint16_t* v_rows = vb + s0 * stride + h * head_dim;
                if (count > 1) pair_slice(v_rows, keys, stride, chunks, v_lo, v_hi);  // once for all the rows
                for (int r = 0; r < count; r++) {
                    const int64_t left = rows[r].keys - start - s0;
                    if (left <= 0) continue;
                    const int own = left < keys ? (int)left : keys;
                    const int64_t before = rows[r].skip - start - s0;
                    const int hidden = before > 0 ? (before < 16 ? (int)before : 16) : 0;
                    for (int g = 0; g < group; g++) {
                        const int i = h * group + g;
                        if (r == 0) prefetch_share(&ahead, s0, 2 * i, 2 * num_q_heads);
                        __m512i qv[chunks];
                        for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_si512((const void*)(rows[r].q + i * head_dim + 32 * c));
                        __m512 s[16];
                        for (int t = 0; t < 16; t++) {
                            s[t] = _mm512_setzero_ps();
                            if (t >= own) continue;
                            for (int c = 0; c < chunks; c++)
                                s[t] = _mm512_dpbf16_ps(s[t], (__m512bh)_mm512_loadu_si512((const void*)(k_rows + t * stride + 32 * c)),
                                                        (__m512bh)qv[c]);
                        }
                        const __m512 scores = _mm512_mul_ps(sum_lanes16(s), _mm512_set1_ps(scale));
                        correction[g] = softmax16(scores, hidden, own, &m[r][i], &l[r][i], w[g]);
                    }
                    // A row that ends inside the slice pairs its last key with zeros, as it does alone. A row alone
                    // pairs here, between its scores and its values, where the pairing loads overlap best.
                    const __m512i *pair_lo = v_lo, *pair_hi = v_hi;
                    if (count == 1) pair_slice(v_rows, keys, stride, chunks, v_lo, v_hi);
                    else if (own < keys) pair_slice(v_rows, own, stride, chunks, own_lo, own_hi), pair_lo = own_lo, pair_hi = own_hi;
                    for (int g = 0; g < group; g++) {
                        const int i = h * group + g;
                        if (r == 0) prefetch_share(&ahead, s0, 2 * i + 1, 2 * num_q_heads);
                        add_paired_values(lo[r][i], hi[r][i], correction[g], w[g], pair_lo, pair_hi, (own + 1) / 2, chunks);
                    }
                }
            }
        }
    }
    for (int r = 0; r < count; r++)
        for (int i = 0; i < num_q_heads; i++) {
            const float sum = _mm512_reduce_add_ps(l[r][i]);
            if (rows[r].part) {
                float* state = rows[r].part + i * (head_dim + 2);
                state[0] = m[r][i], state[1] = sum;
                for (int c = 0; c < chunks; c++) {
                    __m512 first, second;
                    unpair(lo[r][i][c], hi[r][i][c], _mm512_set1_ps(1.f), &first, &second);
                    _mm512_storeu_ps(state + 2 + 32 * c, first);
                    _mm512_storeu_ps(state + 2 + 32 * c + 16, second);
                }
                continue;
            }
            const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
            for (int c = 0; c < chunks; c++) store_unpaired_bf16(lo[r][i][c], hi[r][i][c], inv, rows[r].out + i * head_dim + 32 * c);
        }
}

static void run_rows(const Row* rows, int count, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int64_t* table, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                     float scale, const int64_t* far_table, int64_t far_len) {
#define ATTEND(COUNT, CHUNKS) attend_rows(rows, COUNT, k_cache, v_cache, table, num_q_heads, num_kv_heads, CHUNKS, \
                                          block_size, scale, far_table, far_len)
    switch (head_dim / 32) {
        case 2: count == 1 ? ATTEND(1, 2) : ATTEND(count, 2); break;  // heads of 64 (SmolLM2, Llama 3.2 1B)
        case 4: count == 1 ? ATTEND(1, 4) : ATTEND(count, 4); break;  // heads of 128 (most larger models)
        default: ATTEND(count, head_dim / 32);
    }
#undef ATTEND
}

// A work item: rows [first, first + count), consecutive in the batch, over the keys of one part from k0 on past
// their first attended key lo (the same for all of them), read through the block table of table_row (the rows agree
// with it on every block they use in the part).
typedef struct {
    int first, count, table_row;
    int64_t k0;
} Item;

// Whether row s uses the same blocks as row t in the part from k0, as far as both use them.
static int same_blocks(const int64_t* block_tables, const int64_t* seq_lens, int s, int t, int64_t k0,
                       int64_t part_keys, int block_size, int max_blocks) {
    const int64_t keys_s = seq_lens[s] - k0 < part_keys ? seq_lens[s] - k0 : part_keys;
    const int64_t keys_t = seq_lens[t] - k0 < part_keys ? seq_lens[t] - k0 : part_keys;
    const int64_t keys = keys_s < keys_t ? keys_s : keys_t, first = k0 / block_size;
    const int64_t* a = block_tables + (int64_t)s * max_blocks + first;
    const int64_t* b = block_tables + (int64_t)t * max_blocks + first;
    for (int64_t j = 0; j < (keys + block_size - 1) / block_size; j++)
        if (a[j] != b[j]) return 0;
    return 1;
}

// paged_decode_bf16's whole call, with its arguments; returns 0, having done nothing, unless head_dim % 32 == 0.
// With k8, v8 (an fp8 cache, csrc/kv_fp8.c; k_cache, v_cache unused) each work item's blocks are first widened to
// bf16 in its thread's scratch, and attended from there: the same results as from a bf16 cache of the same values.
int decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const uint8_t* k8,
                const uint8_t* v8, const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_seqs,
                int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                int64_t window) {
    if (head_dim % 32 != 0) return 0;
    // A row attends from lo, the block of its first visible key (0 without a sliding window). Its span from there
    // is cut into parts of a fixed size, whatever else runs, so that its result never depends on the batch beside
    // it. Row s's parts have the states at first_part[s] ...
    const int64_t part_keys = (SPLIT_KEYS / block_size > 0 ? SPLIT_KEYS / block_size : 1) * block_size;
    int64_t* first_part = malloc((num_seqs + 1) * sizeof(int64_t));
    int64_t* lo = malloc((num_seqs + 1) * sizeof(int64_t));
    int64_t total_parts = 0, max_span = 0;
    for (int s = 0; s < num_seqs; s++) {
        lo[s] = window_walk_start(seq_lens[s], window, block_size);
        const int64_t span = seq_lens[s] - lo[s];
        first_part[s] = total_parts;
        total_parts += span > part_keys ? (span + part_keys - 1) / part_keys : 1;
        max_span = span > max_span ? span : max_span;
    }
    first_part[num_seqs] = total_parts;
    // ... and consecutive rows on the same blocks (a request's draft rows, or the outputs a recompute replays) are
    // attended together, GROUP_ROWS at most: each slice of keys is read once for all of them. Fewer where the rows'
    // states would crowd L1 (GROUP_STATE_BYTES), and none where items would be too few to keep every thread busy.
    const int threads = omp_get_max_threads();
    const int64_t row_state = (int64_t)num_q_heads * (head_dim + 16) * sizeof(float);  // accumulators, sums
    int64_t cap = GROUP_STATE_BYTES / row_state < GROUP_ROWS ? GROUP_STATE_BYTES / row_state : GROUP_ROWS;
    cap = total_parts / (4 * threads) < cap ? total_parts / (4 * threads) : cap;
    cap = cap > 1 ? cap : 1;
    Item* item = malloc(total_parts * sizeof *item);
    int64_t items = 0;
    for (int64_t k0 = 0; k0 == 0 || k0 < max_span; k0 += part_keys)
        for (int s = 0; s < num_seqs;) {
            if (k0 > 0 && seq_lens[s] - lo[s] <= k0) { s++; continue; }
            Item it = {s, 1, s, k0};
            for (s++; s < num_seqs && it.count < cap && seq_lens[s] - lo[s] > k0 && lo[s] == lo[it.first] &&
                      same_blocks(block_tables, seq_lens, s, it.table_row, lo[s] + k0, part_keys, block_size,
                                  max_blocks);
                 s++, it.count++)
                if (seq_lens[s] > seq_lens[it.table_row]) it.table_row = s;
            item[items++] = it;
        }
    const int64_t state = (int64_t)num_q_heads * (head_dim + 2), row = (int64_t)num_q_heads * head_dim;
    float* parts = max_span > part_keys ? malloc(total_parts * state * sizeof(float)) : NULL;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, wide_elems = 2 * part_keys * stride;
    uint16_t* wide = k8 ? malloc(threads * wide_elems * sizeof(uint16_t)) : NULL;
    int64_t* in_order = k8 ? malloc((part_keys / block_size) * sizeof(int64_t)) : NULL;  // the widened blocks' table
    for (int64_t b = 0; in_order && b < part_keys / block_size; b++) in_order[b] = b;
    _Pragma("omp parallel") {
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t i = 0; i < items; i++) {
            const Item it = item[i];
            Row rows[GROUP_ROWS];
            const int64_t from = lo[it.first] + it.k0;  // the part's first key, for every row of the item
            for (int r = 0; r < it.count; r++) {
                const int s = it.first + r;
                const int64_t keys = seq_lens[s] - from < part_keys ? seq_lens[s] - from : part_keys;
                float* part = seq_lens[s] - lo[s] > part_keys ? parts + (first_part[s] + it.k0 / part_keys) * state : NULL;
                const int skip = it.k0 == 0 ? (int)(window_start(seq_lens[s], window) - lo[s]) : 0;
                rows[r] = (Row){q + s * row, keys > 0 ? keys : 0, out + s * row, part, skip};
            }
            const Item far = item[i + threads < items ? i + threads : i];  // dynamic scheduling hands items out in turn
            const int64_t far_from = lo[far.first] + far.k0;
            const int64_t far_len = seq_lens[far.table_row] - far_from < part_keys ? seq_lens[far.table_row] - far_from : part_keys;
            const int64_t* table = block_tables + (int64_t)it.table_row * max_blocks + from / block_size;
            const int64_t* far_table = block_tables + (int64_t)far.table_row * max_blocks + far_from / block_size;
            const uint16_t *k = k_cache, *v = v_cache;
            int64_t ahead = i + threads < items ? far_len : 0;
            if (k8) {  // widened, then read from L2, while the far work's fp8 blocks are asked into L2
                uint16_t* wk = wide + omp_get_thread_num() * wide_elems;
                const int64_t keys = seq_lens[it.table_row] - from < part_keys ? seq_lens[it.table_row] - from : part_keys;
                bf16_from_fp8_blocks(k8, table, keys, block_size, stride, wk);
                bf16_from_fp8_blocks(v8, table, keys, block_size, stride, wk + part_keys * stride);
                if (ahead) fp8_prefetch_blocks(k8, v8, far_table, ahead, block_size, stride);
                k = wk, v = wk + part_keys * stride, table = in_order, ahead = 0;
            }
            run_rows(rows, it.count, k, v, table, num_q_heads, num_kv_heads, head_dim, block_size, scale, far_table, ahead);
        }
        _Pragma("omp for schedule(dynamic, 1)") for (int s = 0; s < num_seqs; s++) {
            const int64_t count = first_part[s + 1] - first_part[s];
            if (count > 1) combine_parts_bf16(parts + first_part[s] * state, count, num_q_heads, head_dim, out + s * row);
        }
    }
    free(parts), free(first_part), free(lo), free(item), free(wide), free(in_order);
    return 1;
}
#else
int decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const uint8_t* k8,
                const uint8_t* v8, const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_seqs,
                int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                int64_t window) {
    (void)q, (void)k_cache, (void)v_cache, (void)k8, (void)v8, (void)block_tables, (void)seq_lens, (void)out, (void)num_seqs,
        (void)num_q_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)max_blocks, (void)scale,
        (void)window;
    return 0;
}
#endif
