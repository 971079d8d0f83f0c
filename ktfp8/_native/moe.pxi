# MoE seam (moe.h): pack once into a PackedMoE (variant and shape checked there), forward many times.
# Arguments arrive validated from ktfp8.moe; sizes are checked once more against the shape.

import numpy as np

from ..pages import stream_buffer

cdef extern from "ktfp8/abi.h":
    ctypedef struct ktfp8_moe_shape:
        int64_t experts, hidden, inter
        int32_t format
        int64_t block_n, block_k
    ctypedef struct ktfp8_proj_src:
        const void *const *w
        const float *scale
    ctypedef struct ktfp8_moe_call:
        const ktfp8_moe_shape *shape
        const void *packed
        int64_t tokens, top_k
        const void *x
        int32_t x_dtype
        const int64_t *topk_ids
        const float *topk_weights
        void *y
        int32_t accumulate
        int32_t threads
        int32_t act_dtype
        int64_t layer_experts

cdef extern from "ktfp8/moe.h":
    int ktfp8_shape_check(const ktfp8_moe_shape *shape)
    size_t ktfp8_packed_size(const ktfp8_moe_shape *shape, const ktfp8_layout *layout) nogil
    void ktfp8_pack(const ktfp8_moe_shape *shape, const ktfp8_layout *layout, const ktfp8_proj_src *src,
                    void *dst, int threads) nogil
    int ktfp8_moe_forward(const ktfp8_variant *variant, const ktfp8_moe_call *call) nogil
    enum: KTFP8_ENOMEM, KTFP8_EINVAL


cdef object expert_pointers(weights, int64_t E, int64_t out, int64_t inp, size_t wsize, str name):
    """uintp [E]: the address of each expert's [out, in] matrix in `weights`, an ndarray [E, out, in]
    whose matrices are C-contiguous (the experts at any distance: a strided view over a file), or a
    list of E C-contiguous [out, in] arrays."""
    cdef Py_ssize_t size = <Py_ssize_t>wsize, matrix = out * inp * size
    pointers = np.empty(E, np.uintp)
    cdef cnp.ndarray arr
    if isinstance(weights, cnp.ndarray):
        arr = <cnp.ndarray>weights
        if (arr.ndim != 3 or arr.shape[0] != E or arr.shape[1] != out or arr.shape[2] != inp
                or arr.itemsize != size or (inp > 1 and arr.strides[2] != size)
                or (out > 1 and arr.strides[1] != inp * size)):
            raise ValueError(f"{name} must be [{E}, {out}, {inp}] of {wsize}-byte elements with C-contiguous "
                             f"matrices, got shape {weights.shape}, strides {weights.strides}")
        for e in range(E):
            pointers[e] = <size_t>cnp.PyArray_DATA(arr) + e * arr.strides[0]
        return pointers
    if not isinstance(weights, (list, tuple)) or len(weights) != E:
        raise TypeError(f"{name} must be an ndarray [E, out, in] or a list of {E} [out, in] arrays")
    for e in range(E):
        pointers[e] = <size_t>c_buffer(weights[e], matrix, f"{name}[{e}]")
    return pointers


