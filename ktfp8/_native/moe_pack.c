/* Repacks Hugging Face [E, out, in] weights into a variant's tile layout (see ktfp8_layout in
 * abi.h), once, at MoE construction.  FP8 stays one byte per weight. */
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h> /* SSE2 is part of x86-64 itself: the baseline these sources are built for */
#endif

#include "ktfp8/fp8.h"
#include "ktfp8/fpenv.h"
#include "ktfp8/moe.h"
#include "ktfp8/team.h"

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

int ktfp8_shape_check(const ktfp8_moe_shape *s) {
    if (s->experts <= 0 || s->hidden <= 0 || s->inter <= 0) return -1;
    /* The packed sizes (experts x rows x K x 2 bytes x 3 projections, padded) must not wrap size_t: at
     * most 2^59 weights an expert set, each size below 2^31 so that hidden * inter cannot overflow. */
    if (s->experts > INT32_MAX || s->hidden > INT32_MAX || s->inter > INT32_MAX) return -1;
    if (s->experts > ((int64_t)1 << 59) / (s->hidden * s->inter)) return -1;
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

/* Each 64-byte group of a tile's FP8 codes, from natural [k / KP][NB][KP] order into `order`'s. */
static void regroup_codes(uint8_t *w, size_t bytes, int order) {
    for (size_t g = 0; g < bytes; g += 64) {
        uint8_t in[64], *out = w + g;
        memcpy(in, out, 64);
        if (order == KTFP8_CODES_VBMI64) {
            /* The AVX-512 BF16 conversion looks the codes up with vpermi2b, then interleaves the
             * low/high bf16 bytes with unpacklo/unpackhi_epi8, which work per 128-bit lane: output
             * word 8L+j (j < 8) comes from byte 16L+j and word 32+8L+j from byte 16L+8+j.  So lane L
             * holds natural bytes 8L..8L+7, then 32+8L..32+8L+7, and the two resulting registers
             * hold words 0..31 and 32..63 in natural order. */
            for (int lane = 0; lane < 4; lane++) {
                memcpy(out + 16 * lane, in + 8 * lane, 8);
                memcpy(out + 16 * lane + 8, in + 32 + 8 * lane, 8);
            }
        } else {
            /* KTFP8_CODES_PAIRS32: 32 bytes = K steps s (v = 0, bytes 0..15) and s + 1 (v = 1, bytes
             * 16..31) of the 16 rows (NB 16, KP 1); moe_avx2.c's pair_row makes 4 vectors of 8 rows
             * from the 4 bytes of each dword: dword d holds rows d + 8 and d, step s + 1 first. */
            for (int half = 0; half < 64; half += 32)
                for (int d = 0; d < 8; d++) {
                    out[half + 4 * d] = in[half + 16 + d + 8];
                    out[half + 4 * d + 1] = in[half + d + 8];
                    out[half + 4 * d + 2] = in[half + 16 + d];
                    out[half + 4 * d + 3] = in[half + d];
                }
        }
    }
}

#ifdef __SSE2__
/* Interleaves the elements of width w bytes (1, 2, 4 or 8) of a and b: the low halves' (hi = 0) or
 * the high halves'. */
static inline __m128i unpack(__m128i a, __m128i b, int w, int hi) {
    switch (w) {
    case 1: return hi ? _mm_unpackhi_epi8(a, b) : _mm_unpacklo_epi8(a, b);
    case 2: return hi ? _mm_unpackhi_epi16(a, b) : _mm_unpacklo_epi16(a, b);
    case 4: return hi ? _mm_unpackhi_epi32(a, b) : _mm_unpacklo_epi32(a, b);
    default: return hi ? _mm_unpackhi_epi64(a, b) : _mm_unpacklo_epi64(a, b);
    }
}

/* Reverses the low `bits` bits of i. */
static inline int bit_reversed(int i, int bits) {
    int r = 0;
    for (int b = 0; b < bits; b++) r |= ((i >> b) & 1) << (bits - 1 - b);
    return r;
}

/* A whole tile of 16 rows, the first `chunks` 16 bytes of each, into natural order [units][16][unit]
 * (unit 1, 2 or 4 bytes).  Each block of g = 16 / unit rows is a g x g matrix of units, transposed in
 * log2 g rounds of unpacks of doubling width (v[i] <- pairs 2i, 2i + 1): afterwards v[i] holds unit
 * bit_reversed(i) of the block's rows.  always_inline, called with a constant unit: the rounds then
 * unroll and v stays in registers. */
static inline __attribute__((always_inline)) void natural_from_rows(uint8_t *out, const uint8_t *rows,
                                                                    size_t row_bytes, int64_t chunks,
                                                                    const int unit) {
    const int g = 16 / unit, bits = unit == 1 ? 4 : unit == 2 ? 3 : 2;
    for (int64_t c = 0; c < chunks; c++)
        for (int r0 = 0; r0 < 16; r0 += g) {
            __m128i v[16], t[16];
#pragma GCC unroll 16
            for (int i = 0; i < g; i++) v[i] = _mm_loadu_si128((const __m128i *)(rows + (r0 + i) * row_bytes + 16 * c));
#pragma GCC unroll 4
            for (int w = unit; w < 16; w *= 2) {
#pragma GCC unroll 8
                for (int i = 0; i < g / 2; i++) {
                    t[i] = unpack(v[2 * i], v[2 * i + 1], w, 0);
                    t[i + g / 2] = unpack(v[2 * i], v[2 * i + 1], w, 1);
                }
#pragma GCC unroll 16
                for (int i = 0; i < g; i++) v[i] = t[i];
            }
#pragma GCC unroll 16
            for (int i = 0; i < g; i++) { /* unit u = c * g + bit_reversed(i) of rows r0 .. r0 + g - 1 */
                const int64_t u = c * g + bit_reversed(i, bits);
                _mm_storeu_si128((__m128i *)(out + (u * 16 + r0) * unit), v[i]);
            }
        }
}

/* FP8 codes of a whole tile of 16 rows, the first `chunks` 16 codes of each, straight into
 * KTFP8_CODES_PAIRS32 order (regroup_codes): K steps s, s + 1 of rows d and d + 8 make dword d of a
 * 32-byte run, bytes (d + 8, s + 1), (d + 8, s), (d, s + 1), (d, s).  Each row's codes byte swapped
 * within their pairs, the 16-bit interleave of rows d + 8 and d holds dword d of the chunk's pairs
 * 0..3 (low half) and 4..7 (high half), and a 4 x 4 dword transpose of rows 0..3 (4..7) gives the
 * first (second) 16 bytes of each pair's 32. */
static void pairs32_chunks(uint8_t *out, const uint8_t *rows, size_t row_bytes, int64_t chunks) {
    for (int64_t c = 0; c < chunks; c++, out += 256) {
        __m128i sw[16], dw[2][8];
        for (int r = 0; r < 16; r++) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(rows + r * row_bytes + 16 * c));
            sw[r] = _mm_or_si128(_mm_slli_epi16(x, 8), _mm_srli_epi16(x, 8));
        }
        for (int d = 0; d < 8; d++) {
            dw[0][d] = _mm_unpacklo_epi16(sw[d + 8], sw[d]);
            dw[1][d] = _mm_unpackhi_epi16(sw[d + 8], sw[d]);
        }
        for (int half = 0; half < 2; half++)     /* pairs 4 half .. 4 half + 3 */
            for (int d0 = 0; d0 < 8; d0 += 4) {  /* dwords d0 .. d0 + 3 of each */
                const __m128i *v = dw[half] + d0;
                const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpacklo_epi32(v[2], v[3]);
                const __m128i t2 = _mm_unpackhi_epi32(v[0], v[1]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
                uint8_t *at = out + 128 * half + 4 * d0;
                _mm_storeu_si128((__m128i *)at, _mm_unpacklo_epi64(t0, t1));
                _mm_storeu_si128((__m128i *)(at + 32), _mm_unpackhi_epi64(t0, t1));
                _mm_storeu_si128((__m128i *)(at + 64), _mm_unpacklo_epi64(t2, t3));
                _mm_storeu_si128((__m128i *)(at + 96), _mm_unpackhi_epi64(t2, t3));
            }
    }
}

