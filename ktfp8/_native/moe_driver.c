/* The MoE forward, shared by every variant.  Only tile_matmul is ISA code.
 *
 * Experts first: the (token, slot) pairs are counting-sorted by expert, so each active expert's
 * weights stream from memory once per call whatever T is.  Two parallel phases:
 *   1. items (expert, intermediate tile): gate and up tiles over all of the expert's tokens, then
 *      h = silu(g) * u in FP32, rounded once to the activation dtype for the down projection;
 *   2. items (hidden tile): for every active expert in id order, z = h @ down_tile^T, and
 *      y[token] += weight * z.  Each item owns its columns of y, so no atomics are needed and the
 *      result does not depend on the thread count or the schedule. */
#include "ktfp8/fp8.h"
#include "ktfp8/fpenv.h"
#include "ktfp8/moe.h"

#include <stdlib.h>

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

typedef struct groups {
    int64_t n_pairs;
    int64_t *offset;       /* [E + 1]: pairs of expert e are offset[e] .. offset[e + 1] - 1 */
    int64_t *pair_token;   /* [n_pairs] */
    float *pair_weight;    /* [n_pairs] */
    int64_t *active;       /* [n_active] expert ids with at least one pair, ascending */
    int64_t n_active, max_m;
} groups;

static void *zalloc(size_t bytes) {
    void *p = aligned_alloc(64, ALIGN64(bytes ? bytes : 1));
    if (p) memset(p, 0, ALIGN64(bytes ? bytes : 1));
    return p;
}

static void free_groups(groups *g) {
    free(g->offset);
    free(g->pair_token);
    free(g->pair_weight);
    free(g->active);
}

/* Counting sort of the (token, slot) pairs by expert, stable in (token, slot) order. */
static int group_pairs(const ktfp8_moe_call *c, groups *g) {
    const int64_t E = c->shape->experts, n = c->tokens * c->top_k;
    memset(g, 0, sizeof(*g));
    g->offset = calloc((size_t)E + 1, sizeof(int64_t));
    g->active = calloc((size_t)E, sizeof(int64_t));
    if (!g->offset || !g->active) return KTFP8_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = c->topk_ids[i];
        if (id >= E) return KTFP8_EINVAL;
        if (id >= 0) g->offset[id + 1]++;
    }
    for (int64_t e = 0; e < E; e++) {
        int64_t m = g->offset[e + 1];
        if (m > 0) g->active[g->n_active++] = e;
        if (m > g->max_m) g->max_m = m;
        g->offset[e + 1] += g->offset[e];
    }
    g->n_pairs = g->offset[E];
    g->pair_token = malloc(sizeof(int64_t) * (size_t)(g->n_pairs ? g->n_pairs : 1));
    g->pair_weight = malloc(sizeof(float) * (size_t)(g->n_pairs ? g->n_pairs : 1));
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    if (!g->pair_token || !g->pair_weight || !fill) { free(fill); return KTFP8_ENOMEM; }
    memcpy(fill, g->offset, sizeof(int64_t) * (size_t)E);
    for (int64_t i = 0; i < n; i++) {
        int64_t id = c->topk_ids[i];
        if (id < 0) continue;
        int64_t at = fill[id]++;
        g->pair_token[at] = i / c->top_k;
        g->pair_weight[at] = c->topk_weights[i];
    }
    free(fill);
    return 0;
}

