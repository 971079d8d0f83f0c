"""route(): router logits -> (topk_ids, topk_weights), computed as the reference models compute them.

All arithmetic is float32, like most Hugging Face routers (softmax / sigmoid in float32 whatever the
logit dtype), so the weights agree with them to float32 rounding of exp and sums (~1e-7).  LFM2-MoE's
sigmoid and Mistral 4's softmax run in the logits' dtype: with bfloat16 logits their rounded scores can
pick another expert than these float32 ones (a helper's audit: 42 and 7 of 4096 tokens), where the
float32 choice is the one the scores' exact values make.
"""
import ml_dtypes
import numpy as np

from ._native import _ext
from ._torch import accepts_tensors
from .config import MoeConfig

_LOGIT_DTYPES = tuple(np.dtype(t) for t in (np.float32, ml_dtypes.bfloat16, np.float16))
_BIAS_DTYPES = _LOGIT_DTYPES + (np.dtype(np.float64),)
_SCORING = {"softmax": _ext.ktfp8_scoring.KTFP8_SOFTMAX, "sigmoid": _ext.ktfp8_scoring.KTFP8_SIGMOID}
_GROUP_SCORE = {"best": _ext.ktfp8_group_score.KTFP8_GROUP_BEST,
                "top2_sum": _ext.ktfp8_group_score.KTFP8_GROUP_TOP2_SUM}
_SCORING_GROUP_SCORE = {"softmax": "best", "sigmoid": "top2_sum"}   # group_score None: the scoring's rule


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
    stay eligible; a group's score is its best (biased) score or the sum of its two best (a group of one
    expert: its score), as cfg.group_score says; by default softmax takes the best (DeepSeek-V2
    group_limited_greedy) and sigmoid the two best (DeepSeek-V3 noaux_tc); Mistral 4 sums softmax's two
    best (group_score="top2_sum"). The k eligible experts with the highest (biased) score are chosen;
    weights are their unbiased scores, divided by their sum (+1e-20) when norm_topk_prob, times
    routed_scaling_factor.

    Each row lists its experts best first. Among equal scores the lower expert id wins; torch.topk
    picks some tied expert without saying which, so exact ties may pick other (equally weighted)
    experts than a transformers model. A row with a NaN score (a NaN logit; in softmax a +Inf logit, or
    every logit -Inf) gets NaN weights, so the NaN reaches the MoE output; its ids stay valid, distinct
    expert ids.  A single -Inf logit (a masked expert) scores 0, as in torch's softmax.
    transformers' Qwen-MoE routers round their weights to the logits' dtype (bfloat16 in a bfloat16
    model); these weights stay float32.
    """
    if not isinstance(cfg, MoeConfig):
        raise TypeError(f"cfg must be a ktfp8.MoeConfig, got {type(cfg).__name__}")
    E, k = cfg.expert_num, cfg.num_experts_per_tok
    if not isinstance(router_logits, np.ndarray) or router_logits.dtype not in _LOGIT_DTYPES:
        got = router_logits.dtype if isinstance(router_logits, np.ndarray) else type(router_logits).__name__
        raise TypeError(f"router_logits must be a numpy array or a torch tensor of float32, bfloat16 or "
                        f"float16, got {got}")
    if router_logits.ndim != 2 or router_logits.shape[1] != E:
        raise ValueError(f"router_logits must have shape [T, expert_num={E}], got {router_logits.shape}")
    bias = _check_bias(correction_bias, E)
    T = router_logits.shape[0]
    if T == 0:
        return np.empty((0, k), np.int64), np.empty((0, k), np.float32)

    topk_ids, topk_weights = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
    _ext.route(np.ascontiguousarray(router_logits, dtype=np.float32), bias, topk_ids, topk_weights,
               _SCORING[cfg.scoring_func], cfg.n_group, cfg.topk_group,
               _GROUP_SCORE[cfg.group_score or _SCORING_GROUP_SCORE[cfg.scoring_func]], cfg.norm_topk_prob,
               cfg.routed_scaling_factor)
    return topk_ids, topk_weights


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
