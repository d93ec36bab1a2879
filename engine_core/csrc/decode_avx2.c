// Decode attention (one query row per sequence, all heads) over paged bf16 or fp32 K/V on CPUs with AVX2 + FMA and
// no AVX-512, 8 keys at a time: csrc/decode_bf16.c's plan with fp32 FMAs. paged_decode (csrc/paged_decode.c) hands
// it the whole call where head_dim % 8 == 0 and block_size % 8 == 0. (Built for AVX-512 without AVX512-BF16, it
// was no faster than the 16-lane key-at-a-time path there at batch 64, and 7% slower at 512 keys.) It also reads
// fp8 caches for bf16 models (csrc/kv_fp8.c's paged_decode_fp8), widening each row to fp32 as it loads it: the
// result that of a bf16 cache holding the same values, as this build's bf16 decode computes it. (So not on AVX-512
// CPUs, where bf16 runs another plan.)
// For each 8-key slice and each KV head:
//   - the slice's key and value rows are widened to fp32 once, for all the query heads of the group;
//   - a query head's scores: one partial-sum vector per key (8 independent FMA chains), then sum_lanes8 adds the
//     8 vectors into one vector of 8 scores with 7 horizontal adds, where a horizontal sum per key and head took 5
//     instructions and a dependent chain;
//   - an 8-lane online-softmax step (softmax8), then the 8 keys' weighted values.
// SmolLM2's 30 layers (9/3 heads of 64) at batch 64, against the key-at-a-time portable path it replaces here:
// 36 -> 22 ms with every block in L2; from memory, each sequence's blocks scattered as in a running engine, 57 -> 32
// ms at 200 keys and 272 -> 135 ms at 1000 (11 GB/s, where only reading the same blocks reaches 12).
// Each sequence, or part of one (SPLIT_KEYS), is computed alone, in the same order whatever the batch.
#include <omp.h>

#include "kernel_common.h"

// Whether this build's decode_avx2_* calls take heads of head_dim in blocks of block_size.
int decode_avx2_takes(int head_dim, int block_size) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
    return head_dim % 8 == 0 && head_dim <= DECODE_MAX_DIM && block_size % 8 == 0;  // 8 lanes; slices of KEYS = 8
#else
    (void)head_dim, (void)block_size;
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)

#define KEYS 8
// Each slice's work prefetches the slice AHEAD keys on into L1 (through the block table: a sequence's blocks lie
// anywhere), a share of its rows before each query head's arithmetic. All of them at the slice's start held up
// the demand loads waiting on the same miss buffers: 1000 keys above took 238 ms against 135. 8, 24 or 32 keys
// ahead, or a second prefetch into L2 further on, were no better.
#define AHEAD 16
// Where the slice of keys from `pos` on starts in the caches (0 past the context: a prefetch no one makes).
#define SLICE_AT(pos) ((pos) < len ? table[(pos) / block_size] * block_elems + (pos) % block_size * stride : 0)