/* FP8 pairs (KP 2) of a whole tile of 16 rows, the first `chunks` 16 codes of each, straight into
 * KTFP8_CODES_VBMI64 order (regroup_codes): lane L of a 64-byte group holds K steps k, k + 1 of rows
 * 4L .. 4L + 3, then steps k + 2, k + 3 of the same rows.  Of 16 codes of 4 rows, the 16-bit
 * interleave of rows 0 and 1 (and of 2 and 3) and then the 32-bit interleave of the two give lane L
 * of the chunk's groups 0 and 1 (low halves) and 2 and 3 (high halves). */
static void vbmi64_from_rows(uint8_t *out, const uint8_t *rows, size_t row_bytes, int64_t chunks) {
    for (int64_t c = 0; c < chunks; c++, out += 256)
        for (int lane = 0; lane < 4; lane++) {
            const uint8_t *at = rows + 4 * lane * row_bytes + 16 * c;
            const __m128i r0 = _mm_loadu_si128((const __m128i *)at);
            const __m128i r1 = _mm_loadu_si128((const __m128i *)(at + row_bytes));
            const __m128i r2 = _mm_loadu_si128((const __m128i *)(at + 2 * row_bytes));
            const __m128i r3 = _mm_loadu_si128((const __m128i *)(at + 3 * row_bytes));
            const __m128i lo01 = _mm_unpacklo_epi16(r0, r1), lo23 = _mm_unpacklo_epi16(r2, r3);
            const __m128i hi01 = _mm_unpackhi_epi16(r0, r1), hi23 = _mm_unpackhi_epi16(r2, r3);
            _mm_storeu_si128((__m128i *)(out + 16 * lane), _mm_unpacklo_epi32(lo01, lo23));
            _mm_storeu_si128((__m128i *)(out + 64 + 16 * lane), _mm_unpackhi_epi32(lo01, lo23));
            _mm_storeu_si128((__m128i *)(out + 128 + 16 * lane), _mm_unpacklo_epi32(hi01, hi23));
            _mm_storeu_si128((__m128i *)(out + 192 + 16 * lane), _mm_unpackhi_epi32(hi01, hi23));
        }
}
#endif

