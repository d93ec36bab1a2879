// Helpers shared by our CPU kernels: bf16 <-> fp32, the online-softmax fold, AVX-512 and AVX2 row loads.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {  // round to nearest even, as torch does
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

// The running max before any score: finite, because -ffast-math lets the compiler assume no infinities;
// expf(NO_SCORE - score) is still exactly 0.
#define NO_SCORE (-1e30f)

// Folds n new attention scores into a running max m and sum l (online softmax): the scores become their
// weights, and the return value is the factor the accumulated output must be scaled by.
static inline float softmax_update(float* scores, int n, float* m, float* l) {
    float block_max = *m;
    for (int t = 0; t < n; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
    const float correction = expf(*m - block_max);
    *l *= correction;
    for (int t = 0; t < n; t++) { scores[t] = expf(scores[t] - block_max); *l += scores[t]; }
    *m = block_max;
    return correction;
}

// The output of a decode row attended in parts (csrc/decode_bf16.c, csrc/decode_avx2.c). Each part's state, per
// query head: its running max, its sum of weights, its unnormalized output (head_dim + 2 floats). The states are
// rescaled to the largest max and summed in part order, so a row's result depends only on where its parts end.
#define DEFINE_COMBINE_PARTS(NAME, T, STORE)                                                                          \
static inline void NAME(const float* parts, int64_t count, int num_q_heads, int head_dim, T* out) {                  \
    const int64_t state = (int64_t)num_q_heads * (head_dim + 2);                                                    \
    float acc[head_dim];                                                                                            \
    for (int i = 0; i < num_q_heads; i++) {                                                                         \
        float m = NO_SCORE, sum = 0.f;                                                                              \
        for (int64_t p = 0; p < count; p++) m = fmaxf(m, parts[p * state + i * (head_dim + 2)]);                    \
        for (int d = 0; d < head_dim; d++) acc[d] = 0.f;                                                            \
        for (int64_t p = 0; p < count; p++) {                                                                       \
            const float* st = parts + p * state + i * (head_dim + 2);                                               \
            const float w = expf(st[0] - m);                                                                        \
            sum += st[1] * w;                                                                                       \
            for (int d = 0; d < head_dim; d++) acc[d] += st[2 + d] * w;                                             \
        }                                                                                                           \
        const float inv = sum > 0.f ? 1.f / sum : 0.f;                                                              \
        for (int d = 0; d < head_dim; d++) out[i * head_dim + d] = STORE(acc[d] * inv);                             \
    }                                                                                                               \
}
DEFINE_COMBINE_PARTS(combine_parts_bf16, uint16_t, bf16_store)
DEFINE_COMBINE_PARTS(combine_parts_f32, float, F32_STORE)

// A decode call's work items: a sequence longer than split_keys keys is attended in parts of that many keys (whole
// blocks, at least one), each by any thread, and its parts' states are combined at the end (COMBINE_DECODE_ITEMS):
// one long sequence alone would leave every thread but one idle. Sequence s's parts are items first[s] to
// first[s + 1] - 1, in key order; seq[i] is item i's sequence. Where the parts end depends on the sequence's length
// (and window) only, so its result never depends on the batch beside it. With a sliding window (window > 0: a
// query sees its last `window` keys) a sequence's parts start at the block holding its first visible key, lo[s],
// and its first part masks the item_skip keys before that key. Used by csrc/decode_avx2.c and csrc/paged_decode.c.
typedef struct {
    int64_t *first, *lo, items, part_keys, state;  // state: floats of one part's state (see combine_parts)
    int* seq;
    float* parts;  // the parts' states, where any sequence has more than one
} DecodeItems;

// A sequence's first visible key under a sliding window (0 without one).
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

// Where a walk over the keys of a row with len keys starts: the multiple of `step` (a block, a slice) at or before
// its first visible key. Whole steps from key 0, as without a window: a step none of a row's keys are in leaves
// that row's state bit for bit as it was.
static inline int64_t window_walk_start(int64_t len, int64_t window, int step) {
    const int64_t first = window_start(len, window);
    return first - first % step;
}

static inline DecodeItems decode_items(const int64_t* seq_lens, int num_seqs, int block_size, int split_keys,
                                       int num_q_heads, int head_dim, int64_t window) {
    DecodeItems it = {malloc((num_seqs + 1) * sizeof(int64_t)), malloc((num_seqs + 1) * sizeof(int64_t)), 0,
                      (split_keys / block_size > 0 ? split_keys / block_size : 1) * block_size,
                      (int64_t)num_q_heads * (head_dim + 2), NULL, NULL};
    it.first[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        it.lo[s] = window_walk_start(seq_lens[s], window, block_size);
        const int64_t parts = (seq_lens[s] - it.lo[s] + it.part_keys - 1) / it.part_keys;
        it.first[s + 1] = it.first[s] + (parts > 1 ? parts : 1);
    }
    it.items = it.first[num_seqs];
    it.seq = malloc(it.items * sizeof(int));
    for (int s = 0; s < num_seqs; s++)
        for (int64_t i = it.first[s]; i < it.first[s + 1]; i++) it.seq[i] = s;
    it.parts = it.items > num_seqs ? malloc(it.items * it.state * sizeof(float)) : NULL;
    return it;
}

// Item i's first key, its number of keys, how many keys at its start it masks (a window's, in its first block),
// and where its state goes (NULL: the sequence is whole, its output goes straight to out).
static inline int64_t item_start(const DecodeItems* it, int64_t i) {
    return it->lo[it->seq[i]] + (i - it->first[it->seq[i]]) * it->part_keys;
}
static inline int64_t item_keys(const DecodeItems* it, const int64_t* seq_lens, int64_t i) {
    const int64_t left = seq_lens[it->seq[i]] - item_start(it, i);
    return left < it->part_keys ? left : it->part_keys;
}
static inline int item_skip(const DecodeItems* it, const int64_t* seq_lens, int64_t i, int64_t window) {
    const int s = it->seq[i];
    return i == it->first[s] ? (int)(window_start(seq_lens[s], window) - it->lo[s]) : 0;
}
static inline float* item_state(const DecodeItems* it, int64_t i) {
    return it->first[it->seq[i] + 1] - it->first[it->seq[i]] > 1 ? it->parts + i * it->state : NULL;
}
static inline void free_decode_items(DecodeItems* it) {
    free(it->first), free(it->lo), free(it->seq), free(it->parts);
}

// Inside the call's parallel region, after its items: each sequence in parts gets its output from their states.
#define COMBINE_DECODE_ITEMS(COMBINE, it, num_seqs, num_q_heads, head_dim, out)                                    \
    if ((it).parts) _Pragma("omp for schedule(dynamic, 1)") for (int s = 0; s < (num_seqs); s++)                 \
        if ((it).first[s + 1] - (it).first[s] > 1)                                                                  \
            COMBINE((it).parts + (it).first[s] * (it).state, (it).first[s + 1] - (it).first[s], num_q_heads,     \
                    head_dim, (out) + (int64_t)s * (num_q_heads) * (head_dim))

// The prefetch helpers are always inlined: GCC deems a function that only prefetches free of side effects and
// deletes the calls it does not inline (csrc/decode_bf16.c lost every prefetch that way, and read at half speed).
// Called once per token row of the current block, for the same row of the next block: spread out like this,
// the prefetches overlap the arithmetic (one burst per block did not: 0.72 -> 0.49 ms per decode layer at batch 64).
static inline __attribute__((always_inline)) void prefetch_rows(const void* k, const void* v, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char*)k + off);
        __builtin_prefetch((const char*)v + off);
    }
}

