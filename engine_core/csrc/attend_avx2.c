// Paged attention of a tile of prefill query rows (up to 8) on CPUs with AVX2 + FMA, over bf16 or fp32 K/V: on
// AVX-512 CPUs too, for what csrc/attend_bf16.c does not take (fp32, or a CPU without AVX512-BF16). The tile's rows
// lie in the 8 fp32 lanes: lane r of every vector belongs to query row r, so nothing is ever summed across lanes.
// For each KV head, and each slice of KEYS keys of the context:
//   - the slice's key and value rows are widened to fp32 once, for the tile's rows and the group's query heads;
//   - a query head's scores: for each dim, the rows' query values (one vector) times the key's value (one
//     broadcast), 8 keys at a time in 8 independent FMA chains: a vector of 8 rows' scores per key;
//   - the online softmax of KEYS keys: maxima, sums and the rescaling factor are lane-wise vector operations;
//   - the weighted values: per dim, the keys' weights (one vector per key) times the value (one broadcast).
// The plan csrc/attend_bf16.c then had, with the keys in the lanes, ran here before: it transposed each slice's keys
// and took a horizontal max, a horizontal sum and a scalar exp per 8 keys and query head. The last 2048-row chunk of
// an 8k prompt (SmolLM2's heads, both cores): 38-44 -> 79-96 GFLOP/s, of about 128 at peak (bench.prefill_kernel).
// Every query row is computed alone, in the same order whatever else is in its tile: slices start at key 0, and
// keys its row may not see get a weight of exactly 0. Needs head_dim % 8 == 0 and block_size % 8 == 0
// (attend_avx2_takes).
#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define KEYS 16  // keys per softmax step; a multiple of 8, so that each 8-key part lies in one block

// Scores of 8 keys (rows of keys[], head_dim apart) for the rows whose query values are qt[d]: s[t] = q . key t.
static inline __attribute__((always_inline)) void score8(const __m256* qt, const float* keys, int head_dim,
                                                         __m256* s) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m256 qd = qt[d];
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(keys + t * head_dim + d), a[t]);
    }
    for (int t = 0; t < 8; t++) s[t] = a[t];
}

// acc[d] = acc[d] * c + sum over n keys of p[t] * values[t][d], 8 dims at a time.
static inline __attribute__((always_inline)) void add_values(__m256* acc, __m256 c, const __m256* p,
                                                             const float* values, int n, int head_dim) {
    for (int d0 = 0; d0 < head_dim; d0 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(acc[d0 + j], c);
        for (int t = 0; t < n; t++)
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(p[t], _mm256_broadcast_ss(values + t * head_dim + d0 + j), a[j]);
        for (int j = 0; j < 8; j++) acc[d0 + j] = a[j];
    }
}