static void store_act(void *row, int64_t i, int act, float v) {
    if (act == KTFP8_BF16)
        ((uint16_t *)row)[i] = ktfp8_bf16_from_f32(v);
    else
        ((float *)row)[i] = v;
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* One micro-kernel call: tile `tile` of expert e's projection p over m activation rows of
 * a_stride elements starting at a; FP32 results into c[m][NB]. */
static void run_tile(const ktfp8_moe_kernel *kern, const ktfp8_moe_shape *s, const ktfp8_packed_proj *p,
                     int64_t e, int64_t tile, const void *a, int act, int64_t m, float *c, void *scratch) {
    const size_t at = (size_t)(e * p->n_tiles + tile);
    ktfp8_tile_job job = {0};
    job.w = p->w + at * p->tile_w_bytes;
    job.scale = p->scale + at * p->tile_scale_floats;
    job.format = s->format;
    job.k = p->k_pad;
    job.block_k = s->block_k;
    job.n_kblocks = p->n_kblocks;
    job.a = a;
    job.a_stride = p->k_pad;
    job.act_dtype = act;
    job.m = m;
    job.c = c;
    job.c_stride = kern->layout.rows_per_tile;
    job.scratch = scratch;
    kern->tile_matmul(&job);
}

int ktfp8_moe_forward(const ktfp8_variant *v, const ktfp8_moe_call *c) {
    const ktfp8_moe_kernel *kern = v->moe;
    const ktfp8_moe_shape *s = c->shape;
    const ktfp8_layout *l = &kern->layout;
    const int nb = l->rows_per_tile, act = c->act_dtype;
    const size_t esz = act == KTFP8_BF16 ? 2 : 4;
    const int64_t T = c->tokens, H = s->hidden, I = s->inter;
    const int threads = c->threads > 0 ? c->threads : 1;
    const int y_is_acc = c->x_dtype == KTFP8_F32; /* y itself is the FP32 accumulator */

    ktfp8_packed_proj proj[3];
    ktfp8_packed_views(s, l, c->packed, proj);
    const int64_t Hp = proj[KTFP8_GATE].k_pad, Ip = proj[KTFP8_DOWN].k_pad;

    groups g;
    int rc = group_pairs(c, &g);
    void *xa = NULL, *h = NULL;
    float *yacc = NULL;
    if (rc) goto done;

    /* FP32 accumulator of y: y itself when it is FP32, else a widened copy */
    yacc = y_is_acc ? (float *)c->y : zalloc(sizeof(float) * (size_t)(T * H));
    xa = zalloc(esz * (size_t)(g.n_pairs * Hp)); /* zero padding: padded K must read as 0 */
    h = zalloc(esz * (size_t)(g.n_pairs * Ip));
    if (!yacc || !xa || !h) { rc = KTFP8_ENOMEM; goto done; }
    if (!c->accumulate) {
        if (y_is_acc) memset(yacc, 0, sizeof(float) * (size_t)(T * H));
    } else if (!y_is_acc) {
        for (int64_t i = 0; i < T * H; i++) yacc[i] = ktfp8_bf16_to_f32(((const uint16_t *)c->y)[i]);
    }

    /* gather each pair's token row, grouped by expert, in the activation dtype */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < g.n_pairs; p++) {
        const int64_t t = g.pair_token[p];
        void *row = (char *)xa + esz * (size_t)(p * Hp);
        if (c->x_dtype == act) {
            memcpy(row, (const char *)c->x + esz * (size_t)(t * H), esz * (size_t)H);
        } else {
            for (int64_t k = 0; k < H; k++)
                store_act(row, k, act, ktfp8_load_f32(c->x, c->x_dtype, (size_t)(t * H + k)));
        }
    }

    const size_t scratch_bytes = kern->tile_scratch_bytes ? kern->tile_scratch_bytes(Hp > Ip ? Hp : Ip) : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
        float *gbuf = zalloc(sizeof(float) * (size_t)(g.max_m * nb));
        float *ubuf = zalloc(sizeof(float) * (size_t)(g.max_m * nb));
        void *scratch = scratch_bytes ? zalloc(scratch_bytes) : NULL;
        int ok = gbuf && ubuf && (scratch || !scratch_bytes);
        failed |= !ok;

        /* phase 1: h = silu(x @ gate^T) * (x @ up^T), per (expert, intermediate tile) */
        const int64_t tiles1 = proj[KTFP8_GATE].n_tiles;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < g.n_active * tiles1; it++) {
            if (!ok) continue;
            const int64_t e = g.active[it / tiles1], tile = it % tiles1;
            const int64_t p0 = g.offset[e], m = g.offset[e + 1] - p0;
            const void *a = (const char *)xa + esz * (size_t)(p0 * Hp);
            run_tile(kern, s, &proj[KTFP8_GATE], e, tile, a, act, m, gbuf, scratch);
            run_tile(kern, s, &proj[KTFP8_UP], e, tile, a, act, m, ubuf, scratch);
            const int64_t n0 = tile * nb, rows = I - n0 < nb ? I - n0 : nb;
            for (int64_t i = 0; i < m; i++) {
                void *hrow = (char *)h + esz * (size_t)((p0 + i) * Ip);
                for (int64_t r = 0; r < rows; r++)
                    store_act(hrow, n0 + r, act, silu(gbuf[i * nb + r]) * ubuf[i * nb + r]);
            }
        }

        /* phase 2: y[token, tile] += weight * (h @ down_tile^T), experts in id order */
        const int64_t tiles2 = proj[KTFP8_DOWN].n_tiles;
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < tiles2; tile++) {
            if (!ok) continue;
            const int64_t n0 = tile * nb, cols = H - n0 < nb ? H - n0 : nb;
            for (int64_t a = 0; a < g.n_active; a++) {
                const int64_t e = g.active[a], p0 = g.offset[e], m = g.offset[e + 1] - p0;
                const void *hrows = (const char *)h + esz * (size_t)(p0 * Ip);
                run_tile(kern, s, &proj[KTFP8_DOWN], e, tile, hrows, act, m, gbuf, scratch);
                for (int64_t i = 0; i < m; i++) {
                    float *yrow = yacc + g.pair_token[p0 + i] * H + n0;
                    const float w = g.pair_weight[p0 + i];
                    for (int64_t r = 0; r < cols; r++) yrow[r] += w * gbuf[i * nb + r];
                }
            }
        }
        free(gbuf);
        free(ubuf);
        free(scratch);
        ktfp8_fpenv_restore(csr);
    }
    if (failed) { rc = KTFP8_ENOMEM; goto done; }

    if (!y_is_acc)
        for (int64_t i = 0; i < T * H; i++) ((uint16_t *)c->y)[i] = ktfp8_bf16_from_f32(yacc[i]);

done:
    if (!y_is_acc) free(yacc);
    free(xa);
    free(h);
    free_groups(&g);
    return rc;
}