// The same into L2 only, for rows needed much later (a decode thread's next sequence).
static inline __attribute__((always_inline)) void prefetch_rows_l2(const void* k, const void* v, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char*)k + off, 0, 2);
        __builtin_prefetch((const char*)v + off, 0, 2);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 vwiden_bf16(__m256i v) {  // 16 bf16 values as fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512 vload_bf16(const uint16_t* p) { return vwiden_bf16(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 vload_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_bf16_masked(const uint16_t* p, __mmask16 mask) {  // the first lanes of mask; 0 elsewhere
    return vwiden_bf16(_mm256_maskz_loadu_epi16(mask, p));
}
// The first n lanes (n >= 0): a row's last, partial vector.
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// e^x in 16 lanes, to fp32 rounding: e^x = 2^k e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by the
// Cephes polynomial. Inputs below -104 give exactly 0 (flushed), as e^x does in fp32.
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(y, k);
}

// Folds one 16-key slice into a query head's state: s = the slice's scaled scores, lanes hidden to visible - 1 of
// them real (a window hides the ones before); m = the running max, l = the running sums per lane (added up at the
// end). Writes the weights e^(s - max) to w and returns the factor the head's accumulator must be scaled by.
static inline __m512 softmax16(__m512 s, int hidden, int visible, float* m, __m512* l, float* w) {
    const __mmask16 valid = (__mmask16)(((1u << visible) - 1) & ~((1u << hidden) - 1));  // lanes hidden..visible-1
    const float slice_max = _mm512_mask_reduce_max_ps(valid, s);
    const float new_max = slice_max > *m ? slice_max : *m;
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
    // e^0 is exactly 1: most slices leave the max where it was, and skip the exponential.
    const __m512 correction = new_max == *m ? _mm512_set1_ps(1.f) : exp16(_mm512_set1_ps(*m - new_max));
    *l = _mm512_fmadd_ps(*l, correction, p);
    *m = new_max;
    _mm512_storeu_ps(w, p);
    return correction;
}
#endif

