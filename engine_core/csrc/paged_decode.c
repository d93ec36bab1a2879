// Paged attention for single-token decodes on CPU: one pass over each sequence's blocks with an
// online softmax, reading K/V straight from the cache (no gather copy). fp32 math; bf16 or fp32 storage.
//
// One work item is one sequence, or a part of a long one (decode_items, kernel_common.h), all heads: a block's
// keys and values (all heads, contiguous) are used while they sit in L1, and the next block is prefetched
// meanwhile. Decode attention streams the whole KV cache of the batch every step, so how the reads overlap the
// arithmetic matters as much as either. Each thread also pulls the item it will most likely take next (this one +
// the thread count: dynamic scheduling hands them out in turn) into L2, a share per block of this one: with only
// the next block in flight the kernel read 17 GB/s of a machine's 46; with it, 22 (30 layers at batch 64: 17.4 ->
// 13.4 ms).
#include <omp.h>

#include "kernel_common.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64
#define MAX_HEADS 64  // per-sequence state lives on the stack: at most MAX_HEADS * MAX_DIM * 8 bytes

// Portable path: any head_dim. acc: [num_q_heads][head_dim].
#define DEFINE_SCALAR_SEQUENCE(NAME, T, LOAD, STORE)                                                     \
static void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,      \
                 T* out, float* part, int num_q_heads, int num_kv_heads, int head_dim, int block_size,   \
                 float scale, const int64_t* far_table, int64_t far_len, int skip) {                    \
    (void)far_table; (void)far_len;  /* no prefetching here */                                           \
    const int group = num_q_heads / num_kv_heads;                                                        \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;         \
    float qf[num_q_heads][head_dim], acc[num_q_heads][head_dim], m[num_q_heads], l[num_q_heads];        \
    float scores[MAX_GROUP][MAX_BLOCK], row[MAX_DIM];                                                    \
    for (int i = 0; i < num_q_heads; i++) {                                                              \
        for (int d = 0; d < head_dim; d++) { qf[i][d] = LOAD(q[i * head_dim + d]) * scale; acc[i][d] = 0.f; } \
        m[i] = NO_SCORE; l[i] = 0.f;                                                                     \
    }                                                                                                    \
    for (int64_t start = 0; start < len; start += block_size) {                                         \
        const int64_t b = start / block_size;                                                            \
        const T* kb = k_cache + table[b] * block_elems;                                                  \
        const T* vb = v_cache + table[b] * block_elems;                                                  \
        const T* next_k = k_cache + table[start + block_size < len ? b + 1 : b] * block_elems;          \
        const T* next_v = v_cache + table[start + block_size < len ? b + 1 : b] * block_elems;          \
        const int n = (int)(len - start < block_size ? len - start : block_size);                        \
        for (int h = 0; h < num_kv_heads; h++) {                                                         \
            for (int t = 0; t < n; t++) {                                                                \
                if (h == 0) prefetch_rows(next_k + t * stride, next_v + t * stride, stride * (int64_t)sizeof(T)); \
                for (int d = 0; d < head_dim; d++) row[d] = LOAD(kb[t * stride + h * head_dim + d]);     \
                for (int g = 0; g < group; g++) {                                                        \
                    float dot = 0.f;                                                                     \
                    for (int d = 0; d < head_dim; d++) dot += qf[h * group + g][d] * row[d];             \
                    scores[g][t] = start + t < skip ? NO_SCORE : dot;  /* before a window: weight 0 */   \
                }                                                                                        \
            }                                                                                            \
            for (int g = 0; g < group; g++) {                                                            \
                const int i = h * group + g;                                                             \
                const float correction = softmax_update(scores[g], n, &m[i], &l[i]);                     \
                for (int d = 0; d < head_dim; d++) acc[i][d] *= correction;                              \
            }                                                                                            \
            for (int t = 0; t < n; t++) {                                                                \
                for (int d = 0; d < head_dim; d++) row[d] = LOAD(vb[t * stride + h * head_dim + d]);     \
                for (int g = 0; g < group; g++)                                                          \
                    for (int d = 0; d < head_dim; d++) acc[h * group + g][d] += scores[g][t] * row[d];   \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < num_q_heads; i++) {                                                              \
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;                                                 \
        if (part) { /* the state combine_parts (kernel_common.h) reads */                                \
            float* state = part + i * (head_dim + 2);                                                    \
            state[0] = m[i], state[1] = l[i];                                                            \
            for (int d = 0; d < head_dim; d++) state[2 + d] = acc[i][d];                                 \
        } else                                                                                           \
            for (int d = 0; d < head_dim; d++) out[i * head_dim + d] = STORE(acc[i][d] * inv);           \
    }                                                                                                    \
}

DEFINE_SCALAR_SEQUENCE(scalar_sequence_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_SCALAR_SEQUENCE(scalar_sequence_f32, float, F32_LOAD, F32_STORE)

#if defined(LANES)

// The same with the head dimension in registers of LANES lanes (head_dim % LANES == 0): each key or value row is
// loaded and widened once and used by every query head of its group. On AVX2 it serves what csrc/decode_avx2.c
// does not take: block sizes that are not a multiple of 8.
#define DEFINE_VECTOR_SEQUENCE(NAME, T, VLOAD, STORE)                                                    \
static void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,      \
                 T* out, float* part, int num_q_heads, int num_kv_heads, int head_dim, int block_size,   \
                 float scale, const int64_t* far_table, int64_t far_len, int skip) {                    \
    const int group = num_q_heads / num_kv_heads, nv = head_dim / LANES;                                 \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;         \
    vec qv[num_q_heads][nv], acc[num_q_heads][nv], row[MAX_DIM / LANES];                                 \
    float m[num_q_heads], l[num_q_heads], scores[MAX_GROUP][MAX_BLOCK];                                  \
    for (int i = 0; i < num_q_heads; i++) {                                                              \
        for (int j = 0; j < nv; j++) {                                                                   \
            qv[i][j] = vec_mul(VLOAD(q + i * head_dim + LANES * j), vec_set1(scale));                    \
            acc[i][j] = vec_zero();                                                                      \
        }                                                                                                \
        m[i] = NO_SCORE; l[i] = 0.f;                                                                     \
    }                                                                                                    \
    const int64_t blocks = (len + block_size - 1) / block_size;                                          \
    const int64_t far_blocks = (far_len + block_size - 1) / block_size;                                  \
    const int far_head = num_kv_heads > 1 ? 1 : 0;  /* apart from the next block's L1 prefetches */      \
    for (int64_t start = 0; start < len; start += block_size) {                                         \
        const int64_t b = start / block_size;                                                            \
        const T* kb = k_cache + table[b] * block_elems;                                                  \
        const T* vb = v_cache + table[b] * block_elems;                                                  \
        const T* next_k = k_cache + table[start + block_size < len ? b + 1 : b] * block_elems;          \
        const T* next_v = v_cache + table[start + block_size < len ? b + 1 : b] * block_elems;          \
        const int n = (int)(len - start < block_size ? len - start : block_size);                        \
        /* this block's share of the far sequence's blocks, fetched into L2 a row at a time */           \
        const int64_t far_from = b * far_blocks / blocks, far_to = (b + 1) * far_blocks / blocks;        \
        for (int h = 0; h < num_kv_heads; h++) {                                                         \
            for (int t = 0; t < n; t++) {                                                                \
                if (h == 0) prefetch_rows(next_k + t * stride, next_v + t * stride, stride * (int64_t)sizeof(T)); \
                if (h == far_head)                                                                      \
                    for (int64_t f = far_from; f < far_to; f++)                                          \
                        prefetch_rows_l2(k_cache + far_table[f] * block_elems + t * stride,              \
                                         v_cache + far_table[f] * block_elems + t * stride, stride * (int64_t)sizeof(T)); \
                for (int j = 0; j < nv; j++) row[j] = VLOAD(kb + t * stride + h * head_dim + LANES * j); \
                for (int g = 0; g < group; g++) {                                                        \
                    vec dot = vec_mul(qv[h * group + g][0], row[0]);                                     \
                    for (int j = 1; j < nv; j++) dot = vec_fmadd(qv[h * group + g][j], row[j], dot);     \
                    scores[g][t] = start + t < skip ? NO_SCORE : vec_sum(dot);                           \
                }                                                                                        \
            }                                                                                            \
            for (int g = 0; g < group; g++) {                                                            \
                const int i = h * group + g;                                                             \
                const vec correction = vec_set1(softmax_update(scores[g], n, &m[i], &l[i]));             \
                for (int j = 0; j < nv; j++) acc[i][j] = vec_mul(acc[i][j], correction);                 \
            }                                                                                            \
            for (int t = 0; t < n; t++) {                                                                \
                for (int j = 0; j < nv; j++) row[j] = VLOAD(vb + t * stride + h * head_dim + LANES * j); \
                for (int g = 0; g < group; g++) {                                                        \
                    const vec p = vec_set1(scores[g][t]);                                                \
                    for (int j = 0; j < nv; j++) acc[h * group + g][j] = vec_fmadd(p, row[j], acc[h * group + g][j]); \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < num_q_heads; i++) {                                                              \
        const vec inv = vec_set1(l[i] > 0.f ? 1.f / l[i] : 0.f);                                         \
        float lanes[LANES];                                                                              \
        if (part) { /* the state combine_parts (kernel_common.h) reads */                                \
            float* state = part + i * (head_dim + 2);                                                    \
            state[0] = m[i], state[1] = l[i];                                                            \
            for (int j = 0; j < nv; j++) vec_store(state + 2 + LANES * j, acc[i][j]);                    \
        } else                                                                                           \
            for (int j = 0; j < nv; j++) {                                                               \
                vec_store(lanes, vec_mul(acc[i][j], inv));                                               \
                for (int d = 0; d < LANES; d++) out[i * head_dim + LANES * j + d] = STORE(lanes[d]);     \
            }                                                                                            \
    }                                                                                                    \
}

DEFINE_VECTOR_SEQUENCE(vector_sequence_bf16, uint16_t, vload_bf16, bf16_store)
DEFINE_VECTOR_SEQUENCE(vector_sequence_f32, float, vload_f32, F32_STORE)
#define PICK(vector, scalar) (head_dim % LANES == 0 ? (vector) : (scalar))
#else
#define PICK(vector, scalar) (scalar)
#endif

_Static_assert(MAX_GROUP <= DECODE_MAX_GROUP && MAX_DIM <= DECODE_MAX_DIM, "shapes decode_bf16.c cannot hold");
#define FAST_BF16(q, k, v, ...) (decode_bf16(q, k, v, NULL, NULL, __VA_ARGS__) || decode_avx2_bf16(q, k, v, __VA_ARGS__))

// Sequences longer than this are attended in parts (decode_items, kernel_common.h).
#define SPLIT_KEYS 512

// q: [num_seqs, num_q_heads, head_dim]; caches: [blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs] (context including the new token); window: a
// sliding window (each query sees its last `window` keys), 0 for none.
// FAST: a kernel that does the whole call where it can (csrc/decode_bf16.c, csrc/decode_avx2.c), answering 1 if
// it did.
#define DEFINE_KERNEL(NAME, T, SCALAR, VECTOR, FAST, COMBINE)                                            \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,                 \
          const int64_t* seq_lens, T* out, int num_seqs, int num_q_heads, int num_kv_heads,             \
          int head_dim, int block_size, int max_blocks, float scale, int64_t window) {                  \
    if (FAST(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_q_heads, num_kv_heads,      \
             head_dim, block_size, max_blocks, scale, window)) return;                                   \
    DecodeItems it = decode_items(seq_lens, num_seqs, block_size, SPLIT_KEYS, num_q_heads, head_dim, window); \
    const int64_t row = (int64_t)num_q_heads * head_dim;                                                 \
    _Pragma("omp parallel") {                                                                            \
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t i = 0; i < it.items; i++) {                \
            const int s = it.seq[i];                                                                     \
            const int64_t far = i + omp_get_num_threads();                                               \
            const int64_t* table = block_tables + s * (int64_t)max_blocks + item_start(&it, i) / block_size; \
            const int64_t* far_table = far < it.items ? block_tables + it.seq[far] * (int64_t)max_blocks   \
                                                            + item_start(&it, far) / block_size : table;   \
            PICK(VECTOR, SCALAR)(q + s * row, k_cache, v_cache, table, item_keys(&it, seq_lens, i), out + s * row, \
                                 item_state(&it, i), num_q_heads, num_kv_heads, head_dim, block_size, scale, \
                                 far_table, far < it.items ? item_keys(&it, seq_lens, far) : 0,           \
                                 item_skip(&it, seq_lens, i, window));                                    \
        }                                                                                                \
        COMBINE_DECODE_ITEMS(COMBINE, it, num_seqs, num_q_heads, head_dim, out);                         \
    }                                                                                                    \
    free_decode_items(&it);                                                                              \
}

DEFINE_KERNEL(paged_decode_bf16, uint16_t, scalar_sequence_bf16, vector_sequence_bf16, FAST_BF16, combine_parts_bf16)
DEFINE_KERNEL(paged_decode_f32, float, scalar_sequence_f32, vector_sequence_f32, decode_avx2_f32, combine_parts_f32)

int paged_decode_limits(int* max_group, int* max_dim, int* max_block, int* max_heads) {
    *max_group = MAX_GROUP; *max_dim = MAX_DIM; *max_block = MAX_BLOCK; *max_heads = MAX_HEADS;
    return 0;
}
