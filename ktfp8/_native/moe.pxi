# MoE seam (moe.h): pack once into a PackedMoE (variant and shape checked there), forward many times.
# forward's arguments arrive validated from ktfp8.moe, their sizes checked once more against the shape
# here; forward_plain checks the usual call's arguments itself, in full; forward_memory takes the
# addresses of tensors _torch.plain_layer_memory has checked in full.

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
        const void *topk_weights
        int32_t weights_dtype
        void *y
        int32_t accumulate
        int32_t threads
        int32_t act_dtype
        int64_t layer_experts
        int32_t activation
        float swiglu_limit
    enum: KTFP8_ACT_SILU, KTFP8_ACT_GELU_TANH

cdef extern from "ktfp8/moe.h":
    int ktfp8_shape_check(const ktfp8_moe_shape *shape)
    size_t ktfp8_packed_size(const ktfp8_moe_shape *shape, const ktfp8_layout *layout) nogil
    void ktfp8_pack(const ktfp8_moe_shape *shape, const ktfp8_layout *layout, const ktfp8_proj_src *src,
                    void *dst, int threads) nogil
    int ktfp8_moe_forward(const ktfp8_variant *variant, const ktfp8_moe_call *call) nogil
    enum: KTFP8_ENOMEM, KTFP8_EINVAL


ACTIVATIONS = {"silu": KTFP8_ACT_SILU, "gelu_pytorch_tanh": KTFP8_ACT_GELU_TANH}


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


cdef ktfp8_moe_shape moe_shape(tuple shape) except *:
    """shape = (experts, hidden, inter, format, block_n, block_k), format an enum ktfp8_wformat, checked."""
    cdef ktfp8_moe_shape s
    s.experts, s.hidden, s.inter, s.format, s.block_n, s.block_k = shape
    if ktfp8_shape_check(&s) != 0:
        raise ValueError(f"invalid MoE shape {shape}: experts, hidden and intermediate sizes must be positive, "
                         f"below 2**31 and at most 2**59 weights in all; block edges positive, K's even")
    return s


def packed_size(Variant variant, tuple shape):
    """The bytes PackedMoE(variant, shape, ...) packs its experts into, found without packing (the
    variant need not run here): the packer's own rule, so that a caller can check memory first."""
    cdef ktfp8_moe_shape s = moe_shape(shape)
    return ktfp8_packed_size(&s, &variant.v.moe.layout)


