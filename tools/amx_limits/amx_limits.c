/* What bounds the amx kernel's tile pair on the CPU at hand: the loop of moe_amx.c's passes taken
 * apart, each variant timed in the same process (amx_limits.sh builds and runs it; the figures of
 * docs/tuning-notes.md's "Why a tile pair runs at two thirds of the peak" and later).
 *
 * One tile pair as T = 512 gives it on the benchmark layer: m = 64 tokens (4 chunks of 16), two weight
 * tiles (32 columns), K = 2048 (64 slabs of 32), BF16 weights, run as moe_amx.c's parked_pass runs FP8
 * tiles of 49..256 tokens: chunks 0..2 against both weight tiles in 6 C tiles for the whole K (one A
 * and one B register, 7 tile loads per 6 products), and after every 8 slabs chunk 3 over the same
 * slabs, its two C tiles parked in L1 between blocks (in tmm4 and tmm7, whose C tiles are parked
 * meanwhile); B tiles from a ring of 9 slabs a weight tile in L1.  (Until the Emerald Rapids VM's
 * eighth session in docs/tuning-notes.md it timed the loop of one weight tile at a time, 4 A x 1 B ->
 * 4 C, that parked_pass replaced, and before the fourth two passes of 2 A x 2 B -> 4 C with B from
 * the whole converted tile pair in L2: the notes' earlier amx_limits figures are of those loops.)
 * Each round times every variant once, in a rotating order; the report gives each one's median time
 * per tile pair and its share of the resident-operand peak measured in the same rounds.
 *
 *   peak        the same tdpbf16ps count on tiles loaded once (no tile loads in the loop)
 *   passes      the pass as parked_pass runs it: each A tile loaded with the non-temporal hint
 *               (TILELOADDT1) from the activations (64 rows of K, 256 KiB: L2), B from the ring (L1)
 *   passes A1   every A tile from one address (TILELOADD, L1)
 *   convert     the pair's 64 K FP8 codes -> BF16, slab by slab into the ring (the codes, 64 KiB, in L2)
 *   passes+cvt  each slab also converts both tiles' next slabs into the ring, where parked_pass does
 *   A1+cvt      the same with every A tile from one address
 *   passes+alu  each slab also runs, twice (where passes+cvt converts), that many register-only
 *               vector instructions (128 unless given: amx_limits.sh 16) of one mix: "mix" (the
 *               default) half vpermt2b and half vpaddw;
 *               "permute" vpermt2b (port 5 only), "shift" vpsllw / vpsrlw (port 0 only), "add" vpaddw
 *               (port 0 or 5): amx_limits.sh 128 shift.  Which ports these take: Intel's optimization
 *               manual's tables for Ice Lake and later (512-bit work on ports 0 and 5).
 *   alu         those instructions alone          peak+alu  beside the peak loop (no tile loads)
 *   loads       the pass's 640 tile loads (and its parked C tiles' loads and stores), no tdpbf16ps
 *   loads L1    the same loads, every A tile from one address
 * Needs AMX-TILE, AMX-BF16, AVX-512 BW and VBMI, and Linux's permission to use the tiles. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ktfp8/amx_tilecfg.h"
#include "ktfp8/cpu_features.h"
#include "ktfp8/e4m3_bf16_vbmi.h"

#define K 2048
#define SLABS (K / 32)
#define M 64
#define SLAB_BYTES 1024          /* one BF16 B tile: 16 K pairs x 16 columns x 2 */
#define A_STRIDE (K + 32)        /* elements: ktfp8_row_stride (moe.h) for K = 2048 in BF16 */
#define ALU_OPS_DEFAULT 128      /* per slab, about the conversion's instruction count */
#define ROUNDS 15

static uint16_t *a_rows;         /* [M][A_STRIDE] bf16 activations */
static uint8_t *codes;           /* [2][K * 16] FP8 codes, moe_pack.c's order */
#define PARK_BLOCK 8             /* slabs per K block of the parked chunk: moe_amx.c's PARK_K_BLOCK */
#define RING_SLABS (PARK_BLOCK + 1)
static uint8_t ring[2][RING_SLABS * SLAB_BYTES] __attribute__((aligned(64))); /* [weight tile][slab % 9] BF16 B */
static float c_out[6][16 * 16] __attribute__((aligned(64)));  /* C tiles 0..5 at the end */
static float c_parked[2][16 * 16] __attribute__((aligned(64))); /* chunk 3's C tiles between K blocks */
static int alu_ops = ALU_OPS_DEFAULT; /* per slab, a multiple of 4 (the command line's argument) */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* GCC's tile intrinsics do not tell the compiler which memory they read (see moe_amx.c). */
static inline void compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }

