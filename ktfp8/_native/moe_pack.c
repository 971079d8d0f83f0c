/* Repacks Hugging Face [E, out, in] weights into a variant's tile layout (see ktfp8_layout in
 * abi.h), once, at MoE construction.  FP8 stays one byte per weight. */
#include "ktfp8/fp8.h"
#include "ktfp8/fpenv.h"
#include "ktfp8/moe.h"
#include "ktfp8/team.h"

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

int ktfp8_shape_check(const ktfp8_moe_shape *s) {
    if (s->experts <= 0 || s->hidden <= 0 || s->inter <= 0) return -1;
    if (s->format < KTFP8_FMT_FP8_CHANNEL || s->format > KTFP8_FMT_BF16) return -1;
    if (s->format == KTFP8_FMT_FP8_BLOCK && (s->block_n <= 0 || s->block_k <= 0 || s->block_k % 2))
        return -1;
    return 0;
}

static ktfp8_packed_proj geometry(const ktfp8_moe_shape *s, const ktfp8_layout *l, int64_t n, int64_t k) {
    ktfp8_packed_proj p = {0};
    size_t elem = s->format == KTFP8_FMT_BF16 ? 2 : 1;
    p.n = n;
    p.k = k;
    p.n_tiles = ceil_div(n, l->rows_per_tile);
    p.k_pad = round_up(k, KTFP8_K_ALIGN);
    p.n_kblocks = s->format == KTFP8_FMT_FP8_BLOCK ? ceil_div(k, s->block_k) : 1;
    p.tile_w_bytes = (size_t)p.k_pad * l->rows_per_tile * elem;
    p.tile_scale_floats = s->format == KTFP8_FMT_BF16 ? 0 : (size_t)p.n_kblocks * l->rows_per_tile;
    return p;
}

/* Byte sizes of one projection's weight and scale regions, each 64-byte aligned. */
static size_t w_region(const ktfp8_moe_shape *s, const ktfp8_packed_proj *p) {
    return ALIGN64((size_t)s->experts * p->n_tiles * p->tile_w_bytes);
}
static size_t scale_region(const ktfp8_moe_shape *s, const ktfp8_packed_proj *p) {
    return ALIGN64((size_t)s->experts * p->n_tiles * p->tile_scale_floats * sizeof(float));
}

static void all_geometry(const ktfp8_moe_shape *s, const ktfp8_layout *l, ktfp8_packed_proj g[3]) {
    g[KTFP8_GATE] = geometry(s, l, s->inter, s->hidden);
    g[KTFP8_UP] = geometry(s, l, s->inter, s->hidden);
    g[KTFP8_DOWN] = geometry(s, l, s->hidden, s->inter);
}

size_t ktfp8_packed_size(const ktfp8_moe_shape *s, const ktfp8_layout *l) {
    ktfp8_packed_proj g[3];
    all_geometry(s, l, g);
    size_t total = 0;
    for (int i = 0; i < 3; i++) total += w_region(s, &g[i]) + scale_region(s, &g[i]);
    return total;
}

/* Buffer order: gate weights, gate scales, up weights, up scales, down weights, down scales. */
void ktfp8_packed_views(const ktfp8_moe_shape *s, const ktfp8_layout *l, const void *base,
                        ktfp8_packed_proj views[3]) {
    all_geometry(s, l, views);
    const uint8_t *at = (const uint8_t *)base;
    for (int i = 0; i < 3; i++) {
        views[i].w = at;
        at += w_region(s, &views[i]);
        views[i].scale = (const float *)at;
        at += scale_region(s, &views[i]);
    }
}

/* Position of natural byte i (of [k / KP][NB][KP] order) inside its 64-byte group, for each
 * ktfp8_code_order. */