// 8-lane helpers wherever AVX2 + FMA exist: csrc/attend_avx2.c also serves AVX-512 CPUs where csrc/attend_bf16.c
// does not (fp32, and bf16 without AVX512-BF16), about twice as fast there as the 16-lane key-at-a-time path.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 vload8_bf16(const uint16_t* p) {  // 8 bf16 values widened to fp32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 vload8_f32(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
// 16 e4m3 values of an fp8 KV cache (csrc/kv_fp8.c) widened to fp32 as 2^-8 times their values, exactly: each one's
// sign, 4 exponent bits and 3 mantissa bits moved into an fp16's places (its exponent's low 4 bits, its mantissa's
// top 3) make that fp16, subnormals included, and F16C widens it. 0x7f (NaN) would read as 480 / 2^8: the cache
// holds no NaN (its writers store a NaN as 0), and checking for one took a tenth of decode attention's time.
// The caller puts the 2^8 back where it costs nothing (csrc/decode_avx2.c: into the query and the weights).
static inline void vload16_fp8_scaled(const uint8_t* p, __m256* lo, __m256* hi) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));  // sign-extended: bit 15 the sign
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xbf80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
static inline __m256 vload8_fp8_scaled(const uint8_t* p) {  // the same for 8 values
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xbf80)));
}
#endif
#if !defined(__AVX512F__)  // the LANES-wide loads of the key-at-a-time paths (AVX-512 has its own above)
static inline __m256 vload_bf16(const uint16_t* p) { return vload8_bf16(p); }
static inline __m256 vload_f32(const float* p) { return vload8_f32(p); }
#endif
static inline float hsum8(__m256 v) {  // lanes added pairwise, the same order every time
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x in 8 lanes, to fp32 rounding: e^x = 2^k e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by the Cephes
// polynomial (exp16 above). Inputs below -87 give e^-87 (2^k must stay a normal float): the callers
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

// Folds 8 scores, lanes hidden to visible - 1 real, into a head's running max m and sum l; writes the weights
// e^(s - max) (0 outside them) to w and returns the factor the head's accumulator must be scaled by.
static inline float softmax8(__m256 s, int hidden, int visible, float* m, float* l, float* w) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // real: lanes hidden..visible-1
    const __m256 real = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hidden), lane),
                                                                _mm256_cmpgt_epi32(_mm256_set1_epi32(visible), lane)));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    float new_max = *m;
    for (int t = hidden; t < visible; t++) new_max = lanes[t] > new_max ? lanes[t] : new_max;
    const __m256 p = _mm256_and_ps(real, exp8(_mm256_sub_ps(s, _mm256_set1_ps(new_max))));
    const float correction = new_max == *m ? 1.f : expf(*m - new_max);  // e^0 is exactly 1
    *l = *l * correction + hsum8(p);
    *m = new_max;
    _mm256_storeu_ps(w, p);
    return correction;
}
#endif

// The row-at-a-time attention kernels (csrc/paged_decode.c, csrc/paged_prefill.c) hold the head dimension in
// registers of LANES fp32 lanes: AVX-512's 16 or AVX2's 8. LANES is undefined where neither is there.
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define vec_mul _mm512_mul_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_set1 _mm512_set1_ps
#define vec_zero _mm512_setzero_ps
#define vec_sum _mm512_reduce_add_ps
#define vec_store _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define vec_mul _mm256_mul_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_set1 _mm256_set1_ps
#define vec_zero _mm256_setzero_ps
#define vec_sum hsum8
#define vec_store _mm256_storeu_ps
#endif

#if defined(__AVX512BF16__)
// csrc/decode_bf16.c's scores: lane t of the result = the sum of the 16 lanes of s[t]. Each round adds pairs of
// vectors after a shuffle that lines up their halves, so a vector holds partial sums of twice as many keys, in key
// order.
static inline __m512 sum_lanes16(const __m512* s) {
    __m512 u[8], v[4], x[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: two partial sums of key 2i and two of 2i + 1
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: its part of keys 4i .. 4i + 3
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  // 128-bit lanes: two halves of keys 8i .. 8i + 3, two of 8i + 4 .. 8i + 7
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The values side of the bf16 attention kernels (csrc/decode_bf16.c, csrc/attend_bf16.c): the value rows of keys
// 2k and 2k + 1 interleaved into the pairs of vdpbf16ps, so that one instruction adds both keys' weighted values.
// Their accumulators, per 32 dims: lo holds dims 8j + 0..3 of each 128-bit lane j, hi dims 8j + 4..7.

// Value rows a and b (NULL past the last key: zeros) of 32 * chunks dims, paired into lo[c], hi[c].
static inline __attribute__((always_inline)) void pair_values(const uint16_t* a, const uint16_t* b, int chunks,
                                                              __m512i* lo, __m512i* hi) {
    for (int c = 0; c < chunks; c++) {
        const __m512i va = _mm512_loadu_si512((const void*)(a + 32 * c));
        const __m512i vb = b ? _mm512_loadu_si512((const void*)(b + 32 * c)) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(va, vb);
        hi[c] = _mm512_unpackhi_epi16(va, vb);
    }
}

// acc_lo, acc_hi (chunks each) times correction, plus the weighted values of key pairs [0, pairs): v_lo, v_hi
// [pairs][chunks] from pair_values; w: the 16 fp32 weights (0 past the last key), rounded to bf16 here.
static inline __attribute__((always_inline)) void add_paired_values(__m512* acc_lo, __m512* acc_hi,
                                                                    __m512 correction, const float* w,
                                                                    const __m512i* v_lo, const __m512i* v_hi,
                                                                    int pairs, int chunks) {
    uint32_t weights[8];  // the bf16 weights of keys 2k and 2k + 1
    _mm256_storeu_si256((__m256i*)weights, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w)));
    __m512 a[chunks], d[chunks];  // in registers over the keys
    for (int c = 0; c < chunks; c++) a[c] = _mm512_mul_ps(acc_lo[c], correction), d[c] = _mm512_mul_ps(acc_hi[c], correction);
    for (int k = 0; k < pairs; k++) {
        const __m512bh wk = (__m512bh)_mm512_set1_epi32((int)weights[k]);
        for (int c = 0; c < chunks; c++) {
            a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)v_lo[k * chunks + c], wk);
            d[c] = _mm512_dpbf16_ps(d[c], (__m512bh)v_hi[k * chunks + c], wk);
        }
    }
    for (int c = 0; c < chunks; c++) acc_lo[c] = a[c], acc_hi[c] = d[c];
}