static void configure(void) {
    ktfp8_amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < KTFP8_AMX_TILES; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    compiler_barrier();
    _tile_loadconfig(&cfg);
}

static const uint16_t *a_tile(int chunk, int slab) { return a_rows + (size_t)chunk * 16 * A_STRIDE + slab * 32; }
static const uint8_t *ring_slab(int w, int slab) { return ring[w] + (slab % RING_SLABS) * SLAB_BYTES; }

/* Slab `slab` of weight tile w's codes into its slot of the ring (nothing past the tile's last slab). */
static void convert_slab(int w, int slab) {
    if (slab >= SLABS) return;
    const uint8_t *tile = codes + (size_t)w * K * 16;
    const ktfp8_prefetch_two ahead =
        ktfp8_prefetch_two_of(tile, NULL, K * 16, KTFP8_AMX_PREFETCH_L2_BYTES, KTFP8_AMX_PREFETCH_L1_BYTES);
    ktfp8_e4m3_tile_to_bf16(tile + (size_t)slab * 512, 32, (uint16_t *)ring_slab(w, slab), &ahead, (int64_t)slab * 512);
}

/* The vector instructions beside the tiles (see the header comment). */
enum { MIX, PERMUTE, SHIFT, ADD };
static const char *const mix_names[] = {"mix", "permute", "shift", "add"};
static int alu_mix = MIX;

/* alu_ops vector instructions of one mix on registers only, in 4 independent chains; `mix` is a
 * constant after inlining, so the loop holds the vector instructions and its counter only. */
