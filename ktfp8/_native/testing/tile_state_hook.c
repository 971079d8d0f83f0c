/* The palette of the AMX tile configuration this thread holds (0: none, the INIT state), read with
 * STTILECFG: for the test that a forward lets its tiles go (kernel.release).  Callable only on a CPU
 * with AMX-TILE, in a process that Linux has granted the tile state (ktfp8 asks before its first amx
 * call). */
#include <immintrin.h>
#include <stdint.h>

__attribute__((target("amx-tile"))) int ktfp8_testing_tile_palette(void) {
    uint8_t cfg[64] __attribute__((aligned(64)));
    _tile_storeconfig(cfg);
    return cfg[0];
}
