// The fp8 KV cache (--kv-cache-dtype fp8): keys and values stored as float8 e5m2, one byte each, which is the top
// byte of their fp16 form. Written here from bf16 (the decode stack's new rows; engine_core/attention/torch_backend.py
// writes the other rows with torch's conversion, which the tests hold equal to this one), and widened back to bf16
// here, exactly (every e5m2 value is a bf16 value), for the bf16 decode kernel to attend (csrc/decode_bf16.c).
#include "kernel_common.h"

#define E5M2_MAX_BF16 0x4760  // 57344, the largest finite e5m2 value: larger magnitudes saturate to it

// One bf16 value to e5m2, rounded to nearest even as torch rounds, after the clamp to +-57344 the torch path applies
// (so no value becomes infinite); NaN stays NaN. Integer arithmetic only: the kernels build with -ffast-math.
static inline uint8_t e5m2_from_bf16(uint16_t h) {
    const uint8_t sign = (uint8_t)((h >> 8) & 0x80);
    const uint32_t a = h & 0x7fff;  // magnitude: exponent (bias 127) << 7 | 7 mantissa bits
    if (a > 0x7f80) return sign | 0x7f;  // NaN
    if (a >= E5M2_MAX_BF16) return sign | 0x7b;
    if (a >= (113u << 7))  // a normal e5m2 (from 2^-14): exponent rebiased to 15, 5 mantissa bits dropped
        return sign | (uint8_t)((a - (112u << 7) + 0xf + ((a >> 5) & 1)) >> 5);
    // Below 2^-14: a multiple of e5m2's subnormal step 2^-16, value = mant * 2^(e - 134) = mant >> (118 - e) steps.
    const uint32_t e = a >> 7, mant = 128 | (a & 0x7f), shift = 118 - e;
    if (e == 0 || shift > 9) return sign;  // under half a step: 0
    const uint32_t q = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    return sign | (uint8_t)(q + (rest > half || (rest == half && (q & 1))));
}

// dst[i] = e5m2(src[i]) for n values.
void fp8_from_bf16(const uint16_t* src, uint8_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = e5m2_from_bf16(src[i]);
}

// 32 e5m2 values at p widened to bf16 at out: as fp16 (the byte shifted up), to fp32, to bf16, each step exact.
static inline void widen32(const uint8_t* p, uint16_t* out) {
#if defined(__AVX512BF16__)
    const __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)), 8);
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    _mm512_storeu_si512((void*)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    for (int i = 0; i < 32; i++) {
        const uint32_t b = p[i], e = (b >> 2) & 0x1f, m = b & 3;
        // normal: exponent 15 -> 127; subnormal m * 2^-16: the bf16 of 2^-16 (m = 1), 2^-15 (2), 1.5 * 2^-15 (3)
        const uint16_t mag = e ? (uint16_t)(((e + 112) << 7) | (m << 5)) : (uint16_t)(m == 0 ? 0 : m == 1 ? 111 << 7 : (112 << 7) | (m == 3 ? 0x40 : 0));
        out[i] = (uint16_t)((b & 0x80) << 8) | (e == 31 ? (uint16_t)(0x7f80 | (m << 5)) : mag);
    }
#endif
}

// The first `keys` rows of the blocks in `table` (block_size rows of `stride` bytes each) widened to bf16, one after
// the other in out; the next block is fetched into L1 while one is widened. stride % 32 == 0.
void bf16_from_fp8_blocks(const uint8_t* cache, const int64_t* table, int64_t keys, int block_size, int64_t stride,
                          uint16_t* out) {
    const int64_t block_bytes = block_size * stride, blocks = (keys + block_size - 1) / block_size;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* src = cache + table[b] * block_bytes;
        if (b + 1 < blocks)
            for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(cache + table[b + 1] * block_bytes + off);
        const int64_t n = (keys - b * block_size < block_size ? keys - b * block_size : block_size) * stride;
        for (int64_t i = 0; i < n; i += 32) widen32(src + i, out + b * block_bytes + i);
    }
}

// Whether decode_bf16 (csrc/decode_bf16.c) attends fp8 caches on this build: it needs AVX512-BF16 (and head_dim % 32
// == 0, which the caller checks).
int decode_fp8_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
