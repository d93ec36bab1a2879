// Paged attention of a tile of prefill query rows (up to 8) on CPUs with AVX2 + FMA and no AVX-512, over bf16 or
// fp32 K/V, scoring 8 keys at a time: csrc/attend_bf16.c's plan with fp32 FMAs.
// For each 8-key slice of a block and each KV head:
//   - the keys are transposed once, widened to fp32 (lane t of kt[d] holds key t's dim d), so that a query head
//     scores all 8 keys with one broadcast FMA per dim and no horizontal sum per key (the row-at-a-time kernel of
//     csrc/paged_prefill.c took 15 ms a layer for 512 rows, torch's flash attention 8);
//   - an 8-lane online-softmax step, then each row and query head of the tile adds the 8 keys' weighted values.
// Every query row is computed alone, in the same order whatever else is in its tile: keys its row may not see
// get a weight of exactly 0. Needs head_dim % 8 == 0 and block_size % 8 == 0 (attend_avx2_takes).
#include "kernel_common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define KEYS 8

#define DEFINE_ATTEND(NAME, T, LOAD)                                                                              \
void NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,         \
          int64_t first_pos, int rows, T* out, int num_q_heads, int num_kv_heads, int head_dim, int block_size,  \
          float scale) {                                                                                         \
    const int group = num_q_heads / num_kv_heads, nv = head_dim / 8;                                             \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;                 \
    float qs[rows][num_q_heads][head_dim], m[rows][num_q_heads], l[rows][num_q_heads], w[KEYS];                 \
    __m256 acc[rows][num_q_heads][nv], kt[ATTEND_MAX_DIM], vs[KEYS][ATTEND_MAX_DIM / 8];                        \
    for (int r = 0; r < rows; r++)                                                                               \
        for (int i = 0; i < num_q_heads; i++) {                                                                  \
            for (int d = 0; d < head_dim; d++) qs[r][i][d] = LOAD(q[r * q_row_stride + i * head_dim + d]) * scale; \
            for (int j = 0; j < nv; j++) acc[r][i][j] = _mm256_setzero_ps();                                     \
            m[r][i] = NO_SCORE, l[r][i] = 0.f;                                                                   \
        }                                                                                                        \
    const int64_t context = first_pos + rows; /* keys the last row of the tile sees */                           \
    for (int64_t start = 0; start < context; start += KEYS) {                                                    \
        const int64_t at = table[start / block_size] * block_elems + start % block_size * stride;               \
        const int n = (int)(context - start < KEYS ? context - start : KEYS);                                    \
        int visible[rows]; /* keys of this slice row r may see: a prefix of it */                                \
        for (int r = 0; r < rows; r++) {                                                                         \
            const int64_t v = first_pos + r + 1 - start;                                                         \
            visible[r] = (int)(v < 0 ? 0 : v > KEYS ? KEYS : v);                                                 \
        }                                                                                                        \
        for (int h = 0; h < num_kv_heads; h++) {                                                                 \
            float* keys = (float*)kt;                                                                            \
            float* values = (float*)vs;                                                                          \
            for (int t = 0; t < KEYS; t++) { /* zeros past the last key: 0 x 0, never 0 x garbage */             \
                const T* k = k_cache + at + t * stride + h * head_dim;                                           \
                const T* v = v_cache + at + t * stride + h * head_dim;                                           \
                for (int d = 0; d < head_dim; d++) keys[d * KEYS + t] = t < n ? LOAD(k[d]) : 0.f;                \
                for (int d = 0; d < head_dim; d++) values[t * (ATTEND_MAX_DIM) + d] = t < n ? LOAD(v[d]) : 0.f;  \
            }                                                                                                    \
            for (int r = 0; r < rows; r++)                                                                       \
                for (int g = 0; g < (visible[r] ? group : 0); g++) {                                             \
                    const int i = h * group + g;                                                                 \
                    const float* qh = qs[r][i];                                                                  \
                    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),                \
                                   _mm256_setzero_ps()};                                                         \
                    for (int d = 0; d < head_dim; d += 4) /* four chains: an FMA takes four cycles */            \
                        for (int c = 0; c < 4; c++) s[c] = _mm256_fmadd_ps(_mm256_set1_ps(qh[d + c]), kt[d + c], s[c]); \
                    const __m256 scores = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));   \
                    const __m256 c = _mm256_set1_ps(softmax8(scores, visible[r], &m[r][i], &l[r][i], w));        \
                    __m256 wt[KEYS];                                                                             \
                    for (int t = 0; t < KEYS; t++) wt[t] = _mm256_set1_ps(w[t]);                                 \
                    for (int j = 0; j < nv; j++) {                                                               \
                        __m256 a = _mm256_mul_ps(acc[r][i][j], c);                                               \
                        for (int t = 0; t < KEYS; t++) a = _mm256_fmadd_ps(wt[t], vs[t][j], a);                  \
                        acc[r][i][j] = a;                                                                        \
                    }                                                                                            \
                }                                                                                                \
        }                                                                                                        \
    }                                                                                                            \
    for (int r = 0; r < rows; r++)                                                                               \
        for (int i = 0; i < num_q_heads; i++) {                                                                  \
            const float inv = l[r][i] > 0.f ? 1.f / l[r][i] : 0.f, *sums = (const float*)acc[r][i];              \
            T* o = out + ((int64_t)r * num_q_heads + i) * head_dim;                                              \
            for (int d = 0; d < head_dim; d++) o[d] = STORE_AS_##T(sums[d] * inv);                               \
        }                                                                                                        \
}

#define STORE_AS_uint16_t bf16_store
#define STORE_AS_float F32_STORE
DEFINE_ATTEND(attend_avx2_tile_bf16, uint16_t, bf16_load)
DEFINE_ATTEND(attend_avx2_tile_f32, float, F32_LOAD)

int attend_avx2_takes(int head_dim, int block_size) {
    return head_dim % 8 == 0 && head_dim <= ATTEND_MAX_DIM && block_size % KEYS == 0;
}
#else
int attend_avx2_takes(int head_dim, int block_size) { (void)head_dim; (void)block_size; return 0; }
#endif
