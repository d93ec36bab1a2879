// The fp8 KV cache (--kv-cache-dtype fp8): keys and values stored as float8 e4m3 (vLLM's fp8: 4 exponent bits, 3
// mantissa bits, finite up to 448, no infinities), one byte each. Written here from bf16 (the decode stack's new rows;
// engine_core/attention/torch_backend.py writes the other rows with torch's conversion, which the tests hold equal to
// this one), and widened back to bf16 here, exactly (every e4m3 value is a bf16 value), for the bf16 decode kernel
// to attend (csrc/decode_bf16.c); csrc/decode_avx2.c widens its rows to fp32 itself.
#include "kernel_common.h"

#define E4M3_MAX_BF16 0x43e0  // 448, the largest e4m3 value: larger magnitudes saturate to it

// One bf16 value to e4m3, rounded to nearest even as torch rounds, after the clamp to +-448 the torch path applies;
// NaN becomes 0, as there (the cache holds no NaN: csrc/decode_avx2.c reads without checking). Integer arithmetic
// only: the kernels build with -ffast-math.
static inline uint8_t e4m3_from_bf16(uint16_t h) {
    const uint8_t sign = (uint8_t)((h >> 8) & 0x80);
    const uint32_t a = h & 0x7fff;  // magnitude: exponent (bias 127) << 7 | 7 mantissa bits
    if (a > 0x7f80) return 0;  // NaN
    if (a >= E4M3_MAX_BF16) return sign | 0x7e;
    if (a >= (121u << 7))  // a normal e4m3 (from 2^-6): exponent rebiased to 7, 4 mantissa bits dropped
        return sign | (uint8_t)((a - (120u << 7) + 0x7 + ((a >> 4) & 1)) >> 4);
    // Below 2^-6: a multiple of e4m3's subnormal step 2^-9, value = mant * 2^(e - 134) = mant >> (125 - e) steps.
    const uint32_t e = a >> 7, mant = 128 | (a & 0x7f), shift = 125 - e;
    if (e == 0 || shift > 8) return sign;  // at most half a step: 0
    const uint32_t q = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    return sign | (uint8_t)(q + (rest > half || (rest == half && (q & 1))));
}

// dst[i] = e4m3(src[i]) for n values.
void fp8_from_bf16(const uint16_t* src, uint8_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = e4m3_from_bf16(src[i]);
}

// The bf16 magnitude of an e4m3 one (7 bits): normal ones rebiased (7 -> 127); subnormal m * 2^-9, normalized.
static inline uint16_t bf16_magnitude(uint32_t mag) {
    const uint32_t e = mag >> 3, m = mag & 7;
    if (mag == 0x7f) return 0x7fc0;  // NaN
    if (e) return (uint16_t)(((e + 120) << 7) | (m << 4));
    if (m == 0) return 0;
    const uint32_t p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 2^p + the rest
    return (uint16_t)(((118 + p) << 7) | ((m << (7 - p)) & 0x7f));
}

// 32 e4m3 values at p widened to bf16 at out.
static inline void widen32(const uint8_t* p, uint16_t* out) {
#if defined(__AVX512BF16__)
    static const uint16_t subnormal[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};  // m * 2^-9
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512((const void*)subnormal));
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
    r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_andnot_si512(mag, x), 8));  // the sign bit, moved up
    _mm512_storeu_si512((void*)out, r);
#else
    for (int i = 0; i < 32; i++) out[i] = (uint16_t)((p[i] & 0x80) << 8) | bf16_magnitude(p[i] & 0x7fu);
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// The low and high bytes of bf16_magnitude for the 128 magnitudes, and the byte order widen64's unpacks undo.
static uint8_t magnitude_lo[128], magnitude_hi[128], unpack_order[64];
__attribute__((constructor)) static void fill_tables(void) {
    for (uint32_t m = 0; m < 128; m++)
        magnitude_lo[m] = (uint8_t)bf16_magnitude(m), magnitude_hi[m] = (uint8_t)(bf16_magnitude(m) >> 8);
    for (int j = 0; j < 4; j++)  // 128-bit lane j: values 8j..8j+7, then 32+8j..32+8j+7
        for (int i = 0; i < 8; i++) unpack_order[16 * j + i] = (uint8_t)(8 * j + i), unpack_order[16 * j + 8 + i] = (uint8_t)(32 + 8 * j + i);
}