// Lane t of the result = the sum of the 8 lanes of s[t], always added in the same order.
static inline __m256 sum_lanes8(const __m256* s) {
    // per 128-bit half: pairs of s[2i] and s[2i + 1], then quarters of four vectors
    const __m256 a = _mm256_hadd_ps(s[0], s[1]), b = _mm256_hadd_ps(s[2], s[3]);
    const __m256 c = _mm256_hadd_ps(s[4], s[5]), d = _mm256_hadd_ps(s[6], s[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // low half: lanes 0-3 of s[0..3]; high: 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// 16 values at p widened to fp32, as two vectors.
static inline void vload16_bf16(const uint16_t* p, __m256* lo, __m256* hi) {
    *lo = vload8_bf16(p), *hi = vload8_bf16(p + 8);
}
static inline void vload16_f32(const float* p, __m256* lo, __m256* hi) { *lo = vload8_f32(p), *hi = vload8_f32(p + 8); }

// T: q's and out's element type; C, CLOAD8, CLOAD16: the caches' and how 8 or 16 of their values are widened, to
// 1 / C_SCALE times their values (a power of two: the products with the query and the weights, each scaled by it
// in turn, are the unscaled ones exactly).
#define DEFINE_SEQUENCE(NAME, T, VLOAD, STORE, C, CLOAD8, CLOAD16, C_SCALE)                                      \
static void NAME(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t len, T* out,     \
                 float* part, int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,     \
                 int skip, int kv0, int kv1) {                                                                  \
    const int group = num_q_heads / num_kv_heads, nv = head_dim / 8, i0 = kv0 * group, i1 = kv1 * group;       \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;                 \
    __m256 qv[num_q_heads][nv], acc[num_q_heads][nv], kf[KEYS][DECODE_MAX_DIM / 8], vf[KEYS][DECODE_MAX_DIM / 8]; \
    float m[num_q_heads], l[num_q_heads], w[KEYS];                                                              \
    for (int i = i0; i < i1; i++) {                                                                             \
        for (int j = 0; j < nv; j++)                                                                            \
            qv[i][j] = _mm256_mul_ps(VLOAD(q + i * head_dim + 8 * j), _mm256_set1_ps(scale * (C_SCALE))),       \
            acc[i][j] = _mm256_setzero_ps();                                                                    \
        m[i] = NO_SCORE, l[i] = 0.f;                                                                            \
    }                                                                                                           \
    for (int64_t start = 0; start < len; start += KEYS) {                                                       \
        const int64_t at = SLICE_AT(start), ahead = SLICE_AT(start + AHEAD);                                    \
        const int n = (int)(len - start < KEYS ? len - start : KEYS);                                           \
        const int hidden = start < skip ? (int)(skip - start < KEYS ? skip - start : KEYS) : 0;  /* a window's */ \
        for (int h = kv0; h < kv1; h++) {                                                                       \
            for (int t = 0; t < KEYS; t++) { /* zeros past the last key: 0 x 0, never 0 x garbage */            \
                const int64_t e = at + t * stride + h * head_dim;                                               \
                int j = 0;                                                                                      \
                for (; t < n && j + 2 <= nv; j += 2)                                                            \
                    CLOAD16(k_cache + e + 8 * j, &kf[t][j], &kf[t][j + 1]),                                     \
                        CLOAD16(v_cache + e + 8 * j, &vf[t][j], &vf[t][j + 1]);                                 \
                for (; j < nv; j++)                                                                             \
                    kf[t][j] = t < n ? CLOAD8(k_cache + e + 8 * j) : _mm256_setzero_ps(),                       \
                    vf[t][j] = t < n ? CLOAD8(v_cache + e + 8 * j) : _mm256_setzero_ps();                       \
            }                                                                                                   \
            for (int g = 0; g < group; g++) {                                                                   \
                const int i = h * group + g;                                                                    \
                for (int t = (i - i0) * KEYS / (i1 - i0); start + AHEAD < len && t < (i - i0 + 1) * KEYS / (i1 - i0); \
                     t++) /* the slice's rows, their part for these heads, spread over the heads */             \
                    prefetch_rows(k_cache + ahead + t * stride + kv0 * head_dim,                                \
                                  v_cache + ahead + t * stride + kv0 * head_dim,                                \
                                  (kv1 - kv0) * head_dim * (int64_t)sizeof(C));                                 \
                __m256 dots[KEYS]; /* per key: its products' partial sums */                                   \
                for (int t = 0; t < KEYS; t++) dots[t] = _mm256_mul_ps(qv[i][0], kf[t][0]);                     \
                for (int j = 1; j < nv; j++)                                                                    \
                    for (int t = 0; t < KEYS; t++) dots[t] = _mm256_fmadd_ps(qv[i][j], kf[t][j], dots[t]);      \
                const __m256 c = _mm256_set1_ps(softmax8(sum_lanes8(dots), hidden, n, &m[i], &l[i], w));       \
                for (int j = 0; j < nv; j++) {                                                                  \
                    __m256 a = _mm256_mul_ps(acc[i][j], c);                                                     \
                    for (int t = 0; t < KEYS; t++) a = _mm256_fmadd_ps(_mm256_set1_ps(w[t] * (C_SCALE)), vf[t][j], a); \
                    acc[i][j] = a;                                                                              \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int i = i0; i < i1; i++) {                                                                             \
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f, *sums = (const float*)acc[i];                          \
        if (part) { /* the state combine_parts (kernel_common.h) reads */                                       \
            float* state = part + i * (head_dim + 2);                                                           \
            state[0] = m[i], state[1] = l[i];                                                                   \
            for (int d = 0; d < head_dim; d++) state[2 + d] = sums[d];                                          \
        } else                                                                                                  \
            for (int d = 0; d < head_dim; d++) out[i * head_dim + d] = STORE(sums[d] * inv);                    \
    }                                                                                                           \
}

DEFINE_SEQUENCE(sequence_bf16, uint16_t, vload8_bf16, bf16_store, uint16_t, vload8_bf16, vload16_bf16, 1.f)
DEFINE_SEQUENCE(sequence_f32, float, vload8_f32, F32_STORE, float, vload8_f32, vload16_f32, 1.f)
DEFINE_SEQUENCE(sequence_fp8, uint16_t, vload8_bf16, bf16_store, uint8_t, vload8_fp8_scaled, vload16_fp8_scaled, 256.f)

// Sequences longer than this are attended in parts (decode_items, kernel_common.h): one row of 4096 keys, 30
// layers, 18 -> 10 ms on 2 cores.
#define SPLIT_KEYS 512
// A call of fewer items than threads (a lone short sequence) gives each KV head its own share, so that
// no thread waits through another's whole attention. Each head's sums are the same whoever computes them: unlike
// the parts of SPLIT_KEYS, this split may follow the batch.

#define DEFINE_CALL(NAME, T, C, SEQUENCE, COMBINE)                                                               \
int NAME(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables, const int64_t* seq_lens,   \
         T* out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,  \
         float scale, int64_t window) {                                                                         \
    if (!decode_avx2_takes(head_dim, block_size)) return 0;                                                     \
    DecodeItems it = decode_items(seq_lens, num_seqs, block_size, SPLIT_KEYS, num_q_heads, head_dim, window);    \
    const int64_t row = (int64_t)num_q_heads * head_dim;                                                        \
    const int heads = it.items < omp_get_max_threads() ? num_kv_heads : 1; /* shares of an item: see above */   \
    _Pragma("omp parallel") {                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t ih = 0; ih < it.items * heads; ih++) {            \
            const int64_t i = ih / heads;                                                                       \
            const int s = it.seq[i], kv0 = (int)(ih % heads) * num_kv_heads / heads;                           \
            SEQUENCE(q + s * row, k_cache, v_cache,                                                             \
                     block_tables + s * (int64_t)max_blocks + item_start(&it, i) / block_size,                  \
                     item_keys(&it, seq_lens, i), out + s * row, item_state(&it, i), num_q_heads, num_kv_heads, \
                     head_dim, block_size, scale, item_skip(&it, seq_lens, i, window), kv0,                    \
                     kv0 + num_kv_heads / heads);                                                               \
        }                                                                                                       \
        COMBINE_DECODE_ITEMS(COMBINE, it, num_seqs, num_q_heads, head_dim, out);                                \
    }                                                                                                           \
    free_decode_items(&it);                                                                                     \
    return 1;                                                                                                   \
}
#else
#define DEFINE_CALL(NAME, T, C, SEQUENCE, COMBINE)                                                               \
int NAME(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables, const int64_t* seq_lens,   \
         T* out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,  \
         float scale, int64_t window) {                                                                         \
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)seq_lens, (void)out, (void)num_seqs;      \
    (void)num_q_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)max_blocks, (void)scale;    \
    (void)window;                                                                                               \
    return 0;                                                                                                   \
}
#endif

DEFINE_CALL(decode_avx2_bf16, uint16_t, uint16_t, sequence_bf16, combine_parts_bf16)
DEFINE_CALL(decode_avx2_f32, float, float, sequence_f32, combine_parts_f32)
DEFINE_CALL(decode_avx2_fp8, uint16_t, uint8_t, sequence_fp8, combine_parts_bf16)
