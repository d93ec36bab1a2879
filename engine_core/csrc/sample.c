// Random sampling on CPU: one token per row drawn from softmax(x / T) restricted by min-p, then top-k, then top-p
// (each on what the one before kept, as vLLM and transformers apply them), by the inverse CDF at one uniform number
// per row. torch's way (a full sort for top-k/top-p and an exponential race, one random number per vocabulary
// entry) took 200-450 ms for a [64, 49152] batch here. A row with T <= 0 is greedy (first maximum).
//
// Top-k and top-p take tokens in descending weight (ascending index among equal weights) but need no full sort: a
// positive float's bits order like its value, so a histogram by the top bits says where the last token kept lies,
// and only the tokens of that one range are sorted. The kept tokens are then drawn from in index order.
// Everything is a function of the row alone, so a row draws the same token whatever shares its batch.
#include <math.h>
#include <stdlib.h>

#include "kernel_common.h"

typedef struct {  // a cut through the descending order: kept are the weights above w, and w itself up to index i
    float w;
    int64_t i;
} Cut;

static inline int inside(float w, int64_t c, Cut cut) { return (w > cut.w) | ((w == cut.w) & (c <= cut.i)); }

static inline uint32_t bits_of(float w) {
    uint32_t b;
    memcpy(&b, &w, 4);
    return b;
}

typedef struct {
    float w;
    int32_t i;
} Weight;

static int descending(const void* a, const void* b) {  // by weight, then by index
    const Weight* x = a;
    const Weight* y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return x->i < y->i ? -1 : 1;
}

// The tokens of `in` (positive weights e) taken in descending order while fewer than k come before (k > 0), or
// while the mass before is below `limit` (k == 0): the cut after the last one taken. One pass sorts the weights
// into 1024 ranges by their top 12 bits (a weight in (0, 1] has bits below 0x3F800001), which says in which range
// the cut falls; only that range's tokens are then sorted. Only weights at or above `floor_w` count. Returns 0 where
// all of them are taken, else 1 and the cut in `out`. `head`: room for `cols` weights.
#define RANGES 1024
#define SORT_AT_MOST 64  // a range of more tokens is split further before the sort
#define COPIES 4  // histograms filled in turn: a run of tokens in one range does not wait on its own adds
static int cut_among(const float* e, int64_t cols, Cut in, float floor_w, int64_t k, float limit, Weight* head,
                     Cut* out) {
    static _Thread_local int32_t count[COPIES][RANGES];
    static _Thread_local float mass[COPIES][RANGES];
    memset(count, 0, sizeof(count));
    memset(mass, 0, sizeof(mass));
    for (int64_t c = 0; c < cols; c++) {
        const float w = e[c];
        if (w > 0.0f && w >= floor_w && inside(w, c, in)) {  // mostly false at a floor: a cheap skip
            const uint32_t d = bits_of(w) >> 20;
            count[c % COPIES][d]++;
            mass[c % COPIES][d] += w;
        }
    }
    int64_t total = 0;
    for (int j = 0; j < COPIES; j++)
        for (int r = 0; r < RANGES; r++) total += count[j][r];
    if (k >= total) return 0;  // all are taken
    int64_t n_before = 0;  // tokens, and their mass, in the ranges above the cut's
    float m_before = 0.0f;
    int d = RANGES - 1;
    for (; d >= 0; d--) {
        int64_t n = 0;
        float m = 0.0f;
        for (int j = 0; j < COPIES; j++) {
            n += count[j][d];
            m += mass[j][d];
        }
        if (n == 0) continue;
        if (k > 0 ? n_before + n >= k : m_before + m >= limit) break;
        n_before += n;
        m_before += m;
    }
    if (d < 0) return 0;  // rounding: the mass of all stayed below the limit
    int64_t n = 0;
    for (int64_t c = 0; c < cols; c++) {
        const float w = e[c];
        if (w > 0.0f && w >= floor_w && inside(w, c, in) && (int)(bits_of(w) >> 20) == d)
            head[n++] = (Weight){w, (int32_t)c};
    }
    // A range that holds many tokens (a flat row, where top-p reaches deep) is split further by the next 8 bits of
    // the weights, twice at most, before the sort.
    for (int shift = 12; n > SORT_AT_MOST && shift >= 4; shift -= 8) {
        int64_t sub_n[256] = {0};
        float sub_m[256] = {0.0f};
        for (int64_t j = 0; j < n; j++) {
            const uint32_t b = (bits_of(head[j].w) >> shift) & 0xff;
            sub_n[b]++;
            sub_m[b] += head[j].w;
        }
        int64_t n_above = n_before;
        float m_above = m_before;
        int b = 255;
        for (; b >= 0; b--) {
            if (sub_n[b] == 0) continue;
            if (k > 0 ? n_above + sub_n[b] >= k : m_above + sub_m[b] >= limit) break;
            n_above += sub_n[b];
            m_above += sub_m[b];
        }
        if (b < 0) break;  // rounding: the range's sums disagree with its parts'; sort it whole
        int64_t kept = 0;
        for (int64_t j = 0; j < n; j++)
            if (((bits_of(head[j].w) >> shift) & 0xff) == (uint32_t)b) head[kept++] = head[j];
        n = kept;
        n_before = n_above;
        m_before = m_above;
    }
    qsort(head, (size_t)n, sizeof(Weight), descending);
    Cut cut = {head[0].w, head[0].i};  // the first of the range is always taken: the one before it was
    for (int64_t j = 0; j < n; j++) {
        if (k > 0 ? n_before >= k : m_before >= limit) break;
        cut = (Cut){head[j].w, head[j].i};
        n_before++;
        m_before += head[j].w;
    }
    if (n_before == total) return 0;
    *out = cut;
    return 1;
}