static int code_pos(int order, int i) {
    if (order == KTFP8_CODES_VBMI64) {
        /* The AVX-512 BF16 conversion looks the codes up with vpermi2b, then interleaves the low/high
         * bf16 bytes with unpacklo/unpackhi_epi8, which work per 128-bit lane: output word 8L+j (j < 8)
         * comes from byte 16L+j and word 32+8L+j from byte 16L+8+j.  Storing the codes in that order
         * makes the two resulting registers hold words 0..31 and 32..63 in natural order. */
        const int half = i / 32, lane = (i % 32) / 8, j = i % 8;
        return 16 * lane + 8 * half + j;
    }
    if (order == KTFP8_CODES_PAIRS32) {
        /* 32 bytes = K steps s (v = 0) and s + 1 (v = 1) of the 16 rows (NB 16, KP 1); moe_avx2.c's
         * pair_row makes 4 vectors of 8 rows from the 4 bytes of each dword: byte 3 - v - 2h of dword
         * i is step v, row 8h + i. */
        const int group = i / 32, v = (i % 32) / 16, row = i % 16;
        return 32 * group + 4 * (row % 8) + 3 - v - 2 * (row / 8);
    }
    return i;
}

static void pack_tile(const ktfp8_moe_shape *s, const ktfp8_layout *l, const ktfp8_packed_proj *p,
                      const ktfp8_proj_src *src, int64_t e, int64_t tile, uint8_t *w_out, float *s_out) {
    const int nb = l->rows_per_tile, kp = l->k_pack;
    const int64_t row0 = tile * nb;
    const int bf16 = s->format == KTFP8_FMT_BF16;

    /* weights: [k_pad / kp][nb][kp], zero outside the logical matrix */
    for (int64_t kk = 0; kk < p->k_pad / kp; kk++)
        for (int r = 0; r < nb; r++)
            for (int q = 0; q < kp; q++) {
                int64_t n = row0 + r, k = kk * kp + q;
                size_t at = ((size_t)kk * nb + r) * kp + q;
                int inside = n < p->n && k < p->k;
                size_t from = (size_t)n * p->k + k;
                if (bf16)
                    ((uint16_t *)w_out)[at] = inside ? ((const uint16_t *)src->w[e])[from] : 0;
                else
                    w_out[at] = inside ? ((const uint8_t *)src->w[e])[from] : 0;
            }
    if (!bf16 && l->code_order != KTFP8_CODES_NATURAL) {
        uint8_t group[64];
        for (size_t g = 0; g < p->tile_w_bytes; g += 64) {
            for (int i = 0; i < 64; i++) group[code_pos(l->code_order, i)] = w_out[g + i];
            memcpy(w_out + g, group, 64);
        }
    }
    if (bf16) return;

    /* scales: [n_kblocks][nb]; a NaN code anywhere in the row (block) makes its scale NaN */
    for (int64_t kb = 0; kb < p->n_kblocks; kb++)
        for (int r = 0; r < nb; r++) {
            int64_t n = row0 + r;
            float v = 0.0f;
            if (n < p->n) {
                int64_t k0 = 0, k1 = p->k;
                if (s->format == KTFP8_FMT_FP8_BLOCK) {
                    int64_t nbk = ceil_div(p->k, s->block_k), nbn = ceil_div(p->n, s->block_n);
                    v = src->scale[((size_t)e * nbn + n / s->block_n) * nbk + kb];
                    k0 = kb * s->block_k;
                    k1 = k0 + s->block_k < p->k ? k0 + s->block_k : p->k;
                } else {
                    v = src->scale[(size_t)e * p->n + n];
                }
                v *= l->scale_mul;
                const uint8_t *row = (const uint8_t *)src->w[e] + (size_t)n * p->k;
                for (int64_t k = k0; k < k1; k++)
                    if (ktfp8_e4m3_is_nan(row[k])) { v = NAN; break; }
            }
            s_out[kb * nb + r] = v;
        }
}

void ktfp8_pack(const ktfp8_moe_shape *s, const ktfp8_layout *l, const ktfp8_proj_src src[3], void *dst,
                int threads) {
    ktfp8_packed_proj views[3];
    ktfp8_packed_views(s, l, dst, views);
    for (int i = 0; i < 3; i++) {
        const ktfp8_packed_proj *p = &views[i];
        int64_t items = s->experts * p->n_tiles;
#pragma omp parallel num_threads(ktfp8_team_size(threads))
        {
            const unsigned csr = ktfp8_fpenv_ieee(); /* scales times scale_mul may be subnormal */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                int64_t e = it / p->n_tiles, tile = it % p->n_tiles;
                pack_tile(s, l, p, &src[i], e, tile, (uint8_t *)p->w + (size_t)it * p->tile_w_bytes,
                          (float *)p->scale + (size_t)it * p->tile_scale_floats);
            }
            ktfp8_fpenv_restore(csr);
        }
    }
}