// 32 dims accumulated by add_paired_values, times scale, back in order: dims 0..15 to *first, 16..31 to *second.
static inline void unpair(__m512 lo, __m512 hi, __m512 scale, __m512* first, __m512* second) {
    const __m512 a = _mm512_mul_ps(lo, scale), b = _mm512_mul_ps(hi, scale);
    *first = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), b);
    *second = _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), b);
}

// The same, as 32 bf16 values at out (rounded to nearest even, as bf16_store).
static inline void store_unpaired_bf16(__m512 lo, __m512 hi, __m512 scale, uint16_t* out) {
    __m512 first, second;
    unpair(lo, hi, scale, &first, &second);
    _mm512_storeu_si512((void*)out, (__m512i)_mm512_cvtne2ps_pbh(second, first));
}

// The 16-row tiles of prefill attention (csrc/attend_bf16.c, csrc/attend_amx.c) hold query row r of a tile in lane r
// of every vector, and take the keys a slice at a time (16 or 32): the online softmax is lane-wise vector work.
#define ATTEND_BF16_ROWS 16

// Which lanes may see a key: those whose [from, end) holds it. Lanes past the tile's rows see the whole context.
// Every lane sees the keys in [all_from, all_end): the first row sees the fewest, the last the latest first key.
typedef struct {
    __m512i end, from;
    int64_t all_from, all_end;
} TileSight;
static inline TileSight tile_sight(int64_t first_pos, int rows, int64_t window) {
    int32_t end[16], from[16];
    for (int r = 0; r < 16; r++) {
        end[r] = (int32_t)(r < rows ? first_pos + r + 1 : first_pos + rows);
        from[r] = (int32_t)(r < rows ? window_start(first_pos + r + 1, window) : 0);
    }
    TileSight sight = {_mm512_loadu_si512((const void*)end), _mm512_loadu_si512((const void*)from), from[rows - 1],
                       first_pos + 1};
    return sight;
}

// visible[t]: the lanes that may see key start + t, for `keys` keys. Every slice is masked: with an unmasked copy
// of the slice loop beside the masked one (the compiler may contract the two copies' arithmetic differently), a
// row's bits depended on where its tile began.
static inline __attribute__((always_inline)) void slice_visible(TileSight sight, int64_t start, int keys,
                                                                __mmask16* visible) {
    if (start >= sight.all_from && start + keys <= sight.all_end) {  // most slices of a long context
        for (int t = 0; t < keys; t++) visible[t] = 0xffff;
        return;
    }
    for (int t = 0; t < keys; t++) {
        const __m512i key = _mm512_set1_epi32((int32_t)(start + t));
        visible[t] = _mm512_cmpgt_epi32_mask(sight.end, key) & ~_mm512_cmpgt_epi32_mask(sight.from, key);
    }
}

