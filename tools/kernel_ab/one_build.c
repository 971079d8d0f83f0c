/* One copy of a micro-kernel (UNIT: the path of a moe_avx512bf16.c or moe_amx.c) behind the name
 * KERNEL_AB_NAME, for main.c; kernel_ab.sh compiles it once per build compared. */
#include UNIT

void KERNEL_AB_NAME(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) { tile_matmul2(j0, j1); }
