/* One copy of a micro-kernel (UNIT: the path of a moe_<level>.c) behind the names KERNEL_AB_NAME and
 * KERNEL_AB_TABLE, for main.c; kernel_ab.sh compiles it once per build compared. */
#include UNIT

void KERNEL_AB_NAME(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) { tile_matmul2(j0, j1); }

/* The unit's kernel table: the activations it reads (act_dtype, layout.act_exp) and its scratch. */
const ktfp8_moe_kernel *KERNEL_AB_TABLE(void) { return &KTFP8_SYM(ktfp8_moe); }