// One step of a transpose of 32-bit lanes over v[0, count): swaps bit b of the vector index with bit b of the lane
// (v[i] lane j and v[i ^ bit] lane j ^ bit trade places where bit b of i and of j differ).
static inline __attribute__((always_inline)) void swap_index_bit(__m512i* v, int count, int b) {
    // For the pair x = v[i] (bit b of i clear), y = v[i | bit]; 16 + j is y's lane j. The new x takes lane j from x
    // where bit b of j is clear, else y's lane j & ~bit; the new y x's lane j | bit, else y's lane j.
    static const int32_t to_x[4][16] = {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                                        {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
    static const int32_t to_y[4][16] = {{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
                                        {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                                        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                                        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    const int bit = 1 << b;
    const __m512i ix = _mm512_loadu_si512((const void*)to_x[b]), iy = _mm512_loadu_si512((const void*)to_y[b]);
    for (int i = 0; i < count; i++)
        if (!(i & bit)) {
            const __m512i x = v[i], y = v[i | bit];
            v[i] = _mm512_permutex2var_epi32(x, ix, y);
            v[i | bit] = _mm512_permutex2var_epi32(x, iy, y);
        }
}

// One query head's rows as pairs: qt[p] lane r = row r's dims 2p and 2p + 1 (0 in lanes past the tile's rows).
static inline void tile_queries(const uint16_t* q, int64_t q_row_stride, int rows, int pairs, __m512i* qt) {
    for (int p = 0; p < pairs; p += 16) {
        __m512i v[16];
        const __mmask16 lanes = first_lanes(pairs - p);
        for (int r = 0; r < 16; r++)
            v[r] = r < rows ? _mm512_maskz_loadu_epi32(lanes, (const void*)(q + r * q_row_stride + 2 * p))
                            : _mm512_setzero_si512();
        for (int b = 0; b < 4; b++) swap_index_bit(v, 16, b);  // v[j] lane r = row r's pair p + j
        for (int j = 0; j < 16 && p + j < pairs; j++) qt[p + j] = v[j];
    }
}

// 2^x for attention weights, which are rounded to bf16 (2^-9 apart): within 3e-6 of it. f = x - floor(x) in [0, 1)
// in one instruction, 2^f by a degree-4 polynomial fitted to it (p(0) = 1 exactly), and scalef multiplies by
// 2^floor(x) itself: seven operations where e^x takes eleven. No clamp: x must be finite in every lane whose result
// is kept (the callers zero the others).
static inline __m512 exp2_weight(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013426384888589382f), f, _mm512_set1_ps(0.052242957055568695f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2412799745798111f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693044900894165f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, x);
}

// Folds a slice of `keys` keys into one query head's rows (online softmax, lane-wise): s[t], the rows' raw scores
// of key t, becomes its weights e^(s * scale - max) (exactly 0 where a row may not see it); m, l: the rows' running
// max (of scores times scale * log2(e), where the weights are powers of 2) and sum. Returns the factor the rows'
// accumulated output must be scaled by (exactly 1 where the max stayed). scale > 0, so the scaled max is the max's
// scaled score.
static inline __attribute__((always_inline)) __m512 fold_slice(__m512* s, const __mmask16* visible, int keys,
                                                               __m512 scale, __m512* m, __m512* l) {
    // Four chains of maxes and of sums, keys t = j mod 4 each (keys % 4 == 0): one chain of `keys` dependent
    // operations was the slice's longest wait. The sums' order is fixed, so a row's bits still depend on its row only.
    const __m512 scale2 = _mm512_mul_ps(scale, _mm512_set1_ps(1.44269504f));
    __m512 top[4], sum[4];
    for (int j = 0; j < 4; j++) top[j] = _mm512_set1_ps(NO_SCORE), sum[j] = _mm512_setzero_ps();
    for (int t = 0; t < keys; t++) top[t % 4] = _mm512_mask_max_ps(top[t % 4], visible[t], top[t % 4], s[t]);
    const __m512 most = _mm512_max_ps(*m, _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]),
                                                                      _mm512_max_ps(top[2], top[3])), scale2));
    // e^((m - most) ln 2), exactly 1 where m == most (the output is skipped then); exp16 clamps NO_SCORE - most.
    const __m512 c = exp16(_mm512_mul_ps(_mm512_sub_ps(*m, most), _mm512_set1_ps(0.693147181f)));
    for (int t = 0; t < keys; t++) {
        s[t] = _mm512_maskz_mov_ps(visible[t], exp2_weight(_mm512_fmsub_ps(s[t], scale2, most)));
        sum[t % 4] = _mm512_add_ps(sum[t % 4], s[t]);
    }
    const __m512 slice_sum = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
    *l = _mm512_add_ps(_mm512_mul_ps(*l, c), slice_sum);
    *m = most;
    return c;
}

// The weights of keys 2k and 2k + 1 (k < pairs) as bf16 pairs, rounded as transformers' eager bf16 attention rounds
// them: pw[k] lane r = row r's pair (csrc/attend_bf16.c's dot products; csrc/attend_amx.c's B tile, pw as its rows).
static inline __attribute__((always_inline)) void pair_weights(const __m512* s, int pairs, __m512i* pw) {
    // Word 2r of a pair vector is word r of cvtne2ps_pbh's low half (key 2k), word 2r + 1 word 16 + r (key 2k + 1).
    static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i words = _mm512_loadu_si512((const void*)order);
    for (int k = 0; k < pairs; k++)
        pw[k] = _mm512_permutexvar_epi16(words, (__m512i)_mm512_cvtne2ps_pbh(s[2 * k + 1], s[2 * k]));
}

// csrc/attend_bf16.c: a tile of up to 16 query rows attending over paged bf16 K/V (see there); csrc/attend_amx.c:
// the same on AMX tiles where attend_amx_takes says so.
int attend_bf16_takes(int head_dim, int block_size);
void attend_bf16_tile(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int64_t* table, int64_t first_pos, int rows, uint16_t* out, int num_q_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale, int64_t window);
int attend_amx_takes(int head_dim, int block_size);
int attend_amx_rows(int group, int head_dim);  // the most rows attend_amx_tile takes
void attend_amx_tile(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int64_t* table, int64_t first_pos, int rows, uint16_t* out, int num_q_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale, int64_t window);
#endif

