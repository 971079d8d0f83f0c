"""route(): router logits -> (topk_ids, topk_weights), computed as the reference models compute them.

All arithmetic is float32, like the Hugging Face routers (softmax / sigmoid in float32 whatever the
logit dtype), so the weights agree with them to float32 rounding of exp and sums (~1e-7).
"""
import ml_dtypes
import numpy as np

from ._torch import accepts_tensors
from .config import MoeConfig

_LOGIT_DTYPES = tuple(np.dtype(t) for t in (np.float32, ml_dtypes.bfloat16, np.float16))
_BIAS_DTYPES = _LOGIT_DTYPES + (np.dtype(np.float64),)
# DeepSeek adds this to the renormalisation denominator. For softmax top-k the sum is >= 1/expert_num,
# so in float32 the epsilon changes nothing there and one formula serves every family.
_RENORM_EPS = np.float32(1e-20)


@accepts_tensors("router_logits")
def route(router_logits, cfg, correction_bias=None):
    """Chooses num_experts_per_tok experts per token and their weights.

    router_logits: [T, expert_num] float32, bfloat16 or float16 (T may be 0).
    correction_bias: None or [expert_num] (float32, or any float dtype, cast to float32): added to the
        scores for *choosing* experts only, never to the weights (DeepSeek-V3 `e_score_correction_bias`).
    Returns topk_ids int64 [T, k] and topk_weights float32 [T, k] (CPU tensors when router_logits
    is a torch tensor).

    scores = softmax(logits) (Qwen2/3-MoE, Mixtral, DeepSeek-V2) or sigmoid(logits) (DeepSeek-V3), in
    float32. With n_group > 1, only the topk_group best groups of expert_num / n_group consecutive experts
    stay eligible; a group's score is its best score (softmax, DeepSeek-V2 group_limited_greedy) or the
    sum of its two best biased scores (sigmoid, DeepSeek-V3 noaux_tc; a group of one expert: its
    score). The k eligible experts with the highest (biased) score are chosen; weights are their unbiased
    scores, divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor.

    Each row lists its experts best first. Among equal scores the lower expert id wins; torch.topk
    picks some tied expert without saying which, so exact ties may pick other (equally weighted)
    experts than a transformers model. A row with a NaN score (NaN logit, or +-Inf in softmax) gets
    NaN weights, so the NaN reaches the MoE output; its ids stay valid, distinct expert ids.
    transformers' Qwen-MoE routers round their weights to the logits' dtype (bfloat16 in a bfloat16
    model); these weights stay float32.
    """
    if not isinstance(cfg, MoeConfig):
        raise TypeError(f"cfg must be a ktfp8.MoeConfig, got {type(cfg).__name__}")
    E, k = cfg.expert_num, cfg.num_experts_per_tok
    if not isinstance(router_logits, np.ndarray) or router_logits.dtype not in _LOGIT_DTYPES:
        got = router_logits.dtype if isinstance(router_logits, np.ndarray) else type(router_logits).__name__
        raise TypeError(f"router_logits must be a numpy array of float32, bfloat16 or float16, got {got}")
    if router_logits.ndim != 2 or router_logits.shape[1] != E:
        raise ValueError(f"router_logits must have shape [T, expert_num={E}], got {router_logits.shape}")
    bias = _check_bias(correction_bias, E)
    T = router_logits.shape[0]
    if T == 0:
        return np.empty((0, k), np.int64), np.empty((0, k), np.float32)

    logits = router_logits.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = _softmax(logits) if cfg.scoring_func == "softmax" else _sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if cfg.n_group > 1:
            choice = _keep_best_groups(choice, cfg)
        topk_ids = _top_k(choice, k)
        topk_weights = np.take_along_axis(scores, topk_ids, axis=1)
        if cfg.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(axis=1, keepdims=True) + _RENORM_EPS)
        topk_weights = topk_weights * np.float32(cfg.routed_scaling_factor)
    topk_weights[np.isnan(scores).any(axis=1)] = np.nan
    return topk_ids.astype(np.int64), topk_weights.astype(np.float32, copy=False)


def _check_bias(correction_bias, E):
    if correction_bias is None:
        return None
    if not isinstance(correction_bias, np.ndarray) or correction_bias.dtype not in _BIAS_DTYPES:
        got = correction_bias.dtype if isinstance(correction_bias, np.ndarray) else type(correction_bias).__name__
        raise TypeError(f"correction_bias must be None or a numpy float array, got {got}")
    if correction_bias.shape != (E,):
        raise ValueError(f"correction_bias must have shape [expert_num={E}], got {correction_bias.shape}")
    bias = correction_bias.astype(np.float32)
    if not np.isfinite(bias).all():
        raise ValueError("correction_bias must be finite")
    return bias


def _softmax(logits):
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def _sigmoid(logits):
    return np.float32(1) / (np.float32(1) + np.exp(-logits))


def _top_k(values, k):
    # Stable sort of the negated values: largest first, ties to the lower index, NaN last.
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def _keep_best_groups(choice, cfg):
    """choice with every expert outside the topk_group best groups set to -inf."""
    T, E = choice.shape
    per_group = E // cfg.n_group
    grouped = choice.reshape(T, cfg.n_group, per_group)
    if cfg.scoring_func == "softmax":
        group_scores = grouped.max(axis=2)
    else:
        group_scores = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)   # a group of one: its score
    keep = np.zeros((T, cfg.n_group), dtype=bool)
    np.put_along_axis(keep, _top_k(group_scores, cfg.topk_group), True, axis=1)
    return np.where(np.repeat(keep, per_group, axis=1), choice, np.float32(-np.inf))