typedef struct { __m512i order, lo0, lo1, hi0, hi1; } Tables;

// 64 e4m3 values at p widened to bf16 at out: each value's two bf16 bytes looked up by its 7 magnitude bits
// (vpermi2b), its sign put back, and the bytes interleaved into words, in an order fixed beforehand: about 9
// instructions where widen32 takes about 13 for half as many.
static inline void widen64(const Tables* t, const uint8_t* p, uint16_t* out) {
    const __m512i x = _mm512_permutexvar_epi8(t->order, _mm512_loadu_si512((const void*)p));
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, x, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, x, t->hi1), x,
                                                 _mm512_set1_epi8((char)0x80), 0xf8);  // hi | (x & 0x80)
    _mm512_storeu_si512((void*)out, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512((void*)(out + 32), _mm512_unpackhi_epi8(lo, hi));
}

// n values (a multiple of 32) widened.
static void widen(const uint8_t* p, uint16_t* out, int64_t n) {
    const Tables t = {_mm512_loadu_si512((const void*)unpack_order), _mm512_loadu_si512((const void*)magnitude_lo),
                      _mm512_loadu_si512((const void*)(magnitude_lo + 64)), _mm512_loadu_si512((const void*)magnitude_hi),
                      _mm512_loadu_si512((const void*)(magnitude_hi + 64))};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) widen64(&t, p + i, out + i);
    if (i < n) widen32(p + i, out + i);
}
#else
static void widen(const uint8_t* p, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) widen32(p + i, out + i);
}
#endif

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
        widen(src, out + b * block_bytes, n);
    }
}

// The first `keys` rows of the blocks in `table` of k8 and v8 asked into L2: decode_bf16 asks for the part a thread
// will likely take next while it attends this one, as it does with a bf16 cache.
void fp8_prefetch_blocks(const uint8_t* k8, const uint8_t* v8, const int64_t* table, int64_t keys, int block_size,
                         int64_t stride) {
    const int64_t block_bytes = block_size * stride;
    for (int64_t b = 0; b * block_size < keys; b++) {
        const int64_t n = (keys - b * block_size < block_size ? keys - b * block_size : block_size) * stride;
        for (int64_t off = 0; off < n; off += 64)
            __builtin_prefetch(k8 + table[b] * block_bytes + off, 0, 2),
                __builtin_prefetch(v8 + table[b] * block_bytes + off, 0, 2);  // locality 2: into L2
    }
}

// Decode attention over fp8 caches (csrc/paged_decode.c's arguments, bf16 q and out): decode_bf16 where it takes
// them (AVX512-BF16, head_dim % 32 == 0), else decode_avx2_fp8 (AVX2 + FMA + F16C without AVX-512, head_dim and
// block_size % 8 == 0): each where this build's bf16 decode runs the same plan, so the result is the one a bf16
// cache holding the same values gets. Returns 0, having done nothing, where neither does: decode_fp8_takes says so
// beforehand (AVX-512 CPUs without AVX512-BF16, and heads AVX512-BF16 does not take, attend with torch).
int paged_decode_fp8(const uint16_t* q, const uint8_t* k8, const uint8_t* v8, const int64_t* block_tables,
                     const int64_t* seq_lens, uint16_t* out, int num_seqs, int num_q_heads, int num_kv_heads,
                     int head_dim, int block_size, int max_blocks, float scale, int64_t window) {
    return decode_bf16(q, NULL, NULL, k8, v8, block_tables, seq_lens, out, num_seqs, num_q_heads, num_kv_heads,
                       head_dim, block_size, max_blocks, scale, window) ||
           decode_avx2_fp8(q, k8, v8, block_tables, seq_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim,
                           block_size, max_blocks, scale, window);
}

// Whether paged_decode_fp8 runs heads of head_dim in blocks of block_size on this build.
int decode_fp8_takes(int head_dim, int block_size) {
#if defined(__AVX512BF16__)
    if (head_dim % 32 == 0) return 1;
#endif
    return decode_avx2_takes(head_dim, block_size);
}