// The tile kernels of prefill attention: csrc/attend_bf16.c (AVX512-BF16), csrc/attend_avx2.c (AVX2 + FMA).
#define ATTEND_MAX_ROWS 8
#define ATTEND_MAX_GROUP 16
#define ATTEND_MAX_DIM 256
int attend_avx2_takes(int head_dim, int block_size);  // 0 where the CPU has no AVX2 + FMA
// The tiles are defined where attend_avx2_takes can answer 1 only: callers name them under the same #if.
#define DECLARE_ATTEND_TILE(NAME, T)                                                                                 \
    void NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,            \
              int64_t first_pos, int rows, T* out, int num_q_heads, int num_kv_heads, int head_dim, int block_size, \
              float scale, int64_t window)
DECLARE_ATTEND_TILE(attend_avx2_tile_bf16, uint16_t);
DECLARE_ATTEND_TILE(attend_avx2_tile_f32, float);

// csrc/linear.c's packed panels: 48 weight rows each, in the pair layout of the AVX512-BF16 dot instruction, bf16
// or int8 (csrc/linear_int4.c's int4 too). csrc/linear_avx2.c and csrc/linear_quant_avx2.c read the same panels
// where the CPU has AVX2 + FMA and no AVX512-BF16 (1 from linear_avx2_available()).
#define LINEAR_PANEL_COLS 48

// CASE(MR) for the row count mr (1 to 6) as a constant, so that a tile's loops unroll into registers: the AVX2
// strips' dispatch (csrc/linear_avx2.c, csrc/linear_f32.c).
#define SWITCH_ROWS_1_TO_6(mr, CASE) \
    switch (mr) {                    \
        case 6: CASE(6); break;      \
        case 5: CASE(5); break;      \
        case 4: CASE(4); break;      \
        case 3: CASE(3); break;      \
        case 2: CASE(2); break;      \
        default: CASE(1); break;     \
    }

