/* One copy of a micro-kernel (UNIT: the path of a moe_<level>.c) behind the names KERNEL_AB_NAME and
 * KERNEL_AB_TABLE, for main.c; kernel_ab.sh compiles it once per build compared. */
#include UNIT

#ifdef KERNEL_AB_TILE_BY_TILE /* a unit without tile_matmul2 (moe_avx512.c): the driver runs the two tiles in turn */
void KERNEL_AB_NAME(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) {
    tile_matmul(j0);
    tile_matmul(j1);
}
#else
void KERNEL_AB_NAME(const ktfp8_tile_job *j0, const ktfp8_tile_job *j1) { tile_matmul2(j0, j1); }
#endif

/* The unit's kernel table: the activations it reads (act_dtype, layout.act_exp) and its scratch. */
const ktfp8_moe_kernel *KERNEL_AB_TABLE(void) { return &KTFP8_SYM(ktfp8_moe); }
