# MoE seam (moe.h): pack once, forward many times.  Arguments arrive validated from ktfp8.moe.

from libc.stdint cimport int64_t, int32_t, uint8_t
import numpy as np

cdef extern from "ktfp8/abi.h":
    ctypedef struct ktfp8_moe_shape:
        int64_t experts, hidden, inter
        int32_t format
        int64_t block_n, block_k
    ctypedef struct ktfp8_proj_src:
        const void *w
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

cdef extern from "ktfp8/moe.h":
    int ktfp8_shape_check(const ktfp8_moe_shape *shape)
    size_t ktfp8_packed_size(const ktfp8_moe_shape *shape, const ktfp8_layout *layout) nogil
    void ktfp8_pack(const ktfp8_moe_shape *shape, const ktfp8_layout *layout, const ktfp8_proj_src *src,
                    void *dst, int threads) nogil
    int ktfp8_moe_forward(const ktfp8_variant *variant, const ktfp8_moe_call *call) nogil
    int KTFP8_ENOMEM, KTFP8_EINVAL


cdef ktfp8_moe_shape make_shape(tuple shape) except *:
    cdef ktfp8_moe_shape s
    s.experts, s.hidden, s.inter, s.format, s.block_n, s.block_k = shape
    if ktfp8_shape_check(&s) != 0:
        raise ValueError(f"invalid MoE shape {shape}")
    return s


def moe_act_dtype(str backend):
    """0 (float32) or 1 (bfloat16): the activation dtype the backend's micro-kernel reads."""
    return variant_by_name(backend).moe.act_dtype


def moe_pack(str backend, tuple shape, gate, up, down, gate_scale, up_scale, down_scale, int threads):
    """Packs [E, out, in] weights (uint8 codes or uint16 bf16 bits) into the backend's layout.
    shape = (experts, hidden, inter, format, block_n, block_k).  Returns a uint8 array."""
    cdef const ktfp8_variant *v = variant_by_name(backend)
    cdef ktfp8_moe_shape s = make_shape(shape)
    cdef ktfp8_proj_src src[3]
    arrays = (gate, up, down)
    scales = (gate_scale, up_scale, down_scale)
    cdef Py_buffer views[6]
    cdef int i
    cdef size_t size = ktfp8_packed_size(&s, &v.moe.layout)
    # 64-byte aligned backing store: over-allocate and slice
    raw = np.empty(size + 64, dtype=np.uint8)
    offset = (-raw.ctypes.data) % 64
    out = raw[offset:offset + size]
    cdef uint8_t[::1] dst = out
    cdef const uint8_t[::1] wv
    cdef const float[::1] sv
    keep = []
    for i in range(3):
        wv = np.ascontiguousarray(arrays[i]).reshape(-1).view(np.uint8)
        keep.append(wv)
        src[i].w = &wv[0]
        if scales[i] is None:
            src[i].scale = NULL
        else:
            sv = np.ascontiguousarray(scales[i], dtype=np.float32).reshape(-1)
            keep.append(sv)
            src[i].scale = &sv[0]
    with nogil:
        ktfp8_pack(&s, &v.moe.layout, src, &dst[0], threads)
    return out


def moe_forward(str backend, tuple shape, packed, x, topk_ids, topk_weights, y, bint accumulate,
                int threads, int act_dtype):
    """y (+)= MoE(x).  x, y: float32 or bfloat16 (as uint16) [T, H] C-contiguous; topk_ids int64,
    topk_weights float32, both [T, k] C-contiguous."""
    cdef const ktfp8_variant *v = variant_by_name(backend)
    cdef ktfp8_moe_shape s = make_shape(shape)
    cdef ktfp8_moe_call c
    cdef const uint8_t[::1] pk = packed
    cdef const uint8_t[::1] xb = x.reshape(-1).view(np.uint8)
    cdef uint8_t[::1] yb = y.reshape(-1).view(np.uint8)
    cdef const int64_t[::1] ids = topk_ids.reshape(-1)
    cdef const float[::1] w = topk_weights.reshape(-1)
    cdef int rc
    if x.shape[0] == 0:
        return
    c.shape = &s
    c.packed = &pk[0]
    c.tokens = x.shape[0]
    c.top_k = topk_ids.shape[1]
    c.x = &xb[0]
    c.x_dtype = 0 if x.dtype == np.float32 else 1
    c.topk_ids = &ids[0] if ids.shape[0] else NULL
    c.topk_weights = &w[0] if w.shape[0] else NULL
    c.y = &yb[0]
    c.accumulate = accumulate
    c.threads = threads
    c.act_dtype = act_dtype
    with nogil:
        rc = ktfp8_moe_forward(v, &c)
    if rc == KTFP8_ENOMEM:
        raise MemoryError("ktfp8: out of memory in the MoE forward")
    if rc == KTFP8_EINVAL:
        raise ValueError(f"topk_ids holds an expert id >= expert_num ({s.experts})")
