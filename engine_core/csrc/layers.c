// Fused elementwise layers for CPU: residual add + RMSNorm, Gemma's RMSNorm, SiLU- and GELU-and-multiply, rotary
// embedding.
// Each replaces several torch ops (and their temporaries) with one pass over the rows; fp32 math.
// Intermediate results are rounded to the storage type where the torch path rounds them, so the two
// differ only by the order of float additions.
#include "kernel_common.h"

#define MAX_HIDDEN 16384
#define PARALLEL_MIN_ELEMENTS 65536  // below this, waking the thread pool costs more than it saves

// With residual: residual = x + residual (kept in place for the next layer), out = norm(residual) * weight.
// Without: out = norm(x) * weight.
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                            \
void NAME(const T* x, T* residual, const T* weight, T* out, int64_t rows, int dim, float eps) {         \
    _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)")                                \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        float v[MAX_HIDDEN];                                                                             \
        const T* xr = x + r * dim;                                                                       \
        if (residual) {                                                                                  \
            T* rr = residual + r * dim;                                                                  \
            for (int d = 0; d < dim; d++) { T sum = STORE(LOAD(xr[d]) + LOAD(rr[d])); rr[d] = sum; v[d] = LOAD(sum); } \
        } else {                                                                                         \
            for (int d = 0; d < dim; d++) v[d] = LOAD(xr[d]);                                            \
        }                                                                                                \
        float squares = 0.f;                                                                             \
        for (int d = 0; d < dim; d++) squares += v[d] * v[d];                                            \
        const float inv_rms = 1.f / sqrtf(squares / dim + eps);                                          \
        T* o = out + r * dim;                                                                            \
        for (int d = 0; d < dim; d++) o[d] = STORE(LOAD(STORE(v[d] * inv_rms)) * LOAD(weight[d]));       \
    }                                                                                                    \
}

// An RMSNorm scaled in fp32 and rounded once: out = norm(x) * (ONE + weight). Gemma's (ONE 1: its checkpoints store
// the weight minus one) and OLMo 2's (ONE 0). out may be x: each element is read before it is written.
#define DEFINE_FP32_SCALED_RMS_NORM(NAME, T, LOAD, STORE, ONE)                                           \
void NAME(const T* x, const T* weight, T* out, int64_t rows, int dim, float eps) {                       \
    _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)")                                \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T* xr = x + r * dim;                                                                       \
        float squares = 0.f;                                                                             \
        for (int d = 0; d < dim; d++) squares += LOAD(xr[d]) * LOAD(xr[d]);                              \
        const float inv_rms = 1.f / sqrtf(squares / dim + eps);                                          \
        T* o = out + r * dim;                                                                            \
        for (int d = 0; d < dim; d++) o[d] = STORE(LOAD(xr[d]) * inv_rms * (ONE + LOAD(weight[d])));     \
    }                                                                                                    \
}

// x: [rows, 2 * width] holding gate then up; out: [rows, width] = act(gate) * up, the activation rounded to T first
// as torch rounds it. ACT: SiLU (SwiGLU) or GELU's tanh approximation (Gemma's GeGLU), each g / (1 + exp(-t)) with
// t clamped below exp's overflow: under -ffast-math a division by infinity is not 0 but NaN (a gate below -88 made
// SwiGLU's output NaN). GELU's 0.5 g (1 + tanh(u)) is written as g sigmoid(2u): the same function, without
// 1 + tanh(u) cancelling to nothing for negative g.
#define SIGMOID_DIV(g, t) ((g) / (1.f + expf(fminf(-(t), 88.f))))
#define SILU(g) SIGMOID_DIV(g, g)
#define GELU_TANH(g) SIGMOID_DIV(g, 1.5957691216f * ((g) + 0.044715f * (g) * (g) * (g)))
#define DEFINE_ACT_AND_MUL(NAME, T, LOAD, STORE, ACT)                                                    \
void NAME(const T* x, T* out, int64_t rows, int width) {                                                 \
    _Pragma("omp parallel for if (rows * width >= PARALLEL_MIN_ELEMENTS)")                              \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T* gate = x + r * 2 * width;                                                               \
        const T* up = gate + width;                                                                      \
        T* o = out + r * width;                                                                          \
        for (int i = 0; i < width; i++) {                                                                \
            const float g = LOAD(gate[i]);                                                               \
            o[i] = STORE(LOAD(STORE(ACT(g))) * LOAD(up[i]));                                             \
        }                                                                                                \
    }                                                                                                    \
}