// The tokens of `in` at or above t: how many (returned) and their mass (vectorized).
static int64_t above(const float* e, int64_t cols, Cut in, float t, float* mass) {
    int64_t n = 0;
    float m = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        const int take = (e[c] >= t) & inside(e[c], c, in);
        n += take;
        m += take ? e[c] : 0.0f;
    }
    *mass = m;
    return n;
}

// Most rows' cut lies among their likely tokens: where a vectorized pass shows that few tokens reach a floor (1/256,
// then 1/65536 of the maximum's weight) and they hold the cut, the histogram counts only those. Else, or where
// rounding lets the walk take them all, every positive weight.
static Cut cut_at(const float* e, int64_t cols, Cut in, int64_t k, float limit, Weight* head) {
    static const float floors[] = {1.0f / 256, 1.0f / 65536, 0.0f};
    for (int f = 0; f < 3; f++) {
        float m;
        if (floors[f] > 0.0f) {
            const int64_t n = above(e, cols, in, floors[f], &m);
            // The floor pays where few tokens pass it (its branch is then predictable) and they hold the cut.
            if (n > cols / 8 || (k > 0 ? n < k : m < limit)) continue;
        }
        Cut cut;
        if (cut_among(e, cols, in, floors[f], k, limit, head, &cut)) return cut;
    }
    return in;  // all of `in` is taken
}

static inline float kept_weight(const float* e, int64_t c, Cut kept) { return inside(e[c], c, kept) ? e[c] : 0.0f; }

// The token at `target` of the running sum of the weights inside `kept`, in index order (the last one if rounding
// leaves the sum short). Whole chunks are summed first (vectorized); only the chunk that crosses is walked.
#define CHUNK 64
static float chunk_sum(const float* e, int64_t c0, Cut kept) {
    float part = 0.0f;
    for (int64_t c = 0; c < CHUNK; c++) part += inside(e[c], c0 + c, kept) ? e[c] : 0.0f;
    return part;
}

static int64_t draw(const float* e, int64_t cols, Cut kept, float target) {
    float acc = 0.0f;
    int64_t c0 = 0;
    for (; c0 + CHUNK <= cols; c0 += CHUNK) {
        const float part = chunk_sum(e + c0, c0, kept);
        if (acc + part > target) break;
        acc += part;
    }
    int64_t last = -1;
    for (int64_t c = c0; c < cols; c++) {
        const float w = kept_weight(e, c, kept);
        if (w > 0.0f) {
            acc += w;
            last = c;
            if (acc > target) return c;
        }
    }
    if (last >= 0) return last;
    for (int64_t c = c0 - 1; c > 0; c--) if (kept_weight(e, c, kept) > 0.0f) return c;
    return 0;
}

static float kept_sum(const float* e, int64_t cols, Cut kept) {
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; c++) sum += kept_weight(e, c, kept);
    return sum;
}

// The kept tokens become those of `cut`; their sum is recomputed only if that drops any, so that a filter that
// keeps everything (top_k = vocabulary) draws exactly as no filter.
static void narrow(const float* e, int64_t cols, Cut* kept, float* sum, Cut cut) {
    if (cut.w == kept->w && cut.i == kept->i) return;
    *kept = cut;
    *sum = kept_sum(e, cols, cut);
}

