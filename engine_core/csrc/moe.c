// The experts of a mixture-of-experts layer (engine_core/models/moe.py) in one call: from Python, each expert
// with tokens cost several module calls, allocations and ctypes crossings (a layer of 128 experts about as long as
// reading their weights). The same kernels as the expert layers call one by one, on the same rows, so each row's
// bits are those of the experts run from Python.
#include "kernel_common.h"

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int width);
void linear(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
            uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);

// x: bf16 [tokens, hidden]; slots: the token of each (token, choice) slot, grouped by expert (counts[e] slots for
// expert e, in expert order); gate_up[e], down[e]: expert e's packed weights ([2 * inter, hidden] and [hidden,
// inter], bf16, int8 or int4 panels: linear's format); work: bf16 [max count * (hidden + 3 * inter)]; out: bf16
// [slots, hidden], row i the output of slot i's expert for slot i's token.
void moe_experts_bf16(const uint16_t* x, int64_t hidden, const int64_t* slots, const int64_t* counts,
                      int64_t num_experts, const void* const* gate_up, const void* const* down, int format,
                      int64_t inter, uint16_t* work, uint16_t* out) {
    int64_t start = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t n = counts[e];
        if (n == 0) continue;
        uint16_t* rows = work;  // [n, hidden]
        uint16_t* gu = rows + n * hidden;  // [n, 2 * inter]
        uint16_t* act = gu + n * 2 * inter;  // [n, inter]
        for (int64_t i = 0; i < n; i++) memcpy(rows + i * hidden, x + slots[start + i] * hidden, hidden * 2);
        linear(rows, hidden, n, gate_up[e], format, NULL, gu, 2 * inter, 2 * inter, hidden);
        silu_and_mul_bf16(gu, act, n, (int)inter);
        linear(act, inter, n, down[e], format, NULL, out + start * hidden, hidden, hidden, inter);
        start += n;
    }
}
