# Routing seam (routing.h).  Arguments arrive validated from ktfp8.route: float32 C-contiguous logits
# [T, E], bias None or float32 [E] (finite), ids int64 and weights float32 [T, k] to fill.

cdef extern from "ktfp8/routing.h":
    cpdef enum ktfp8_scoring:
        KTFP8_SOFTMAX
        KTFP8_SIGMOID
    cpdef enum ktfp8_group_score:
        KTFP8_GROUP_BEST
        KTFP8_GROUP_TOP2_SUM
    ctypedef struct ktfp8_route_cfg:
        int64_t experts, top_k
        int32_t scoring
        int64_t n_group, topk_group
        int32_t group_score
        int32_t norm_topk_prob
        float routed_scaling_factor
    int ktfp8_route(const ktfp8_route_cfg *cfg, const float *logits, int64_t tokens, const float *bias,
                    int64_t *ids, float *weights) nogil


def route(logits, bias, topk_ids, topk_weights, int scoring, int64_t n_group, int64_t topk_group,
          int group_score, bint norm_topk_prob, float routed_scaling_factor):
    """Fills topk_ids [T, k] and topk_weights [T, k] from logits [T, E]."""
    cdef ktfp8_route_cfg cfg
    cdef int64_t T = cnp.PyArray_DIM(<cnp.ndarray?>logits, 0)
    cfg.experts = cnp.PyArray_DIM(<cnp.ndarray>logits, 1)
    cfg.top_k = cnp.PyArray_DIM(<cnp.ndarray?>topk_ids, 1)
    cfg.scoring, cfg.n_group, cfg.topk_group, cfg.group_score = scoring, n_group, topk_group, group_score
    cfg.norm_topk_prob, cfg.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
    if (n_group < 1 or cfg.experts % n_group or not 1 <= topk_group <= n_group or not 1 <= cfg.top_k <= cfg.experts
            or group_score not in (KTFP8_GROUP_BEST, KTFP8_GROUP_TOP2_SUM)):
        raise ValueError("invalid routing configuration")
    cdef const float *lg = <const float *>c_buffer(logits, 4 * T * cfg.experts, "router_logits")
    cdef const float *b = NULL
    if bias is not None:
        b = <const float *>c_buffer(bias, 4 * cfg.experts, "correction_bias")
    cdef int64_t *ids = <int64_t *>c_buffer(topk_ids, 8 * T * cfg.top_k, "topk_ids", True)
    cdef float *w = <float *>c_buffer(topk_weights, 4 * T * cfg.top_k, "topk_weights", True)
    cdef int rc
    with nogil:
        rc = ktfp8_route(&cfg, lg, T, b, ids, w)
    if rc:
        raise MemoryError("ktfp8: out of memory in route")