// After a top-k that dropped tokens, at most FEW are left: gathered in index order, they alone go through top-p
// (a sort of at most FEW) and the draw, which over the whole row took as many passes again as everything before.
// The cut keeps exactly top_k <= FEW tokens (ties broken by index), all of positive weight: 1 <= n <= FEW.
#define FEW 256
static int64_t sample_few(const float* e, int64_t cols, Cut top_k_cut, float top_p, float u, Weight* few) {
    int64_t n = 0;
    for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {  // a vectorized maximum skips the chunks that hold none of them
        const int64_t end = c0 + CHUNK < cols ? c0 + CHUNK : cols;
        float m = 0.0f;
        for (int64_t c = c0; c < end; c++) m = fmaxf(m, e[c]);
        if (m <= 0.0f || m < top_k_cut.w) continue;
        for (int64_t c = c0; c < end; c++)
            if (e[c] > 0.0f && inside(e[c], c, top_k_cut)) few[n++] = (Weight){e[c], (int32_t)c};
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += few[j].w;
    Cut kept = top_k_cut;
    if (top_p < 1.0f && n > 1) {  // taken in descending order while the mass before is below top_p of the sum
        Weight sorted[FEW];
        memcpy(sorted, few, (size_t)n * sizeof(Weight));
        qsort(sorted, (size_t)n, sizeof(Weight), descending);
        const float limit = top_p * sum;
        float before = 0.0f;
        int64_t taken = 0;
        while (taken < n && (taken == 0 || before < limit)) before += sorted[taken++].w;
        if (taken < n) {  // dropped some: the sum is that of the rest (else unchanged, as narrow keeps it)
            kept = (Cut){sorted[taken - 1].w, sorted[taken - 1].i};
            sum = 0.0f;
            for (int64_t j = 0; j < n; j++) sum += inside(few[j].w, few[j].i, kept) ? few[j].w : 0.0f;
        }
    }
    const float target = u * sum;
    float acc = 0.0f;
    int64_t last = few[0].i;
    for (int64_t j = 0; j < n; j++) {
        if (!inside(few[j].w, few[j].i, kept)) continue;
        acc += few[j].w;
        last = few[j].i;
        if (acc > target) return last;
    }
    return last;  // rounding left the sum short of the target
}

// One row's token from its fp32 logits v. The same code for every dtype (a bf16 row is widened first, exactly),
// so a row draws the same token whether it comes in its model's dtype or as the fp32 copy that logits processors
// make. A masked logit (-inf, from a processor or a grammar) counts as NO_SCORE: -ffast-math assumes finite values,
// and the hardware's max turns -inf into NO_SCORE, whose weight is exactly 0.
static int64_t sample_row(const float* v, int64_t cols, float temp, int64_t top_k, float top_p, float min_p,
                          float u, float* e, Weight* head) {
    float m = fmaxf(v[0], NO_SCORE);
    for (int64_t c = 1; c < cols; c++) m = fmaxf(m, fmaxf(v[c], NO_SCORE));
    if (temp <= 0.0f) {
        int64_t pick = 0;
        while (pick < cols - 1 && fmaxf(v[pick], NO_SCORE) != m) pick++;
        return pick;
    }
    const float inv_t = 1.0f / temp;
    for (int64_t c = 0; c < cols; c++) {
        const float x = fmaxf(v[c], NO_SCORE);
        const float w = expf((x - m) * inv_t);
        // min-p: the maximum's weight is 1. A masked token weighs 0 at any temperature: at 1e30 and above,
        // (NO_SCORE - m) / T no longer underflows expf.
        e[c] = (w < min_p) | (x == NO_SCORE) ? 0.0f : w;
    }
    Cut kept = {0.0f, cols};  // every positive weight
    if (top_k > 0) {  // the cut needs no sum: the sum is taken after it, over what it keeps
        const Cut cut = cut_at(e, cols, kept, top_k, 0.0f, head);
        if (top_k <= FEW && (cut.w != kept.w || cut.i != kept.i)) return sample_few(e, cols, cut, top_p, u, head);
        kept = cut;
    }
    float sum = kept_sum(e, cols, kept);
    if (top_p < 1.0f) narrow(e, cols, &kept, &sum, cut_at(e, cols, kept, 0, top_p * sum, head));
    return draw(e, cols, kept, u * sum);
}

// Each thread's buffers (the row widened to fp32, its weights, the sorted range) stay in cache across the passes.
#define DEFINE_SAMPLE(NAME, T, WIDEN)                                                                         \
void NAME(const T* x, int64_t rows, int64_t cols, const float* temps, const int64_t* top_k,                \
          const float* top_p, const float* min_p, const float* uniforms, int64_t* out) {                     \
    _Pragma("omp parallel if (rows * cols >= 1 << 16)")                                                      \
    {                                                                                                        \
        float* v = malloc((size_t)cols * sizeof(float));                                                     \
        float* e = malloc((size_t)cols * sizeof(float));                                                     \
        Weight* head = malloc((size_t)cols * sizeof(Weight));                                                \
        _Pragma("omp for")                                                                                   \
        for (int64_t r = 0; r < rows; r++) {                                                                 \
            const float* row = WIDEN(x + r * cols, v, cols);                                                 \
            out[r] = sample_row(row, cols, temps[r], top_k[r], top_p[r], min_p[r], uniforms[r], e, head);    \
        }                                                                                                    \
        free(v);                                                                                             \
        free(e);                                                                                             \
        free(head);                                                                                          \
    }                                                                                                        \
}

static const float* widen_bf16(const uint16_t* x, float* v, int64_t cols) {
    for (int64_t c = 0; c < cols; c++) v[c] = bf16_load(x[c]);
    return v;
}

static const float* as_is(const float* x, float* v, int64_t cols) {
    (void)v;
    (void)cols;
    return x;
}

DEFINE_SAMPLE(sample_rows_bf16, uint16_t, widen_bf16)
DEFINE_SAMPLE(sample_rows_f32, float, as_is)