/* Units of `unit` bytes (kp weights of one row) of one tile, [units][nb][unit]: unit u of rows
 * 0 .. nb_in - 1 from `from` (row r's unit u at from + r * row_bytes + u * unit), the rows past the
 * matrix zero.  always_inline so that each call site's constant `unit` makes memcpy one move. */
static inline __attribute__((always_inline)) void copy_units(uint8_t *out, const uint8_t *from, size_t row_bytes,
                                                             int64_t u0, int64_t units, int nb, int nb_in,
                                                             const size_t unit) {
    out += (size_t)u0 * nb * unit;
    for (int64_t u = u0; u < units; u++, out += (size_t)nb * unit) {
        for (int r = 0; r < nb_in; r++) memcpy(out + r * unit, from + r * row_bytes + u * unit, unit);
        if (nb_in < nb) memset(out + nb_in * unit, 0, (size_t)(nb - nb_in) * unit);
    }
}

/* Whether any code of row[0 .. len) is a NaN (S.1111.111): sixteen at a time by SSE2 (a byte compare of
 * the low seven bits with 0x7F), then eight at a time: a byte's low seven bits plus one reach bit 7
 * only when they are all ones, and never carry into the next byte.  Packing the benchmark layer's
 * FP8 codes on 1 thread (Zen 4 VM, `avx512` / `avx512_bf16`): 60-62 ms with no scan at all, 70-71
 * with the eight-byte loop alone, 65-68 with the SSE2 loop (two builds alternated, 9 rounds). */
static int has_nan_code(const uint8_t *row, int64_t len) {
    const uint64_t low7 = 0x7F7F7F7F7F7F7F7FULL, ones = 0x0101010101010101ULL, top = 0x8080808080808080ULL;
    uint64_t any = 0;
    int64_t i = 0;
#ifdef __SSE2__
    const __m128i low7x16 = _mm_set1_epi8(0x7F);
    __m128i seen = _mm_setzero_si128();
    for (; i + 16 <= len; i += 16) {
        const __m128i codes = _mm_and_si128(_mm_loadu_si128((const __m128i *)(row + i)), low7x16);
        seen = _mm_or_si128(seen, _mm_cmpeq_epi8(codes, low7x16));
    }
    any = (uint64_t)_mm_movemask_epi8(seen);
#endif
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, row + i, 8);
        any |= ((w & low7) + ones) & top;
    }
    for (; i < len; i++) any |= ktfp8_e4m3_is_nan(row[i]);
    return any != 0;
}

