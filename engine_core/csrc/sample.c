// Random sampling on CPU for rows that need only a temperature (no top-k / top-p / min-p, no logits processors,
// no logprobs): the inverse CDF of softmax(x / T) at one uniform number per row. torch's exponential race draws
// one random number per vocabulary entry (51 ms for a [64, 49152] batch here, the largest part of a decode step);
// this draws one per row and makes three passes over the row. A row with T <= 0 is greedy (first maximum).
#include <math.h>

#include "kernel_common.h"

#define DEFINE_SAMPLE(NAME, T, LOAD)                                                                      \
void NAME(const T* x, int64_t rows, int64_t cols, const float* temps, const float* uniforms, float* scratch, \
          int64_t* out) {                                                                                \
    _Pragma("omp parallel for if (rows * cols >= 1 << 16)")                                              \
    for (int64_t r = 0; r < rows; r++) {                                                                 \
        const T* row = x + r * cols;                                                                     \
        float* e = scratch + r * cols;                                                                   \
        float m = LOAD(row[0]);                                                                          \
        for (int64_t c = 1; c < cols; c++) m = fmaxf(m, LOAD(row[c]));                                   \
        int64_t pick = 0;                                                                                \
        if (temps[r] <= 0.0f) {                                                                          \
            while (pick < cols - 1 && LOAD(row[pick]) != m) pick++;                                      \
        } else {                                                                                         \
            const float inv_t = 1.0f / temps[r];                                                         \
            float sum = 0.0f;                                                                            \
            for (int64_t c = 0; c < cols; c++) {                                                         \
                e[c] = expf((LOAD(row[c]) - m) * inv_t);                                                 \
                sum += e[c];                                                                             \
            }                                                                                            \
            const float target = uniforms[r] * sum;                                                      \
            float acc = 0.0f;                                                                            \
            pick = -1;                                                                                   \
            for (int64_t c = 0; c < cols; c++) {                                                         \
                acc += e[c];                                                                             \
                if (acc > target && e[c] > 0.0f) { pick = c; break; }                                    \
            }                                                                                            \
            if (pick < 0) {  /* rounding left the running sum below the target: the last likely token */ \
                pick = cols - 1;                                                                         \
                while (pick > 0 && e[pick] == 0.0f) pick--;                                              \
            }                                                                                            \
        }                                                                                                \
        out[r] = pick;                                                                                   \
    }                                                                                                    \
}

DEFINE_SAMPLE(sample_rows_bf16, uint16_t, bf16_load)
DEFINE_SAMPLE(sample_rows_f32, float, F32_LOAD)