cdef class PackedMoE:
    """The experts of one layer packed once for one variant, their shape checked once.

    PackedMoE(variant, shape, gate, up, down, gate_scale, up_scale, down_scale, threads):
    shape = (experts, hidden, inter, format, block_n, block_k) with format an enum ktfp8_wformat;
    weights uint8 codes or uint16 bf16 bits, each [E, out, in] with C-contiguous matrices or a list of
    E [out, in] arrays (expert_pointers); scales float32 (None for bf16); packed on `threads` threads.
    Never changed after packing, so MoE copies share one."""
    cdef const ktfp8_variant *v
    cdef ktfp8_moe_shape s
    cdef readonly object packed   # uint8, 64-byte aligned
    cdef const void *packed_data

    def __cinit__(self, Variant variant, tuple shape, gate, up, down, gate_scale, up_scale, down_scale,
                  int threads):
        self.v = runnable(variant)
        self.s.experts, self.s.hidden, self.s.inter, self.s.format, self.s.block_n, self.s.block_k = shape
        if ktfp8_shape_check(&self.s) != 0:
            raise ValueError(f"invalid MoE shape {shape}")
        cdef int64_t E = self.s.experts, H = self.s.hidden, I = self.s.inter
        cdef ktfp8_proj_src src[3]
        cdef int i
        cdef int64_t out, inp
        cdef size_t wsize = 2 if self.s.format == KTFP8_FMT_BF16 else 1
        weights, scales = (gate, up, down), (gate_scale, up_scale, down_scale)
        pointers = []           # alive until the packing below returns
        for i in range(3):
            out, inp = (H, I) if i == 2 else (I, H)
            pointers.append(expert_pointers(weights[i], E, out, inp, wsize, ("gate", "up", "down")[i]))
            src[i].w = <const void *const *>cnp.PyArray_DATA(<cnp.ndarray>pointers[i])
            if self.s.format == KTFP8_FMT_BF16:
                src[i].scale = NULL
            elif self.s.format == KTFP8_FMT_FP8_CHANNEL:
                src[i].scale = <const float *>c_buffer(scales[i], 4 * E * out, "scale")
            else:
                src[i].scale = <const float *>c_buffer(
                    scales[i], 4 * E * blocks(out, self.s.block_n) * blocks(inp, self.s.block_k), "scale")
        cdef size_t size = ktfp8_packed_size(&self.s, &self.v.moe.layout)
        self.packed = stream_buffer(size)  # first touched by ktfp8_pack's threads, in huge pages where offered
        self.packed_data = cnp.PyArray_DATA(<cnp.ndarray>self.packed)
        cdef void *dst = <void *>self.packed_data
        with nogil:
            ktfp8_pack(&self.s, &self.v.moe.layout, src, dst, threads)

    def forward(self, x, topk_ids, topk_weights, y, bint accumulate, int act_dtype, int threads,
                int64_t layer_experts=0):
        """y (+)= MoE(x) on `threads` threads.  x, y: float32 or bfloat16 (any 2-byte dtype holding its bits) [T, H] C-contiguous; topk_ids int64,
        topk_weights float32, both [T, k] C-contiguous.  layer_experts: the whole layer's expert count
        where these experts are a shard of it (0: theirs)."""
        if not isinstance(x, cnp.ndarray) or cnp.PyArray_NDIM(<cnp.ndarray>x) != 2 or \
                not isinstance(topk_ids, cnp.ndarray) or cnp.PyArray_NDIM(<cnp.ndarray>topk_ids) != 2:
            raise ValueError("x and topk_ids must be 2-D numpy arrays")
        cdef int64_t T = cnp.PyArray_DIM(<cnp.ndarray>x, 0), k = cnp.PyArray_DIM(<cnp.ndarray>topk_ids, 1)
        cdef int x_dtype = KTFP8_F32 if cnp.PyArray_ITEMSIZE(<cnp.ndarray>x) == 4 else KTFP8_BF16
        cdef size_t xbytes = T * self.s.hidden * dtype_size(x_dtype)
        cdef ktfp8_moe_call c
        c.shape = &self.s
        c.packed = self.packed_data
        c.tokens = T
        c.top_k = k
        c.x = c_buffer(x, xbytes, "x")
        c.x_dtype = x_dtype
        c.topk_ids = <const int64_t *>c_buffer(topk_ids, 8 * T * k, "topk_ids")
        c.topk_weights = <const float *>c_buffer(topk_weights, 4 * T * k, "topk_weights")
        c.y = c_buffer(y, xbytes, "y", True)
        c.accumulate = accumulate
        c.threads = threads
        c.act_dtype = act_dtype
        c.layer_experts = layer_experts
        if T == 0:
            return
        cdef int rc
        with nogil:
            rc = ktfp8_moe_forward(self.v, &c)
        if rc == KTFP8_ENOMEM:
            raise MemoryError("ktfp8: out of memory in the MoE forward")
        if rc == KTFP8_EINVAL:  # checked before anything is written; found here, not scanned for per call
            raise ValueError(f"topk_ids holds expert id {int(np.max(topk_ids))} >= expert_num {self.s.experts}")