static void pack_tile(const ktfp8_moe_shape *s, const ktfp8_layout *l, const ktfp8_packed_proj *p,
                      const ktfp8_proj_src *src, int64_t e, int64_t tile, uint8_t *w_out, float *s_out) {
    const int nb = l->rows_per_tile, kp = l->k_pack;
    const int64_t row0 = tile * nb;
    const int bf16 = s->format == KTFP8_FMT_BF16;

    /* weights: [k_pad / kp][nb][kp], zero outside the logical matrix, then each 64-byte group in the
     * kernel's code order.  A whole tile of 16 rows goes straight into its order up to u0 units, the
     * whole 16 bytes of each row, by SSE2 transposes.  The rest: whole units of the rows inside copied
     * as such, the units K ends in, or past it, weight by weight, then regrouped. */
    const size_t elem = bf16 ? 2 : 1, unit = (size_t)kp * elem, row_bytes = (size_t)p->k * elem;
    const int nb_in = p->n - row0 < nb ? (int)(p->n - row0) : nb;
    const int64_t whole = p->k / kp, units = p->k_pad / kp;
    const uint8_t *rows = (const uint8_t *)src->w[e] + (size_t)row0 * row_bytes;
    int64_t u0 = 0;
#ifdef __SSE2__
    if (nb == 16 && nb_in == nb) { /* whole 16-byte chunks of every row, by SSE2 transposes */
        const int64_t chunks = (int64_t)(row_bytes / 16);
        if (!bf16 && l->code_order == KTFP8_CODES_PAIRS32 && unit == 1) {
            pairs32_chunks(w_out, rows, row_bytes, chunks);
            u0 = chunks * 16;
        } else if (!bf16 && l->code_order == KTFP8_CODES_VBMI64 && unit == 2) {
            vbmi64_from_rows(w_out, rows, row_bytes, chunks);
            u0 = chunks * 8;
        } else if ((bf16 || l->code_order == KTFP8_CODES_NATURAL) && (unit == 1 || unit == 2 || unit == 4)) {
            if (unit == 1) natural_from_rows(w_out, rows, row_bytes, chunks, 1);
            else if (unit == 2) natural_from_rows(w_out, rows, row_bytes, chunks, 2);
            else natural_from_rows(w_out, rows, row_bytes, chunks, 4);
            u0 = chunks * (int64_t)(16 / unit);
        }
    }
#endif
    if (nb == 1) {                  /* the tile is one row: its units lie as the row's weights do */
        memcpy(w_out, rows, (size_t)whole * unit);
    } else {
        switch (unit) {
        case 1: copy_units(w_out, rows, row_bytes, u0, whole, nb, nb_in, 1); break;
        case 2: copy_units(w_out, rows, row_bytes, u0, whole, nb, nb_in, 2); break;
        case 4: copy_units(w_out, rows, row_bytes, u0, whole, nb, nb_in, 4); break;
        default: copy_units(w_out, rows, row_bytes, u0, whole, nb, nb_in, unit);
        }
    }
    for (int64_t u = whole; u < units; u++)
        for (int r = 0; r < nb; r++)
            for (int q = 0; q < kp; q++) {
                const int64_t k = u * kp + q;
                uint8_t *at = w_out + (((size_t)u * nb + r) * kp + q) * elem;
                if (r < nb_in && k < p->k)
                    memcpy(at, rows + r * row_bytes + k * elem, elem);
                else
                    memset(at, 0, elem);
            }
    if (!bf16 && l->code_order != KTFP8_CODES_NATURAL) {
        const size_t done = (size_t)u0 * nb * unit;
        regroup_codes(w_out + done, p->tile_w_bytes - done, l->code_order);
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
                if (has_nan_code(row + k0, k1 - k0)) v = NAN;
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
