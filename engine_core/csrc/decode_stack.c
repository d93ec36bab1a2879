// A decode-only step through a Llama-family layer stack on CPU in one call (engine_core/models/cpu_decode.py):
// the same kernels, in the same order and on the same buffers' values, as the Python layers call them one by
// one (engine_core/models/llama.py, granite.py, olmo2.py, gemma3.py), so the results are bit for bit the same. A
// one-row step calls about ten kernels per layer; from Python each call cost microseconds of module dispatch,
// tensor allocation and ctypes, which added up to about a third of a single stream's step.
#include "kernel_common.h"

// The kernels of the other files that a layer calls.
void rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out, int64_t rows,
                   int dim, float eps);
void gemma_rms_norm_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int dim, float eps);
void olmo_rms_norm_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int dim, float eps);
void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width);
void gelu_tanh_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width);
void rotary_bf16(uint16_t* x, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
                 int64_t row_stride, int num_heads, int head_dim, int rotary_dim);
void linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
            uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
int linear_grid_rows(void);
void fp8_from_bf16(const uint16_t* src, uint8_t* dst, int64_t n);
void paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_seqs,
                       int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                       int64_t window);

// Mirrored by the ctypes structures of engine_core/models/cpu_decode.py.
typedef struct {
    const void* packed;  // csrc/linear.c's panels
    const uint16_t* bias;  // or NULL
    int64_t format;  // linear's: bf16, int8 or int4 panels
    const void* few;  // the same weights' grid panels (engine_core/models/grid_weights.py), or NULL
    int64_t few_format;  // theirs: int8, or int4 summed as bf16
} PackedWeight;

// out = x w^T + bias: from w's grid panels for up to linear_grid_rows() rows where it has them, else from its
// panels (the same bf16 weights, the same bits), as PackedLinear chooses.
static void weight_linear(const uint16_t* x, int64_t ldx, int64_t rows, const PackedWeight* w, uint16_t* out,
                          int64_t ldo, int64_t n_len, int64_t k_len) {
    const int few = w->few && rows <= linear_grid_rows();
    linear(x, ldx, rows, few ? w->few : w->packed, (int)(few ? w->few_format : w->format), w->bias, out, ldo, n_len,
           k_len);
}

// A LoRA adapter's update of one linear (engine_core/lora.py): x -> (x A^T) B^T, A and B bf16 panels.
typedef struct {
    const void* a;  // [rank, in]; NULL: the adapter leaves this linear alone
    const void* b;  // [out, rank]
    int64_t rank;
} LoraPair;

typedef struct {
    const uint16_t *input_norm, *post_norm;  // before attention, before the MLP
    const uint16_t *attn_out_norm, *mlp_out_norm;  // Gemma's norms of attention's and the MLP's outputs, or NULL
    const uint16_t *q_norm, *k_norm;  // Qwen3's and Gemma's norms of each q and k head, or NULL
    const float *cos, *sin;  // this layer's rotary tables (Gemma's sliding and full layers have their own); NULL:
                             // a layer without position encoding (SmolLM3's NoPE layers)
    PackedWeight qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache;  // [blocks, block_size, num_kv_heads, head_dim]
    int64_t window;  // sliding window (each query sees its last `window` keys), 0 for none
    const LoraPair* lora[4];  // qkv, o, gate_up, down: one entry per adapter, or NULL where no adapter changes it
} DecodeLayer;

// This step's rows of each adapter: group g is adapter[g], rows[offsets[g] .. offsets[g + 1]).
typedef struct {
    int64_t num_groups;
    const int64_t *adapter, *offsets, *rows;
    uint16_t* work;  // the step's rows x (widest input + largest rank + widest output)
} LoraGroups;

// Whether an adapter may change this linear in this step (else add_lora adds nothing).
static int lora_applies(const LoraPair* pairs, const LoraGroups* g) { return pairs != NULL && g != NULL; }

