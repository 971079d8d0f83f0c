/* Test hook for include/ktfp8/amx_emulation.h: one emulated TDPBF16PS on caller-given tiles, so the
 * test suite can check the emulation against its own loop (tests/test_amx_emulation.py).
 * Baseline code: the emulation is portable C and needs no ISA flags. */
#include <stddef.h>

#include "ktfp8/amx_emulation.h"

/* Extent in bytes that `rows` rows of `colsb` bytes, `stride` apart, cover. */
static size_t extent(int rows, int colsb, long stride) {
    return rows ? (size_t)(rows - 1) * (size_t)stride + (size_t)colsb : 0;
}

/* cfg: the 64-byte LDTILECFG operand.  Loads tile d from c, a from a, b from b (each with its own
 * row stride in bytes), runs TDPBF16PS d, a, b, and stores tile d to out (stride c_stride).
 * Returns 0, or -1 (nothing run) when a buffer is shorter than the configured tile needs or a
 * stride is shorter than a row.  Shape errors the hardware would fault on abort the process. */
int ktfp8_amx_emulated_dpbf16ps(const void *cfg, int d, int a, int b, const void *c, long c_stride,
                                size_t c_bytes, const void *av, long a_stride, size_t a_bytes,
                                const void *bv, long b_stride, size_t b_bytes, void *out, size_t out_bytes) {
    ktfp8_amx_tilecfg shape;
    memcpy(&shape, cfg, sizeof(shape));
    const int tiles[3] = {d, a, b};
    const long strides[3] = {c_stride, a_stride, b_stride};
    const size_t sizes[3] = {c_bytes < out_bytes ? c_bytes : out_bytes, a_bytes, b_bytes};
    for (int i = 0; i < 3; i++) {
        const int t = tiles[i];
        if (t < 0 || t >= KTFP8_AMX_TILES) return -1;
        if (strides[i] < shape.colsb[t] || extent(shape.rows[t], shape.colsb[t], strides[i]) > sizes[i])
            return -1;
    }
    _tile_loadconfig(cfg);
    _tile_loadd(d, c, c_stride);
    _tile_loadd(a, av, a_stride);
    _tile_loadd(b, bv, b_stride);
    _tile_dpbf16ps(d, a, b);
    _tile_stored(d, out, c_stride);
    _tile_release();
    return 0;
}