// In place on the first num_heads heads of each row (q and k heads lie next to each other), on the first rotary_dim
// dims of each head (head_dim, or fewer for a partial rotary: the rest pass through); rotate-half layout over those;
// cos/sin: fp32 tables [max_positions, rotary_dim] whose two halves are equal.
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                              \
void NAME(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t rows,             \
          int64_t row_stride, int num_heads, int head_dim, int rotary_dim) {                             \
    const int half = rotary_dim / 2;                                                                     \
    _Pragma("omp parallel for if (rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)")               \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const float* c = cos + positions[r] * rotary_dim;                                                \
        const float* s = sin + positions[r] * rotary_dim;                                                \
        for (int h = 0; h < num_heads; h++) {                                                            \
            T* x1 = x + r * row_stride + (int64_t)h * head_dim;                                          \
            T* x2 = x1 + half;                                                                           \
            for (int i = 0; i < half; i++) {                                                             \
                const float a = LOAD(x1[i]), b = LOAD(x2[i]);                                            \
                x1[i] = STORE(a * c[i] - b * s[i]);                                                      \
                x2[i] = STORE(b * c[i + half] + a * s[i + half]);                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
}

#if defined(__AVX512BF16__)
// The bf16 RMSNorm and activations 16 values at a time: the compiler leaves the loops above scalar around expf and
// the bf16 roundings, which made SwiGLU a third of a 2048-token prefill step's time outside the matmuls. The same
// roundings; exp16 for expf; a row's squares summed in 16 lanes, then across them.
static inline void store_bf16(uint16_t* p, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

void rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out, int64_t rows, int dim,
                   float eps) {
    _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* v = residual ? residual + r * dim : x + r * dim;  // the normed row, once the sum is stored
        __m512 squares = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 16) {
            const __mmask16 mask = first_lanes(dim - d);
            __m512 value = vload_bf16_masked(x + r * dim + d, mask);
            if (residual) {
                const __m256bh sum = _mm512_cvtneps_pbh(_mm512_add_ps(value, vload_bf16_masked(v + d, mask)));
                _mm256_mask_storeu_epi16(residual + r * dim + d, mask, (__m256i)sum);
                value = vwiden_bf16((__m256i)sum);
            }
            squares = _mm512_fmadd_ps(value, value, squares);
        }
        const __m512 inv_rms = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps));
        for (int d = 0; d < dim; d += 16) {
            const __mmask16 mask = first_lanes(dim - d);
            const __m512 scaled = _mm512_mul_ps(vload_bf16_masked(v + d, mask), inv_rms);
            const __m512 normed = vwiden_bf16((__m256i)_mm512_cvtneps_pbh(scaled));
            store_bf16(out + r * dim + d, mask, _mm512_mul_ps(normed, vload_bf16_masked(weight + d, mask)));
        }
    }
}

static void act_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width, int gelu) {
    _Pragma("omp parallel for if (rows * width >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < rows; r++)
        for (int i = 0; i < width; i += 16) {
            const __mmask16 mask = first_lanes(width - i);
            const uint16_t* gate = x + r * 2 * width + i;
            const __m512 act = vwiden_bf16((__m256i)_mm512_cvtneps_pbh(act16(vload_bf16_masked(gate, mask), gelu)));
            store_bf16(out + r * width + i, mask, _mm512_mul_ps(act, vload_bf16_masked(gate + width, mask)));
        }
}
void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width) {
    act_and_mul_bf16(x, out, rows, width, 0);
}
void gelu_tanh_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width) {
    act_and_mul_bf16(x, out, rows, width, 1);
}
#else
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ACT_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_load, bf16_store, SILU)
DEFINE_ACT_AND_MUL(gelu_tanh_and_mul_bf16, uint16_t, bf16_load, bf16_store, GELU_TANH)
#endif
DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE)
DEFINE_FP32_SCALED_RMS_NORM(gemma_rms_norm_bf16, uint16_t, bf16_load, bf16_store, 1.f)
DEFINE_FP32_SCALED_RMS_NORM(gemma_rms_norm_f32, float, F32_LOAD, F32_STORE, 1.f)
DEFINE_FP32_SCALED_RMS_NORM(olmo_rms_norm_bf16, uint16_t, bf16_load, bf16_store, 0.f)
DEFINE_FP32_SCALED_RMS_NORM(olmo_rms_norm_f32, float, F32_LOAD, F32_STORE, 0.f)
DEFINE_ACT_AND_MUL(silu_and_mul_f32, float, F32_LOAD, F32_STORE, SILU)
DEFINE_ACT_AND_MUL(gelu_tanh_and_mul_f32, float, F32_LOAD, F32_STORE, GELU_TANH)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ROTARY(rotary_f32, float, F32_LOAD, F32_STORE)

int layers_max_hidden(void) { return MAX_HIDDEN; }
