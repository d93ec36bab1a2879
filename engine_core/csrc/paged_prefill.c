// Paged attention for prefill chunks on CPU: each chunk's query rows attend causally to everything in the
// cache up to their own position (a cached prefix, earlier chunks, and this chunk, already written there).
// No gathered copy of the context, no mask tensor, no expanded KV heads: keys and values are read from
// their blocks, once per tile of query rows, for all the query heads that share them.
// AVX-512 or AVX2 + FMA (head_dim % 16 == 0); elsewhere the caller takes the torch path. Each query row is
// computed alone, whatever the rest of its tile or chunk: a prefix-cache hit leaves its logprobs bit for bit.
#include <omp.h>

#include "kernel_common.h"

#define PREFILL_TILE 8  // query rows per work item (csrc/attend_bf16.c: ATTEND_BF16_ROWS); each key row serves them all
#define PREFILL_MAX_BLOCK 64
#define PREFILL_MAX_GROUP 16
#define PREFILL_MAX_DIM 256
#define PREFILL_MAX_HEAD_ELEMS 8192  // num_q_heads * head_dim: a tile's state (2 x 8 x 32 KiB) lives on the stack

#if defined(LANES)
// One tile: query rows [row0, row0 + rows) of a chunk whose first row sits at position first_pos.
#define DEFINE_PREFILL_TILE(NAME, T, VLOAD, STORE)                                                              \
static void NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,    \
                 int64_t first_pos, int rows, T* out, int num_q_heads, int num_kv_heads, int head_dim,          \
                 int block_size, float scale, int64_t window) {                                                 \
    const int group = num_q_heads / num_kv_heads, nv = head_dim / LANES;                                        \
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_elems = block_size * stride;                 \
    vec qv[rows][num_q_heads][nv], acc[rows][num_q_heads][nv], row[PREFILL_MAX_DIM / LANES];                    \
    float m[rows][num_q_heads], l[rows][num_q_heads], scores[rows][PREFILL_MAX_GROUP][PREFILL_MAX_BLOCK];       \
    for (int r = 0; r < rows; r++)                                                                              \
        for (int i = 0; i < num_q_heads; i++) {                                                                 \
            for (int j = 0; j < nv; j++) {                                                                      \
                qv[r][i][j] = vec_mul(VLOAD(q + r * q_row_stride + i * head_dim + LANES * j), vec_set1(scale)); \
                acc[r][i][j] = vec_zero();                                                                      \
            }                                                                                                   \
            m[r][i] = NO_SCORE; l[r][i] = 0.f;                                                                  \
        }                                                                                                       \
    const int64_t context = first_pos + rows;  /* keys the last row of the tile sees */                         \
    for (int64_t start = window_walk_start(first_pos + 1, window, block_size); start < context; start += block_size) { \
        const T* kb = k_cache + table[start / block_size] * block_elems;                                        \
        const T* vb = v_cache + table[start / block_size] * block_elems;                                        \
        /* keys of this block row r may see: those of a prefix of it from hidden[r] on (a window's start) */    \
        int visible[rows], hidden[rows];                                                                        \
        int n = 0;                                                                                              \
        for (int r = 0; r < rows; r++) {                                                                        \
            int64_t v = first_pos + r + 1 - start, f = window_start(first_pos + r + 1, window) - start;         \
            visible[r] = (int)(v < 0 ? 0 : v > block_size ? block_size : v);                                    \
            hidden[r] = (int)(f < 0 ? 0 : f > block_size ? block_size : f);                                     \
            if (hidden[r] >= visible[r]) visible[r] = 0;  /* the block is all before the window: skipped */     \
            n = visible[r] > n ? visible[r] : n;                                                                \
        }                                                                                                       \
        for (int h = 0; h < num_kv_heads; h++) {                                                                \
            for (int t = 0; t < n; t++) {                                                                       \
                for (int j = 0; j < nv; j++) row[j] = VLOAD(kb + t * stride + h * head_dim + LANES * j);        \
                for (int r = 0; r < rows; r++) {                                                                \
                    if (t >= visible[r]) continue;                                                              \
                    for (int g = 0; g < group; g++) {                                                           \
                        const vec* qg = qv[r][h * group + g];                                                   \
                        vec dot = vec_mul(qg[0], row[0]);                                                       \
                        for (int j = 1; j < nv; j++) dot = vec_fmadd(qg[j], row[j], dot);                       \
                        scores[r][g][t] = t < hidden[r] ? NO_SCORE : vec_sum(dot);  /* weight 0 */             \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int r = 0; r < rows; r++) {                                                                    \
                if (!visible[r]) continue;                                                                      \
                for (int g = 0; g < group; g++) {                                                               \
                    const int i = h * group + g;                                                                \
                    const vec c = vec_set1(softmax_update(scores[r][g], visible[r], &m[r][i], &l[r][i]));       \
                    for (int j = 0; j < nv; j++) acc[r][i][j] = vec_mul(acc[r][i][j], c);                       \
                }                                                                                               \
            }                                                                                                   \
            for (int t = 0; t < n; t++) {                                                                       \
                for (int j = 0; j < nv; j++) row[j] = VLOAD(vb + t * stride + h * head_dim + LANES * j);        \
                for (int r = 0; r < rows; r++) {                                                                \
                    if (t >= visible[r]) continue;                                                              \
                    for (int g = 0; g < group; g++) {                                                           \
                        const int i = h * group + g;                                                            \
                        const vec p = vec_set1(scores[r][g][t]);                                                \
                        for (int j = 0; j < nv; j++) acc[r][i][j] = vec_fmadd(p, row[j], acc[r][i][j]);         \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    for (int r = 0; r < rows; r++)                                                                              \
        for (int i = 0; i < num_q_heads; i++) {                                                                 \
            T* o = out + ((int64_t)r * num_q_heads + i) * head_dim;                                             \
            const vec inv = vec_set1(l[r][i] > 0.f ? 1.f / l[r][i] : 0.f);                                      \
            float lanes[LANES];                                                                                 \
            for (int j = 0; j < nv; j++) {                                                                      \
                vec_store(lanes, vec_mul(acc[r][i][j], inv));                                                   \
                for (int d = 0; d < LANES; d++) o[LANES * j + d] = STORE(lanes[d]);                             \
            }                                                                                                   \
        }                                                                                                       \
}

DEFINE_PREFILL_TILE(prefill_rows_bf16, uint16_t, vload_bf16, bf16_store)
DEFINE_PREFILL_TILE(prefill_rows_f32, float, vload_f32, F32_STORE)

_Static_assert(PREFILL_TILE <= ATTEND_MAX_ROWS && PREFILL_MAX_GROUP <= ATTEND_MAX_GROUP,
               "a prefill tile the tile kernels cannot hold");

// The tile kernel for a call's shapes, chosen once, and the most query rows it takes per work item: 16 in the lanes
// (csrc/attend_bf16.c, AVX512-BF16), or several such tiles (csrc/attend_amx.c, AMX); 8 (csrc/attend_avx2.c, AVX2 +
// FMA, AVX-512 CPUs included), else PREFILL_TILE rows a key at a time.
typedef DECLARE_ATTEND_TILE((*attend_tile_bf16), uint16_t);
typedef DECLARE_ATTEND_TILE((*attend_tile_f32), float);

static attend_tile_bf16 pick_tile_bf16(int head_dim, int block_size, int group, int* rows) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (attend_amx_takes(head_dim, block_size)) return *rows = attend_amx_rows(group, head_dim), attend_amx_tile;
#endif
#if defined(__AVX512BF16__)
    if (attend_bf16_takes(head_dim, block_size)) return *rows = ATTEND_BF16_ROWS, attend_bf16_tile;
#endif
    *rows = PREFILL_TILE;
#if defined(__AVX2__) && defined(__FMA__)
    if (attend_avx2_takes(head_dim, block_size)) return attend_avx2_tile_bf16;
#endif
    (void)head_dim, (void)block_size, (void)group;
    return prefill_rows_bf16;
}

static attend_tile_f32 pick_tile_f32(int head_dim, int block_size, int group, int* rows) {
    *rows = PREFILL_TILE;
#if defined(__AVX2__) && defined(__FMA__)
    if (attend_avx2_takes(head_dim, block_size)) return attend_avx2_tile_f32;
#endif
    (void)head_dim, (void)block_size, (void)group;
    return prefill_rows_f32;
}

// The work items of a call at `rows` query rows each (a chunk's last one shorter).
static int64_t work_items(const int64_t* chunks, int num_chunks, int rows) {
    int64_t items = 0;
    for (int c = 0; c < num_chunks; c++) items += (chunks[3 * c + 1] + rows - 1) / rows;
    return items;
}

// chunks: [num_chunks, 3] int64 rows of (first row in the flat batch, query rows, context length after
// the chunk); block_tables: [num_chunks, max_blocks]. q rows are q_row_stride elements apart (a view into
// the qkv projection); out: [T, num_q_heads, head_dim] contiguous, written only at the chunks' rows. window: a
// sliding window (each row sees its last `window` keys), 0 for none.
#define DEFINE_PREFILL(NAME, T, PICK)                                                                   \
void NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* chunks,  \
          int num_chunks, const int64_t* block_tables, int max_blocks, T* out, int num_q_heads,         \
          int num_kv_heads, int head_dim, int block_size, float scale, int64_t window) {                \
    int tile_rows;                                                                                      \
    DECLARE_ATTEND_TILE((*kernel), T) = PICK(head_dim, block_size, num_q_heads / num_kv_heads, &tile_rows); \
    /* Several 16-row tiles per item share its keys' reads, as long as every thread still gets two items */ \
    while (tile_rows > 16 && work_items(chunks, num_chunks, tile_rows) < 2 * omp_get_max_threads())     \
        tile_rows -= 16;                                                                                \
    const int64_t tiles = work_items(chunks, num_chunks, tile_rows);                                    \
    /* Items from the last: a chunk's last rows see the most keys, and the longest items should start first */ \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                    \
    for (int64_t w = 0; w < tiles; w++) {                                                               \
        int c = 0;                                                                                      \
        int64_t tile = tiles - 1 - w;                                                                   \
        while (tile >= (chunks[3 * c + 1] + tile_rows - 1) / tile_rows)                                 \
            tile -= (chunks[3 * c + 1] + tile_rows - 1) / tile_rows, c++;                               \
        const int64_t first_row = chunks[3 * c], num_rows = chunks[3 * c + 1], context = chunks[3 * c + 2]; \
        const int64_t r0 = tile * tile_rows;                                                            \
        const int rows = (int)(num_rows - r0 < tile_rows ? num_rows - r0 : tile_rows);                  \
        kernel(q + (first_row + r0) * q_row_stride, q_row_stride, k_cache, v_cache,                     \
               block_tables + (int64_t)c * max_blocks, context - num_rows + r0, rows,                   \
               out + (first_row + r0) * num_q_heads * head_dim, num_q_heads, num_kv_heads, head_dim,    \
               block_size, scale, window);                                                              \
    }                                                                                                   \
}

DEFINE_PREFILL(paged_prefill_bf16, uint16_t, pick_tile_bf16)
DEFINE_PREFILL(paged_prefill_f32, float, pick_tile_f32)

int paged_prefill_available(void) { return 1; }
#else
// Stubs keep the library's symbols the same everywhere; paged_prefill_available() tells callers not to use them.
void paged_prefill_bf16(void) {}
void paged_prefill_f32(void) {}
int paged_prefill_available(void) { return 0; }
#endif

int paged_prefill_limits(int* max_group, int* max_dim, int* max_block, int* max_head_elems) {
    *max_group = PREFILL_MAX_GROUP; *max_dim = PREFILL_MAX_DIM; *max_block = PREFILL_MAX_BLOCK;
    *max_head_elems = PREFILL_MAX_HEAD_ELEMS;
    return 0;
}
