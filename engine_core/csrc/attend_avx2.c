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

// e^x in 8 lanes, to fp32 rounding: e^x = 2^k e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by the Cephes
// polynomial (kernel_common.h's exp16). Inputs below -87 give e^-87 (2^k must stay a normal float): the callers
// zero the lanes that must be 0, and a weight of 1e-38 beside the slice's largest, 1, adds nothing.
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_k));
}

// Folds 8 scores, the first `visible` real, into a head's running max m and sum l; writes the weights
// e^(s - max) (0 past `visible`) to w and returns the factor the head's accumulator must be scaled by.
static inline float softmax8(__m256 s, int visible, float* m, float* l, float* w) {
    const __m256 real = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(visible), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float lanes[KEYS];
    _mm256_storeu_ps(lanes, s);
    float new_max = *m;
    for (int t = 0; t < visible; t++) new_max = lanes[t] > new_max ? lanes[t] : new_max;
    const __m256 p = _mm256_and_ps(real, exp8(_mm256_sub_ps(s, _mm256_set1_ps(new_max))));
    const float correction = new_max == *m ? 1.f : expf(*m - new_max);  // e^0 is exactly 1
    *l = *l * correction + hsum8(p);
    *m = new_max;
    _mm256_storeu_ps(w, p);
    return correction;
}

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