// out[rows] += (x[rows] A^T) B^T for each group, as LoraLinear adds it: the same kernel on the gathered rows (a row's
// result does not depend on the rows beside it), then a bf16 add rounded as torch rounds it.
static void add_lora(const uint16_t* x, int64_t ldx, int64_t k, const LoraPair* pairs, const LoraGroups* g,
                     uint16_t* out, int64_t ldo, int64_t n) {
    if (!lora_applies(pairs, g)) return;
    for (int64_t gi = 0; gi < g->num_groups; gi++) {
        const LoraPair* p = &pairs[g->adapter[gi]];
        if (p->a == NULL) continue;
        const int64_t m = g->offsets[gi + 1] - g->offsets[gi];
        const int64_t* rows = g->rows + g->offsets[gi];
        uint16_t *xs = g->work, *t = xs + m * k, *d = t + m * p->rank;
        for (int64_t r = 0; r < m; r++) memcpy(xs + r * k, x + rows[r] * ldx, k * sizeof(uint16_t));
        linear(xs, k, m, p->a, 0, NULL, t, p->rank, p->rank, k);
        linear(t, p->rank, m, p->b, 0, NULL, d, n, n, p->rank);
        for (int64_t r = 0; r < m; r++) {
            uint16_t* o = out + rows[r] * ldo;
            const uint16_t* dr = d + r * n;
            for (int64_t j = 0; j < n; j++) o[j] = bf16_store(bf16_load(o[j]) + bf16_load(dr[j]));
        }
    }
}

typedef struct {
    int64_t num_layers, hidden, num_q_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t gemma;  // Gemma 3's layer: norms scale by 1 + weight, outputs normed before the residual add, GeGLU
    int64_t rotary_dim;  // the leading dims of each head that rotate (Phi-4-mini's partial rotary: 3/4 of them)
    int64_t olmo;  // OLMo 2's layer: no norm before attention or the MLP, each output normed (fp32, rounded once)
                   // before the residual add; q and k each normed as one vector over all their heads
    float eps, scale;
    float residual_mult;  // Granite's residual_multiplier on each attention and MLP output (1 elsewhere)
    int64_t kv_fp8;  // the KV cache holds fp8 (csrc/kv_fp8.c), else bf16
} StackShape;

// A norm of `rows` rows of `dim`: Llama's (with residual: residual += x first, then norm(residual)), Gemma's or
// OLMo's.
static void norm(const StackShape* s, const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                 int64_t rows, int64_t dim) {
    if (s->gemma) gemma_rms_norm_bf16(x, weight, out, rows, (int)dim, s->eps);
    else if (s->olmo) olmo_rms_norm_bf16(x, weight, out, rows, (int)dim, s->eps);
    else rms_norm_bf16(x, residual, weight, out, rows, (int)dim, s->eps);
}

// Gemma's and OLMo's residual add: residual += norm(x) (x, a layer's output, normed in place), rounded as torch adds.
static void add_normed(const StackShape* s, uint16_t* x, const uint16_t* weight, uint16_t* residual, int64_t rows) {
    norm(s, x, NULL, weight, x, rows, s->hidden);
    for (int64_t j = 0; j < rows * s->hidden; j++) residual[j] = bf16_store(bf16_load(residual[j]) + bf16_load(x[j]));
}

// x *= m, rounded as torch rounds a bf16 tensor times a float (Granite's residual_multiplier).
static void scale_rows(const StackShape* s, uint16_t* x, int64_t rows) {
    const float m = s->residual_mult;
    if (m == 1.f) return;
    for (int64_t j = 0; j < rows * s->hidden; j++) x[j] = bf16_store(bf16_load(x[j]) * m);
}

// bf16 elements of scratch a step of `rows` rows needs.
int64_t decode_stack_work(const StackShape* s, int64_t rows) {
    const int64_t q = s->num_q_heads * s->head_dim, kv = s->num_kv_heads * s->head_dim;
    return rows * (2 * s->hidden + (q + 2 * kv) + 2 * q + 3 * s->intermediate);
}

