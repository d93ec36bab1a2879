// A decode-only step through a Llama-family layer stack on CPU in one call (engine_core/models/cpu_decode.py):
// the same kernels, in the same order and on the same buffers' values, as the Python layers call them one by
// one (engine_core/models/llama.py), so the results are bit for bit the same. A one-row step calls about ten
// kernels per layer; from Python each call cost microseconds of module dispatch, tensor allocation and ctypes,
// which added up to about a third of a single stream's step.
#include "kernel_common.h"

// The kernels of the other files that a layer calls.
void rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out, int64_t rows,
                   int dim, float eps);
void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width);
void rotary_bf16(uint16_t* x, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
                 int64_t row_stride, int num_heads, int head_dim);
void linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int q8, const uint16_t* bias,
            uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
void paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_seqs,
                       int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                       int64_t window);

// Mirrored by the ctypes structures of engine_core/models/cpu_decode.py.
typedef struct {
    const void* packed;  // csrc/linear.c's panels
    const uint16_t* bias;  // or NULL
    int64_t q8;  // int8 panels
} PackedWeight;

typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint16_t *q_norm, *k_norm;  // Qwen3's norms of each q and k head, or NULL
    PackedWeight qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;  // [blocks, block_size, num_kv_heads, head_dim]
    int64_t window;  // sliding window (each query sees its last `window` keys), 0 for none
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, num_q_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} StackShape;

// bf16 elements of scratch a step of `rows` rows needs.
int64_t decode_stack_work(const StackShape* s, int64_t rows) {
    const int64_t q = s->num_q_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
    return rows * (2 * s->hidden + (q + 2 * kv) + 2 * q + 3 * s->intermediate);
}

// x: [rows, hidden] the step's embeddings (used as scratch); out: [rows, hidden] the final norm's output.
// positions, slots, seq_lens: [rows]; block_tables: [rows, max_blocks]; cos/sin: the fp32 rotary tables.
void decode_stack_bf16(const DecodeLayer* layers, const StackShape* s, const uint16_t* final_norm, uint16_t* x,
                       uint16_t* out, int64_t rows, const int64_t* positions, const float* cos, const float* sin,
                       const int64_t* slots, const int64_t* block_tables, int64_t max_blocks,
                       const int64_t* seq_lens, uint16_t* work) {
    const int64_t hidden = s->hidden, inter = s->intermediate, hd = s->head_dim;
    const int64_t q_size = s->num_q_heads * hd, kv_size = s->num_kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    uint16_t* residual = work;
    uint16_t* normed = residual + rows * hidden;
    uint16_t* qkv = normed + rows * hidden;
    uint16_t* q = qkv + rows * qkv_size;
    uint16_t* attn = q + rows * q_size;
    uint16_t* gate_up = attn + rows * q_size;
    uint16_t* act = gate_up + rows * 2 * inter;
    memcpy(residual, x, rows * hidden * sizeof(uint16_t));  // the first layer's residual is its input
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecodeLayer* l = &layers[i];
        if (i == 0) rms_norm_bf16(x, NULL, l->input_norm, normed, rows, (int)hidden, s->eps);
        else rms_norm_bf16(x, residual, l->input_norm, normed, rows, (int)hidden, s->eps);
        linear(normed, hidden, rows, l->qkv.packed, (int)l->qkv.q8, l->qkv.bias, qkv, qkv_size, qkv_size, hidden);
        for (int64_t r = 0; l->q_norm && r < rows; r++) {  // in place: the kernel reads a row before writing it
            uint16_t* row = qkv + r * qkv_size;
            rms_norm_bf16(row, NULL, l->q_norm, row, s->num_q_heads, (int)hd, s->eps);
            rms_norm_bf16(row + q_size, NULL, l->k_norm, row + q_size, s->num_kv_heads, (int)hd, s->eps);
        }
        rotary_bf16(qkv, positions, cos, sin, rows, qkv_size, (int)(s->num_q_heads + s->num_kv_heads), (int)hd);
        for (int64_t r = 0; r < rows; r++) {  // the new token's K/V into its slot; q made contiguous
            const uint16_t* row = qkv + r * qkv_size;
            memcpy(l->k_cache + slots[r] * kv_size, row + q_size, kv_size * sizeof(uint16_t));
            memcpy(l->v_cache + slots[r] * kv_size, row + q_size + kv_size, kv_size * sizeof(uint16_t));
            memcpy(q + r * q_size, row, q_size * sizeof(uint16_t));
        }
        paged_decode_bf16(q, l->k_cache, l->v_cache, block_tables, seq_lens, attn, (int)rows, (int)s->num_q_heads,
                          (int)s->num_kv_heads, (int)hd, (int)s->block_size, (int)max_blocks, s->scale, l->window);
        linear(attn, q_size, rows, l->o.packed, (int)l->o.q8, l->o.bias, x, hidden, hidden, q_size);
        rms_norm_bf16(x, residual, l->post_norm, normed, rows, (int)hidden, s->eps);
        linear(normed, hidden, rows, l->gate_up.packed, (int)l->gate_up.q8, l->gate_up.bias, gate_up, 2 * inter,
               2 * inter, hidden);
        silu_and_mul_bf16(gate_up, act, rows, (int)inter);
        linear(act, inter, rows, l->down.packed, (int)l->down.q8, l->down.bias, x, hidden, hidden, inter);
    }
    rms_norm_bf16(x, residual, final_norm, out, rows, (int)hidden, s->eps);
}