// Both linear kernels' work split: threads from 64k weights or a million multiply-adds; and the shares each panel's
// row tiles are cut into (`tiles` of them at most), so that a weight of few panels (a LoRA adapter's A or B) still
// gives every thread rows. Every output stays one tile's sum over all k in order: no split moves a bit.
static inline int linear_parallel(int64_t m_len, int64_t n_len, int64_t k_len) {
    return n_len * k_len >= 1 << 16 || m_len * n_len * k_len >= 1 << 20;
}
static inline int64_t linear_row_parts(int64_t panels, int64_t tiles, int threads) {
    const int64_t parts = (2 * threads + panels - 1) / panels;
    return panels >= 2 * threads ? 1 : parts < tiles ? parts : tiles;
}
// Quantized panels (engine_core/linear_packing.py), per group of 32 k and vector of 16 columns: int8, the weights
// in the pair layout (16 pairs x 32 bytes) and then the 32 lanes' fp32 scales (a column's twice, for its pair);
// int4 and format 4, 16 pairs' nibbles (four pairs in each 16-bit lane, the first pair's lowest: 4 x 64 bytes; int4's
// lanes in the pair layout, format 4's as int4_bf16_pairs reads them), then the 16 columns' fp32 scales, then their
// mins.
#define QUANT_GROUP 32
#define GRID_ROWS 16  // with AMX: csrc/linear.c's linear_grid_rows, which the decode stack asks
#define INT8_GROUP_VEC_BYTES (QUANT_GROUP / 2 * 32 + 2 * 16 * 4)
#define INT4_GROUP_VEC_BYTES (QUANT_GROUP / 2 * 16 + 2 * 16 * 4)
static inline int64_t quant_group_vec_bytes(int format) {
    return format == 1 ? INT8_GROUP_VEC_BYTES : INT4_GROUP_VEC_BYTES;
}
// The packed bytes of one weight row in each format (linear's format: 0 bf16, 1 int8, 2 int4, 4 int4 summed as bf16:
// int4's layout).
static inline int64_t linear_bytes_per_col(int format, int64_t k_len) {
    return format == 0 ? 2 * k_len : k_len / QUANT_GROUP * quant_group_vec_bytes(format) / 16;
}
// Group g of a quantized panel of nv vectors (format 1, 2 or 4), and where the group's scales start (int4: then its
// mins).
static inline const uint8_t* quant_group(const void* panel, int format, int nv, int64_t g) {
    return (const uint8_t*)panel + g * nv * quant_group_vec_bytes(format);
}
static inline const float* quant_scales(const uint8_t* group, int format, int nv) {
    return (const float*)(group + nv * (QUANT_GROUP / 2) * (format == 1 ? 32 : 16));
}
// Work item `item` of a linear's split (a panel and a share of its row tiles): where its panel starts, its columns
// and 16-column vectors, and the next panel's bytes, which the item may prefetch.
typedef struct {
    int64_t n0, part, cols, next_bytes;
    int nv;
    const char *panel, *next;
} PanelItem;
static inline PanelItem panel_item(const void* packed, int64_t item, int64_t row_parts, int64_t n_len,
                                   int64_t bytes_per_col) {
    PanelItem it;
    it.n0 = item / row_parts * LINEAR_PANEL_COLS;
    it.part = item % row_parts;
    it.cols = n_len - it.n0 < LINEAR_PANEL_COLS ? n_len - it.n0 : LINEAR_PANEL_COLS;
    it.nv = (int)((it.cols + 15) / 16);
    it.panel = (const char*)packed + it.n0 * bytes_per_col;
    const int64_t next_n0 = it.n0 + LINEAR_PANEL_COLS, padded_n = (n_len + 15) / 16 * 16;
    const int64_t next_cols = padded_n - next_n0 < LINEAR_PANEL_COLS ? padded_n - next_n0 : LINEAR_PANEL_COLS;
    it.next = (const char*)packed + next_n0 * bytes_per_col;
    it.next_bytes = next_cols > 0 ? next_cols * bytes_per_col : 0;
    return it;
}
#if defined(__AVX512BF16__)
// 16 columns x a pair of k of an int8 panel as bf16(q * scale). The widened halves hold columns 0-7 and 8-15, each
// twice (its pair): scales holds the 32 lanes' scales in that order.
static inline __m512bh int8_pairs(const int8_t* w, const float* scales) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, _mm512_loadu_ps(scales + 16)),
                               _mm512_mul_ps(lo, _mm512_loadu_ps(scales)));
}
// bf16(q) for q = 0..15 in lanes 0..15 (and again in 16..31): vpermw on it turns an int4 panel's nibbles, shifted to
// a lane's low bits, into bf16 exactly (it reads only an index's low 5 bits).
static inline __m512i nibble_table(void) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (__m512i)_mm512_cvtne2ps_pbh(q, q);
}
// Format 4: the bf16 weights of a checkpoint stored on a 4-bit grid, widened to bf16(fma(q, scale, min)) bit for bit
// (engine_core/models/grid_weights.py checks each weight's at load). The lanes of cvtne2ps's two halves: the low half
// holds columns 0-7 of the vector, each twice (its pair), the high half columns 8-15, so each half needs its columns'
// scales and mins twice over; grid_lanes spreads a group's 16 of each that way, once per group.
typedef struct {
    __m512 scale_lo, scale_hi, min_lo, min_hi;
} GridLanes;
static inline GridLanes grid_lanes(const float* scales, const float* mins) {
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 s = _mm512_loadu_ps(scales), m = _mm512_loadu_ps(mins);
    return (GridLanes){_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s), _mm512_permutexvar_ps(lo, m),
                       _mm512_permutexvar_ps(hi, m)};
}
// Pair `sub` (0-3) of four k pairs' nibbles of a format-4 vector (`four`: a 16-bit lane each) widened into the bf16
// panels' pair layout. The panels order the nibbles so that the 32-bit element e of bf16(q) (the table's vpermw)
// holds, low, the q that cvtne2ps puts at lane e of the pair layout (column e / 2 of 0-7) and, high, the one it puts
// at lane 16 + e (column 8 + e / 2): a shift and a mask make them fp32, and the two halves' fmas and one cvtne2ps
// leave every weight where the tiles read it. (Ordered as the bf16 panels, an interleaving vpermw after the cvtne2ps
// cost about 13% of the widening.)
static inline __m512bh int4_bf16_pairs(__m512i four, int sub, const GridLanes* lanes, __m512i table) {
    const __m512i q = _mm512_permutexvar_epi16(_mm512_srli_epi16(four, 4 * sub), table);
    const __m512 lo = (__m512)_mm512_slli_epi32(q, 16);
    const __m512 hi = (__m512)_mm512_and_si512(q, _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, lanes->scale_hi, lanes->min_hi),
                               _mm512_fmadd_ps(lo, lanes->scale_lo, lanes->min_lo));
}
// A linear tile's fp32 sums (mr rows x nv vectors of 16 columns) plus the bias, stored as bf16: the first `cols`
// columns of each row.
static inline __attribute__((always_inline)) void store_linear_tile(__m512 (*acc)[LINEAR_PANEL_COLS / 16], int mr,
                                                                    int nv, int64_t cols, const uint16_t* bias,
                                                                    uint16_t* out, int64_t ldo) {
    for (int j = 0; j < nv; j++) {
        const int64_t c0 = 16 * j;
        if (c0 >= cols) break;
        const __mmask16 mask = first_lanes(cols - c0);
        const __m512 b = bias ? vload_bf16_masked(bias + c0, mask) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(out + i * ldo + c0, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
    }
}
// The gate's activation of csrc/layers.c's act_and_mul and csrc/glu_amx.c: g / (1 + e^-t), t = g (SiLU) or GELU's
// 2u, clamped as layers.c's SIGMOID_DIV clamps it.
static inline __m512 act16(__m512 g, int gelu) {
    const __m512 t = gelu ? _mm512_mul_ps(_mm512_set1_ps(1.5957691216f),
                                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(g, g)),
                                                          g, g))
                          : g;
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), t), _mm512_set1_ps(88.f)));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#endif
int linear_avx2_available(void);
// csrc/linear_amx.c: bf16, int8 and int4 panels on AMX where the CPU has it and k % 32 == 0; returns 0, having done
// nothing, elsewhere.
// linear_amx_available() says whether this process may use the AMX tiles (csrc/attend_amx.c asks it too).
int linear_amx_available(void);
#if defined(__AMX_TILE__)
// The tile configuration ldtilecfg reads (palette 1): each tile's rows and bytes per row. Each thread has its own.
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;
#endif
int linear_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format, const uint16_t* bias,
               uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
