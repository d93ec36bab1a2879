// Paged attention for single-token decodes on CPU: one pass over each sequence's blocks with an
// online softmax, reading K/V straight from the cache (no gather copy). fp32 math; bf16 or fp32 storage.
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,                 \
          const int64_t* seq_lens, T* out, int num_seqs, int num_q_heads, int num_kv_heads,             \
          int head_dim, int block_size, int max_blocks, float scale) {                                  \
    const int group = num_q_heads / num_kv_heads;                                                       \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                         \
    for (int s = 0; s < num_seqs; s++) {                                                                 \
        for (int h = 0; h < num_kv_heads; h++) {                                                         \
            float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];          \
            float scores[MAX_GROUP][MAX_BLOCK], kf[MAX_DIM];                                            \
            for (int g = 0; g < group; g++) {                                                            \
                const T* qp = q + ((int64_t)s * num_q_heads + h * group + g) * head_dim;                 \
                for (int d = 0; d < head_dim; d++) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; } \
                m[g] = -INFINITY; l[g] = 0.f;                                                            \
            }                                                                                            \
            const int64_t len = seq_lens[s];                                                             \
            for (int64_t start = 0; start < len; start += block_size) {                                 \
                const int64_t block = block_tables[(int64_t)s * max_blocks + start / block_size];       \
                const int n = (int)(len - start < block_size ? len - start : block_size);                \
                const int64_t stride = (int64_t)num_kv_heads * head_dim;                                 \
                const T* kb = k_cache + block * block_size * stride + (int64_t)h * head_dim;             \
                const T* vb = v_cache + block * block_size * stride + (int64_t)h * head_dim;             \
                for (int t = 0; t < n; t++) {                                                            \
                    for (int d = 0; d < head_dim; d++) kf[d] = LOAD(kb[t * stride + d]);                 \
                    for (int g = 0; g < group; g++) {                                                    \
                        float dot = 0.f;                                                                 \
                        for (int d = 0; d < head_dim; d++) dot += qf[g][d] * kf[d];                      \
                        scores[g][t] = dot;                                                              \
                    }                                                                                    \
                }                                                                                        \
                for (int g = 0; g < group; g++) {                                                        \
                    float block_max = m[g];                                                              \
                    for (int t = 0; t < n; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max; \
                    const float correction = expf(m[g] - block_max);                                    \
                    l[g] *= correction;                                                                  \
                    for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;                         \
                    for (int t = 0; t < n; t++) { scores[g][t] = expf(scores[g][t] - block_max); l[g] += scores[g][t]; } \
                    m[g] = block_max;                                                                    \
                }                                                                                        \
                for (int t = 0; t < n; t++) {                                                            \
                    for (int d = 0; d < head_dim; d++) kf[d] = LOAD(vb[t * stride + d]);                 \
                    for (int g = 0; g < group; g++) {                                                    \
                        const float p = scores[g][t];                                                    \
                        for (int d = 0; d < head_dim; d++) acc[g][d] += p * kf[d];                       \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (int g = 0; g < group; g++) {                                                            \
                T* op = out + ((int64_t)s * num_q_heads + h * group + g) * head_dim;                     \
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                         \
                for (int d = 0; d < head_dim; d++) op[d] = STORE(acc[g][d] * inv);                       \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(paged_decode_f32, float, IDENTITY, IDENTITY)

int paged_decode_limits(int* max_group, int* max_dim, int* max_block) {
    *max_group = MAX_GROUP; *max_dim = MAX_DIM; *max_block = MAX_BLOCK;
    return 0;
}