#define DEFINE_ATTEND(NAME, T, LOAD, VLOAD, STORE)                                                                 \
void NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,             \
          int64_t first_pos, int rows, T* out, int num_q_heads, int num_kv_heads, int head_dim, int block_size,   \
          float scale, int64_t window) {                                                                          \
    const int group = num_q_heads / num_kv_heads;                                                                 \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;                   \
    const int64_t context = first_pos + rows; /* keys the last row of the tile sees */                            \
    __m256 qt[group][head_dim], acc[group][head_dim], m[group], l[group], s[KEYS];                                \
    __attribute__((aligned(32))) float keys[KEYS * head_dim], values[KEYS * head_dim];                            \
    /* keys each lane may see, [from, seen); lanes past the tile's rows see the whole context (their q is 0) */   \
    int32_t seen[8], from[8];                                                                                     \
    for (int r = 0; r < 8; r++) {                                                                                 \
        seen[r] = (int32_t)(r < rows ? first_pos + r + 1 : context);                                              \
        from[r] = (int32_t)(r < rows ? window_start(first_pos + r + 1, window) : 0);                              \
    }                                                                                                             \
    const __m256i seen_end = _mm256_loadu_si256((const __m256i*)seen);                                            \
    const __m256i seen_from = _mm256_loadu_si256((const __m256i*)from);                                           \
    const int64_t last_from = from[rows - 1];  /* slices before it hide keys from some row */                     \
    for (int h = 0; h < num_kv_heads; h++) {                                                                      \
        for (int g = 0; g < group; g++) {                                                                         \
            float* lanes = (float*)qt[g];                                                                         \
            for (int d = 0; d < head_dim; d++)                                                                    \
                for (int r = 0; r < 8; r++)                                                                       \
                    lanes[d * 8 + r] = r < rows ? LOAD(q[r * q_row_stride + (h * group + g) * head_dim + d]) * scale : 0.f; \
            for (int d = 0; d < head_dim; d++) acc[g][d] = _mm256_setzero_ps();                                   \
            m[g] = _mm256_set1_ps(NO_SCORE), l[g] = _mm256_setzero_ps();                                          \
        }                                                                                                         \
        for (int64_t start = window_walk_start(first_pos + 1, window, KEYS); start < context; start += KEYS) {           \
            const int n = (int)(context - start < KEYS ? context - start : KEYS), n8 = (n + 7) & ~7;              \
            for (int t = 0; t < n8; t += 8) { /* zeros past the last key: 0 x 0, never 0 x garbage */             \
                const int64_t at = table[(start + t) / block_size] * block_elems + (start + t) % block_size * stride \
                                   + h * head_dim;                                                                \
                for (int u = t; u < t + 8; u++)                                                                   \
                    for (int d = 0; d < head_dim; d += 8) {                                                       \
                        const __m256 k = u < n ? VLOAD(k_cache + at + (u - t) * stride + d) : _mm256_setzero_ps(); \
                        const __m256 v = u < n ? VLOAD(v_cache + at + (u - t) * stride + d) : _mm256_setzero_ps(); \
                        _mm256_store_ps(keys + u * head_dim + d, k), _mm256_store_ps(values + u * head_dim + d, v); \
                    }                                                                                             \
            }                                                                                                     \
            /* visible[t]: the lanes that may see key start + t (all of them in every slice but the last few) */  \
            const int masked = start + KEYS - 1 > first_pos || start < last_from;                                 \
            __m256 visible[KEYS];                                                                                 \
            for (int t = 0; masked && t < n8; t++) {                                                              \
                const __m256i key = _mm256_set1_epi32((int32_t)(start + t));                                      \
                visible[t] = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(seen_from, key),           \
                                                                     _mm256_cmpgt_epi32(seen_end, key)));         \
            }                                                                                                     \
            for (int g = 0; g < group; g++) {                                                                     \
                for (int t = 0; t < n8; t += 8) score8(qt[g], keys + t * head_dim, head_dim, s + t);              \
                __m256 top = m[g];                                                                                \
                for (int t = 0; t < n8; t++) {                                                                    \
                    if (masked) s[t] = _mm256_blendv_ps(_mm256_set1_ps(NO_SCORE), s[t], visible[t]);              \
                    top = _mm256_max_ps(top, s[t]);                                                               \
                }                                                                                                 \
                const __m256 c = exp8(_mm256_sub_ps(m[g], top)); /* exactly 1 where the max stayed */             \
                __m256 sum = _mm256_setzero_ps();                                                                 \
                for (int t = 0; t < n8; t++) {                                                                    \
                    s[t] = exp8(_mm256_sub_ps(s[t], top));                                                        \
                    if (masked) s[t] = _mm256_and_ps(s[t], visible[t]);                                           \
                    sum = _mm256_add_ps(sum, s[t]);                                                               \
                }                                                                                                 \
                l[g] = _mm256_add_ps(_mm256_mul_ps(l[g], c), sum), m[g] = top;                                    \
                add_values(acc[g], c, s, values, n8, head_dim);                                                   \
            }                                                                                                     \
        }                                                                                                         \
        for (int g = 0; g < group; g++) {                                                                         \
            const float* sums = (const float*)acc[g];                                                             \
            float inv[8];                                                                                         \
            _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), l[g])); /* l >= 1: the max's own weight */   \
            for (int r = 0; r < rows; r++) {                                                                      \
                T* o = out + ((int64_t)r * num_q_heads + h * group + g) * head_dim;                               \
                for (int d = 0; d < head_dim; d++) o[d] = STORE(sums[d * 8 + r] * inv[r]);                        \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

DEFINE_ATTEND(attend_avx2_tile_bf16, uint16_t, bf16_load, vload8_bf16, bf16_store)
DEFINE_ATTEND(attend_avx2_tile_f32, float, F32_LOAD, vload8_f32, F32_STORE)

int attend_avx2_takes(int head_dim, int block_size) {
    return head_dim % 8 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % 8 == 0;
}
#else
int attend_avx2_takes(int head_dim, int block_size) { (void)head_dim; (void)block_size; return 0; }
#endif