// Each row's sum of x over each group of 32 k, as csrc/linear_int4.c's tiles take them and csrc/linear_amx.c's int4
// blocks too (defined where the CPU has AVX512-BF16).
void linear_int4_group_sums(const uint16_t* x, int64_t ldx, int64_t m_len, int64_t groups, float* xsum);
// csrc/glu_amx.c: act(gate) * up of a merged gate_up linear's bf16 panels in one AMX call; 0 (nothing done) where
// it does not run.
int glu_amx(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias, uint16_t* out,
            int64_t ldo, int64_t half, int64_t k_len, int gelu);
// How many work items (of item_bytes of weights each, row_parts per group of columns) an AMX thread takes at a time,
// each block of rows across all of them: where x is past 1 MB, enough for 1 MB of weights, which stay in L2 while
// x's rows stay in L1 (csrc/linear_amx.c says why); else one group of columns, all its blocks of rows in turn.
static inline int64_t amx_item_group(int64_t m_len, int64_t k_len, int64_t item_bytes, int64_t row_parts) {
    const int64_t fit = (1 << 20) / item_bytes;
    return m_len * k_len * 2 > (1 << 20) && fit > 1 ? fit * row_parts : row_parts;
}
// csrc/linear_int4.c: weight-only int4 panels (linear's format 2), defined where the CPU has AVX512-BF16.
int linear_int4_available(void);
void linear_int4(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
// bf16 panels (csrc/linear_avx2.c) and int8 or int4 ones (csrc/linear_quant_avx2.c, format 1 or 2) where the CPU
// has AVX2 + FMA (and F16C) and no AVX512-BF16; elsewhere these do nothing.
void linear_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                 uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
// csrc/linear_avx512.c: linear_avx2's bf16 panels 16 columns a vector, with the same bits, where the CPU has AVX-512F
// and no AVX512-BF16; elsewhere it does nothing.
int linear_avx512_available(void);
void linear_avx512(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, const uint16_t* bias,
                   uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);
int linear_quant_avx2_available(void);
void linear_quant_avx2(const uint16_t* x, int64_t ldx, int64_t m_len, const void* packed, int format,
                       const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t n_len, int64_t k_len);

// csrc/decode_bf16.c: paged_decode_bf16's work 16 keys at a time where the CPU has AVX512-BF16 and head_dim % 32
// == 0 (see there), from bf16 caches, or from fp8 ones (k8, v8); returns 0, having done nothing, elsewhere.
#define DECODE_MAX_GROUP 16
#define DECODE_MAX_DIM 256
int decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const uint8_t* k8,
                const uint8_t* v8, const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out, int num_seqs,
                int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                int64_t window);
// csrc/kv_fp8.c: the first `keys` rows of an fp8 cache's blocks in `table`, widened to bf16 one after the other.
void bf16_from_fp8_blocks(const uint8_t* cache, const int64_t* table, int64_t keys, int block_size, int64_t stride,
                          uint16_t* out);
void fp8_prefetch_blocks(const uint8_t* k8, const uint8_t* v8, const int64_t* table, int64_t keys, int block_size,
                         int64_t stride);
int paged_decode_fp8(const uint16_t* q, const uint8_t* k8, const uint8_t* v8, const int64_t* block_tables,
                     const int64_t* seq_lens, uint16_t* out, int num_seqs, int num_q_heads, int num_kv_heads,
                     int head_dim, int block_size, int max_blocks, float scale, int64_t window);
// csrc/decode_avx2.c: the same, 8 keys at a time, where the CPU has AVX2 + FMA + F16C and no AVX-512, head_dim % 8
// == 0 and block_size % 8 == 0. C: the caches' element type.
#define DECLARE_DECODE_AVX2(NAME, T, C)                                                                              \
    int NAME(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables, const int64_t* seq_lens,   \
             T* out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, \
             float scale, int64_t window)
DECLARE_DECODE_AVX2(decode_avx2_bf16, uint16_t, uint16_t);
DECLARE_DECODE_AVX2(decode_avx2_f32, float, float);
DECLARE_DECODE_AVX2(decode_avx2_fp8, uint16_t, uint8_t);
int decode_avx2_takes(int head_dim, int block_size);