cdef class PackedMoE:
    """The experts of one layer packed once for one variant, their shape checked once.

    PackedMoE(variant, shape, gate, up, down, gate_scale, up_scale, down_scale, threads, swiglu_limit=None,
              activation="silu"):
    shape = (experts, hidden, inter, format, block_n, block_k) with format an enum ktfp8_wformat;
    weights uint8 codes or uint16 bf16 bits, each [E, out, in] with C-contiguous matrices or a list of
    E [out, in] arrays (expert_pointers); scales float32 (None for bf16); packed on `threads` threads.
    swiglu_limit: the clamp of every call's SwiGLU (ktfp8_moe_call.swiglu_limit), None for none.
    activation: the gate's, "silu" or "gelu_pytorch_tanh" (MoeConfig.hidden_act).
    Never changed after packing, so MoE copies share one."""
    cdef const ktfp8_variant *v
    cdef ktfp8_moe_shape s
    cdef readonly object packed   # uint8, 64-byte aligned
    cdef const void *packed_data
    cdef float swiglu_limit
    cdef int32_t activation

    def __cinit__(self, Variant variant, tuple shape, gate, up, down, gate_scale, up_scale, down_scale,
                  int threads, swiglu_limit=None, activation="silu"):
        self.v = runnable(variant)
        self.s = moe_shape(shape)
        self.swiglu_limit = float("inf") if swiglu_limit is None else swiglu_limit
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
        self.activation = ACTIVATIONS[activation]
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
        self.run(T, k, c_buffer(x, xbytes, "x"), x_dtype, <const int64_t *>c_buffer(topk_ids, 8 * T * k, "topk_ids"),
                 c_buffer(topk_weights, 4 * T * k, "topk_weights"), KTFP8_F32, c_buffer(y, xbytes, "y", True),
                 accumulate, act_dtype, threads, layer_experts, topk_ids)

    def forward_plain(self, x, topk_ids, topk_weights, bf16, int64_t top_k, int act_dtype, int threads):
        """y = MoE(x), a new array, for the plain call: x float32 or `bf16` (a dtype) [T, H], topk_ids
        int64 and topk_weights float32 [T, top_k], each an ndarray (not a subclass) that is
        C-contiguous, aligned and in native byte order; these experts the whole layer.  None, nothing
        computed, for any other arguments: the caller's full checks then take them or name what is wrong.
        Why a path of its own: a decode call streams more weights than the L3 holds, so the Python and
        NumPy code of the next call runs from DRAM.  Zen 4 VM, a tiny layer's call right after a T = 1
        call on the benchmark layer: 61.5 us through ktfp8.moe's checks against 12.9 for the kernel's
        forward alone, 14.4 against 7.5 through these; tools/ab_builds.py, the benchmark layer at
        T = 1 (1.4 ms a call), new / old 0.979x on 1 thread, 0.990x on 2 (builds swapped: 1.020x,
        1.022x).
        Why here, where the seam otherwise holds no logic (DESIGN.md): the same checks in ktfp8.moe,
        in as few Python operations as would do, took 41-49 us of that tiny call after a flush against
        26-29 here (bench_call_overhead.py), and gained about a third as much on the benchmark layer
        (T = 1 on 1 thread 0.996x, swapped 1.010x; against these, 1.001x-1.005x, swapped 0.989x-0.994x)."""
        if not (cnp.PyArray_CheckExact(x) and cnp.PyArray_CheckExact(topk_ids)
                and cnp.PyArray_CheckExact(topk_weights)):
            return None
        cdef cnp.ndarray xa = <cnp.ndarray>x, ids = <cnp.ndarray>topk_ids, w = <cnp.ndarray>topk_weights
        if cnp.PyArray_NDIM(xa) != 2 or cnp.PyArray_NDIM(ids) != 2 or cnp.PyArray_NDIM(w) != 2:
            return None
        cdef int64_t T = cnp.PyArray_DIM(xa, 0)
        if (cnp.PyArray_DIM(xa, 1) != self.s.hidden or cnp.PyArray_DIM(ids, 0) != T or cnp.PyArray_DIM(ids, 1) != top_k
                or cnp.PyArray_DIM(w, 0) != T or cnp.PyArray_DIM(w, 1) != top_k):
            return None
        cdef bint x_f32 = cnp.PyArray_TYPE(xa) == cnp.NPY_FLOAT32 and cnp.PyArray_ISNOTSWAPPED(xa)
        if not (x_f32 or <object>cnp.PyArray_DESCR(xa) is bf16):
            return None
        if not (cnp.PyArray_TYPE(ids) == cnp.NPY_INT64 and cnp.PyArray_ISNOTSWAPPED(ids)
                and cnp.PyArray_TYPE(w) == cnp.NPY_FLOAT32 and cnp.PyArray_ISNOTSWAPPED(w)):
            return None
        for a in (xa, ids, w):
            if not (cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a) and cnp.PyArray_ISALIGNED(<cnp.ndarray>a)):
                return None
        # x's dtype by its type number (ml_dtypes registers bfloat16's), C order
        cdef cnp.ndarray y = cnp.PyArray_EMPTY(2, cnp.PyArray_DIMS(xa), cnp.PyArray_TYPE(xa), 0)
        self.run(T, top_k, cnp.PyArray_DATA(xa), KTFP8_F32 if x_f32 else KTFP8_BF16,
                 <const int64_t *>cnp.PyArray_DATA(ids), cnp.PyArray_DATA(w), KTFP8_F32,
                 cnp.PyArray_DATA(y), False, act_dtype, threads, self.s.experts, ids)
        return y

    def forward_memory(self, int64_t T, size_t x, bint x_bf16, size_t topk_ids, size_t topk_weights,
                       bint weights_bf16, size_t y, int64_t top_k, int act_dtype, int threads, ids_array):
        """The plain call on memory its caller has checked in full (MoE._plain_tensor_call on plain CPU
        tensors, _torch.plain_layer_memory): x [T, H] float32 or bfloat16 (x_bf16), topk_ids int64
        and topk_weights float32 or bfloat16 (weights_bf16) [T, top_k], y [T, H] of x's dtype, each
        C-contiguous and aligned, given by address; these experts the whole layer.  ids_array: what
        np.max reads the ids from for the error an id >= E raises (computed only then)."""
        self.run(T, top_k, <const void *>x, KTFP8_BF16 if x_bf16 else KTFP8_F32, <const int64_t *>topk_ids,
                 <const void *>topk_weights, KTFP8_BF16 if weights_bf16 else KTFP8_F32, <void *>y, False, act_dtype,
                 threads, self.s.experts, ids_array)

    cdef run(self, int64_t T, int64_t k, const void *x, int x_dtype, const int64_t *topk_ids,
             const void *topk_weights, int weights_dtype, void *y, bint accumulate, int act_dtype, int threads,
             int64_t layer_experts, ids_array):
        """The call on checked buffers; ids_array (topk_ids) names the id in the error for one >= E."""
        cdef ktfp8_moe_call c
        c.shape = &self.s
        c.packed = self.packed_data
        c.tokens = T
        c.top_k = k
        c.x = x
        c.x_dtype = x_dtype
        c.topk_ids = topk_ids
        c.topk_weights = topk_weights
        c.weights_dtype = weights_dtype
        c.y = y
        c.accumulate = accumulate
        c.threads = threads
        c.act_dtype = act_dtype
        c.layer_experts = layer_experts
        c.activation = self.activation
        c.swiglu_limit = self.swiglu_limit
        if T == 0:
            return
        cdef int rc
        with nogil:
            rc = ktfp8_moe_forward(self.v, &c)
        if rc == KTFP8_ENOMEM:
            raise MemoryError("ktfp8: out of memory in the MoE forward")
        if rc == KTFP8_EINVAL:  # checked before anything is written; found here, not scanned for per call
            largest = int(np.max(np.asarray(ids_array)))
            raise ValueError(f"topk_ids holds expert id {largest} >= expert_num {self.s.experts}")