// x: [rows, hidden] the step's embeddings (used as scratch); out: [rows, hidden] the final norm's output.
// positions, slots, seq_lens: [rows]; block_tables: [rows, max_blocks]; lora: the step's adapter rows, or NULL.
// Llama's residual stream is added lazily, by the next norm; Gemma's is `residual` itself, added after each half.
void decode_stack_bf16(const DecodeLayer* layers, const StackShape* s, const uint16_t* final_norm, uint16_t* x,
                       uint16_t* out, int64_t rows, const int64_t* positions, const int64_t* slots,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens, uint16_t* work,
                       const LoraGroups* lora) {
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
    // Gemma and OLMo keep the residual stream in `residual` and add each normed output to it; OLMo's attention and
    // MLP read the stream itself.
    const int kept = s->gemma || s->olmo;
    const uint16_t* block_in = s->olmo ? residual : normed;
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecodeLayer* l = &layers[i];
        if (!s->olmo) norm(s, kept ? residual : x, i == 0 ? NULL : residual, l->input_norm, normed, rows, hidden);
        weight_linear(block_in, hidden, rows, &l->qkv, qkv, qkv_size, qkv_size, hidden);
        add_lora(block_in, hidden, hidden, l->lora[0], lora, qkv, qkv_size, qkv_size);
        for (int64_t r = 0; l->q_norm && r < rows; r++) {  // in place: the kernel reads a row before writing it
            uint16_t* row = qkv + r * qkv_size;
            const int64_t q_rows = s->olmo ? 1 : s->num_q_heads, k_rows = s->olmo ? 1 : s->num_kv_heads;
            norm(s, row, NULL, l->q_norm, row, q_rows, q_size / q_rows);
            norm(s, row + q_size, NULL, l->k_norm, row + q_size, k_rows, kv_size / k_rows);
        }
        if (l->cos)
            rotary_bf16(qkv, positions, l->cos, l->sin, rows, qkv_size, (int)(s->num_q_heads + s->num_kv_heads), (int)hd,
                        (int)s->rotary_dim);
        for (int64_t r = 0; r < rows; r++) {  // the new token's K/V into its slot; q made contiguous
            const uint16_t* row = qkv + r * qkv_size;
            if (s->kv_fp8) {
                fp8_from_bf16(row + q_size, (uint8_t*)l->k_cache + slots[r] * kv_size, kv_size);
                fp8_from_bf16(row + q_size + kv_size, (uint8_t*)l->v_cache + slots[r] * kv_size, kv_size);
            } else {
                memcpy(l->k_cache + slots[r] * kv_size, row + q_size, kv_size * sizeof(uint16_t));
                memcpy(l->v_cache + slots[r] * kv_size, row + q_size + kv_size, kv_size * sizeof(uint16_t));
            }
            memcpy(q + r * q_size, row, q_size * sizeof(uint16_t));
        }
        if (s->kv_fp8)  // DecodeStack.build took fp8 caches only where paged_decode_fp8 reads them
            paged_decode_fp8(q, (const uint8_t*)l->k_cache, (const uint8_t*)l->v_cache, block_tables, seq_lens, attn,
                             (int)rows, (int)s->num_q_heads, (int)s->num_kv_heads, (int)hd, (int)s->block_size,
                             (int)max_blocks, s->scale, l->window);
        else
            paged_decode_bf16(q, l->k_cache, l->v_cache, block_tables, seq_lens, attn, (int)rows, (int)s->num_q_heads,
                              (int)s->num_kv_heads, (int)hd, (int)s->block_size, (int)max_blocks, s->scale, l->window);
        weight_linear(attn, q_size, rows, &l->o, x, hidden, hidden, q_size);
        add_lora(attn, q_size, q_size, l->lora[1], lora, x, hidden, hidden);
        scale_rows(s, x, rows);
        if (kept) add_normed(s, x, l->attn_out_norm, residual, rows);
        if (!s->olmo) norm(s, kept ? residual : x, residual, l->post_norm, normed, rows, hidden);
        // One call where AMX runs it on bf16 panels and no adapter changes gate_up, as the Python layers take it
        // (LlamaMLP).
        if (l->gate_up.format != 0 || (l->gate_up.few && rows <= linear_grid_rows()) ||
            lora_applies(l->lora[2], lora) ||
            !glu_amx(block_in, hidden, rows, l->gate_up.packed, l->gate_up.bias, act, inter, inter, hidden, s->gemma)) {
            weight_linear(block_in, hidden, rows, &l->gate_up, gate_up, 2 * inter, 2 * inter, hidden);
            add_lora(block_in, hidden, hidden, l->lora[2], lora, gate_up, 2 * inter, 2 * inter);
            if (s->gemma) gelu_tanh_and_mul_bf16(gate_up, act, rows, (int)inter);
            else silu_and_mul_bf16(gate_up, act, rows, (int)inter);
        }
        weight_linear(act, inter, rows, &l->down, x, hidden, hidden, inter);
        add_lora(act, inter, inter, l->lora[3], lora, x, hidden, hidden);
        scale_rows(s, x, rows);
        if (kept) add_normed(s, x, l->mlp_out_norm, residual, rows);
    }
    norm(s, kept ? residual : x, residual, final_norm, out, rows, hidden);
}