static inline __attribute__((always_inline)) void alu_chains(const int mix) {
    __m512i x0 = _mm512_set1_epi32(1), x1 = x0, x2 = x0, x3 = x0;
    const __m512i t = _mm512_set1_epi32(3);
    for (int r = 0; r < alu_ops / 4; r++) {
        switch (mix) {
        case MIX:
            x0 = _mm512_permutex2var_epi8(x0, t, x1);
            x1 = _mm512_add_epi16(x1, t);
            x2 = _mm512_permutex2var_epi8(x2, t, x3);
            x3 = _mm512_add_epi16(x3, t);
            break;
        case PERMUTE:
            x0 = _mm512_permutex2var_epi8(x0, t, t);
            x1 = _mm512_permutex2var_epi8(x1, t, t);
            x2 = _mm512_permutex2var_epi8(x2, t, t);
            x3 = _mm512_permutex2var_epi8(x3, t, t);
            break;
        case SHIFT:
            x0 = _mm512_slli_epi16(x0, 1);
            x1 = _mm512_srli_epi16(x1, 1);
            x2 = _mm512_slli_epi16(x2, 1);
            x3 = _mm512_srli_epi16(x3, 1);
            break;
        default:
            x0 = _mm512_add_epi16(x0, t);
            x1 = _mm512_add_epi16(x1, t);
            x2 = _mm512_add_epi16(x2, t);
            x3 = _mm512_add_epi16(x3, t);
        }
        __asm__ volatile("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3));
    }
}

static void alu_work(void) {
    switch (alu_mix) {
    case MIX: alu_chains(MIX); break;
    case PERMUTE: alu_chains(PERMUTE); break;
    case SHIFT: alu_chains(SHIFT); break;
    default: alu_chains(ADD);
    }
}

enum { EXTRA_NONE, EXTRA_CONVERT, EXTRA_ALU };
enum { FROM_L2, A_FIXED };

/* C tiles 0..3 (tmm0..3), of the peak loop and of pair_pass: zeroed before it, stored after it. */
static void zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static void store_c(void) {
    _tile_stored(0, c_out[0], 64);
    _tile_stored(1, c_out[1], 64);
    _tile_stored(2, c_out[2], 64);
    _tile_stored(3, c_out[3], 64);
}

/* Chunk ch's A tile of slab s into tmm5: from the activations with the non-temporal hint, as
 * moe_amx.c loads them, or (A_FIXED) from one address with a plain load. */
#define LOAD_A(ch, from, s)                                                  \
    do {                                                                     \
        if ((from) == A_FIXED)                                               \
            _tile_loadd(5, a_tile(0, 0), A_STRIDE * 2);                      \
        else                                                                 \
            _tile_stream_loadd(5, a_tile(ch, s), A_STRIDE * 2);              \
    } while (0)
/* A product, or nothing where only the loads are timed (`products` is a constant after inlining) */
#define DP(c, a, b)                             \
    do {                                        \
        if (products) _tile_dpbf16ps(c, a, b);  \
    } while (0)

/* The work beside the products at one of the two places parked_pass converts a slab. */
static inline __attribute__((always_inline)) void beside(int extra, int w, int slab) {
    compiler_barrier();
    if (extra == EXTRA_CONVERT) convert_slab(w, slab);
    if (extra == EXTRA_ALU) alu_work();
    compiler_barrier();
}

/* moe_amx.c's parked_pass for m = 64 (4 chunks): chunks 0..2 x weight tiles 0, 1 in C tiles 0..4 and
 * tmm7, A in tmm5, B in tmm6 (A0 B0, A0 B1, A1 B1, A1 B0, A2 B0, A2 B1); after each K block of 8
 * slabs, chunk 3 over the same slabs in tmm4 and tmm7, their own C tiles parked meanwhile. */
static inline __attribute__((always_inline)) void pair_pass(int from, int extra, int products) {
    if (extra == EXTRA_CONVERT) {
        convert_slab(0, 0);
        convert_slab(1, 0);
    }
    for (int s0 = 0; s0 < SLABS; s0 += PARK_BLOCK) {
        const int s1 = s0 + PARK_BLOCK;
        if (s0 == 0) {
            zero_c();
            _tile_zero(4);
            _tile_zero(7);
        }
        for (int s = s0; s < s1; s++) {
            beside(extra, 0, s + 1);
            LOAD_A(0, from, s);
            _tile_loadd(6, ring_slab(0, s), 64);
            DP(0, 5, 6);
            _tile_loadd(6, ring_slab(1, s), 64);
            DP(1, 5, 6);
            beside(extra, 1, s + 1);
            LOAD_A(1, from, s);
            DP(3, 5, 6);
            _tile_loadd(6, ring_slab(0, s), 64);
            DP(2, 5, 6);
            LOAD_A(2, from, s);
            DP(4, 5, 6);
            _tile_loadd(6, ring_slab(1, s), 64);
            DP(7, 5, 6);
        }
        _tile_stored(4, c_out[4], 64);
        _tile_stored(7, c_out[5], 64);
        compiler_barrier();
        if (s0 == 0) {
            _tile_zero(4);
            _tile_zero(7);
        } else {
            _tile_loadd(4, c_parked[0], 64);
            _tile_loadd(7, c_parked[1], 64);
        }
        for (int s = s0; s < s1; s++) {
            LOAD_A(3, from, s);
            _tile_loadd(6, ring_slab(0, s), 64);
            DP(4, 5, 6);
            _tile_loadd(6, ring_slab(1, s), 64);
            DP(7, 5, 6);
        }
        _tile_stored(4, c_parked[0], 64);
        _tile_stored(7, c_parked[1], 64);
        compiler_barrier();
        if (s1 < SLABS) {
            _tile_loadd(4, c_out[4], 64);
            _tile_loadd(7, c_out[5], 64);
        }
    }
    store_c();
    compiler_barrier();
}

static void passes(int from, int extra) { pair_pass(from, extra, 1); }

/* The pass's tile loads without its products: what the loads alone cost. */
static void loads(int from) { pair_pass(from, EXTRA_NONE, 0); }

/* The same tdpbf16ps count with every operand tile loaded once. */
static void peak(int extra) {
    _tile_loadd(4, a_tile(0, 0), A_STRIDE * 2);
    _tile_loadd(5, a_tile(1, 0), A_STRIDE * 2);
    _tile_loadd(6, ring_slab(0, 0), 64);
    _tile_loadd(7, ring_slab(1, 0), 64);
    for (int w = 0; w < 2; w++) {
        zero_c();
        for (int s = 0; s < SLABS; s++) {
            if (extra == EXTRA_ALU) alu_work();
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        store_c();
    }
}

static void convert_pair(void) {
    for (int w = 0; w < 2; w++)
        for (int s = 0; s < SLABS; s++) convert_slab(w, s);
    compiler_barrier();
}

static void alu_alone(void) {
    for (int i = 0; i < 2 * SLABS; i++) alu_work();
}

static void v_peak(void) { peak(EXTRA_NONE); }
static void v_passes(void) { passes(FROM_L2, EXTRA_NONE); }
static void v_a_fixed(void) { passes(A_FIXED, EXTRA_NONE); }
static void v_passes_convert(void) { passes(FROM_L2, EXTRA_CONVERT); }
static void v_a_fixed_convert(void) { passes(A_FIXED, EXTRA_CONVERT); }
static void v_passes_alu(void) { passes(FROM_L2, EXTRA_ALU); }
static void v_peak_alu(void) { peak(EXTRA_ALU); }
static void v_loads(void) { loads(FROM_L2); }
static void v_loads_l1(void) { loads(A_FIXED); }

static const struct {
    const char *name;
    void (*run)(void);
    int products; /* runs the tile pair's tdpbf16ps (its GFLOP/s and share of the peak mean something) */
} variants[] = {
    {"peak", v_peak, 1},           {"passes", v_passes, 1},          {"passes A1", v_a_fixed, 1},
    {"convert", convert_pair, 0},  {"passes+cvt", v_passes_convert, 1}, {"A1+cvt", v_a_fixed_convert, 1},
    {"passes+alu", v_passes_alu, 1}, {"alu", alu_alone, 0},          {"peak+alu", v_peak_alu, 1},
    {"loads", v_loads, 0},         {"loads L1", v_loads_l1, 0},
};
enum { N_VARIANTS = sizeof(variants) / sizeof(variants[0]) };

static int by_value(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static void *alloc64(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!p) {
        fprintf(stderr, "amx_limits: out of memory\n");
        exit(1);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc > 1) alu_ops = atoi(argv[1]) / 4 * 4;
    if (argc > 2) {
        alu_mix = -1;
        for (int i = 0; i < (int)(sizeof mix_names / sizeof mix_names[0]); i++)
            if (!strcmp(argv[2], mix_names[i])) alu_mix = i;
    }
    if (alu_ops < 4 || alu_mix < 0 || argc > 3) {
        fprintf(stderr, "usage: %s [vector instructions per slab, >= 4] [mix | permute | shift | add]\n", argv[0]);
        return 2;
    }
    if (!ktfp8_amx_permission()) {
        fprintf(stderr, "amx_limits: this CPU or kernel does not allow AMX tiles\n");
        return 1;
    }
    a_rows = alloc64((size_t)M * A_STRIDE * 2);
    codes = alloc64(2 * K * 16);
    for (size_t i = 0; i < (size_t)M * A_STRIDE; i++) a_rows[i] = 0x3f80; /* bf16 1.0 */
    for (size_t i = 0; i < sizeof ring / 2; i++) ((uint16_t *)ring)[i] = 0x3f80;
    for (size_t i = 0; i < 2 * K * 16; i++) codes[i] = (uint8_t)(rand() & 0xF7); /* finite (bit 3 clear), both signs */
    configure();
    double t[N_VARIANTS][ROUNDS];
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < N_VARIANTS; i++) {
            const int v = (i + r) % N_VARIANTS;
            const int calls = 200;
            const double t0 = now();
            for (int c = 0; c < calls; c++) variants[v].run();
            t[v][r] = (now() - t0) / calls;
        }
    _tile_release();
    double med[N_VARIANTS];
    for (int v = 0; v < N_VARIANTS; v++) {
        qsort(t[v], ROUNDS, sizeof(double), by_value);
        med[v] = t[v][ROUNDS / 2];
    }
    const double flop = 2.0 * M * K * 32; /* a tile pair: 32 weight rows */
    printf("tile pair m = %d, K = %d, BF16 weights, %d vector instructions per slab (%s); medians of %d rounds\n", M,
           K, alu_ops, mix_names[alu_mix], ROUNDS);
    for (int v = 0; v < N_VARIANTS; v++) {
        printf("  %-11s %7.2f us", variants[v].name, med[v] * 1e6);
        if (variants[v].products) printf("  %6.0f GFLOP/s  %4.0f %% of peak", flop / med[v] / 1e9, 100.0 * med[0] / med[v]);
        printf("\n");
    }
    return 0;
}
