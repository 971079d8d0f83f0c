"""MoeConfig and QuantConfig: what one MoE layer is and how its experts are stored.

Both are checked when built and again on every attribute assignment, so a config that exists is a
valid one: `cfg.num_experts_per_tok = 99` on a 64-expert layer raises ValueError and leaves cfg as it was.
"""
import json
import math
import numbers
import os
from collections.abc import Mapping

import numpy as np

QUANT_METHODS = ("FP8", "BF16")
DEFAULT_BLOCK = 128              # block edge of block-wise FP8 when none is given (DeepSeek-V3's)
MAX_BLOCK_EDGE = 2**31 - 1
# sizes and expert counts: expert ids may arrive as int32, and the kernels' byte counts (experts x rows
# x K) must stay far from 64-bit overflow; no model comes near
MAX_SIZE = 2**31 - 1
# why every MoE kernel refuses an odd K block edge (and so QuantConfig and ktfp8.convert refuse it)
ODD_BLOCK_EDGE = ("the kernels read K two weights at a time (a BF16 pair per 32-bit lane), and a block "
                  "edge inside a pair would need two scales for one lane")
SCORING_FUNCS = ("softmax", "sigmoid")
# A group's score in grouped top-k: its best score, or the sum of its two best.  None: the scoring's own
# rule (softmax: best, DeepSeek-V2; sigmoid: the two best, DeepSeek-V3).  Mistral 4 sums softmax's two best.
GROUP_SCORES = ("best", "top2_sum")
# The gate's activation in act(gate) * up: SiLU (SwiGLU), or GELU with its tanh approximation (GeGLU:
# Gemma 4's experts), the two the kernels' epilogue computes (include/ktfp8/moe_epilogue.h)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# transformers' activation names (ACT2FN) of those same functions -> MoeConfig.hidden_act (each checked
# against transformers' module: tests/test_hf_activations.py)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
                  "gelu_python_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_pytorch_tanh",
                  "gelu_fast": "gelu_pytorch_tanh", "gelu_accurate": "gelu_pytorch_tanh"}


def max_threads():
    """The most threads a call may ask for: 16 per CPU the OS reports.  More only slow the kernels, and
    OpenMP ends the process (libgomp: "Thread creation failed", exit 1) when it cannot start a team,
    so a count such as threads=100000 is refused before any team starts."""
    return 16 * (os.cpu_count() or 1)


def check_threads(source, value):
    """`value` (an int >= 1) if it is at most max_threads(), else ValueError naming `source`."""
    if value > max_threads():
        raise ValueError(f"{source} must be at most {max_threads()} (16 per CPU of this machine's "
                         f"{os.cpu_count() or 1}), got {value}")
    return value


def _as_int(owner, name, value, minimum, maximum=None):
    # bool is an int subclass: `expert_num=True` is a mistake, not 1.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}.{name} must be at most {maximum}, got {value}")
    return value


def as_block(block, name="block"):
    """(block_out, block_in) from an int or a pair of ints, each in 1 .. MAX_BLOCK_EDGE (the kernels
    and the codec take the edges as C integers)."""
    pair = (block, block) if isinstance(block, numbers.Integral) else block
    try:
        bn, bk = pair
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a pair of ints (block_out, block_in), got {block!r}") from None
    for v in (bn, bk):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an int or a pair of ints (block_out, block_in), got {block!r}")
    if not (0 < bn <= MAX_BLOCK_EDGE and 0 < bk <= MAX_BLOCK_EDGE):
        raise ValueError(f"{name} sizes must be positive and at most {MAX_BLOCK_EDGE}, got {name}={block!r}")
    return int(bn), int(bk)


def _as_bool(owner, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _as_choice(owner, name, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


class QuantConfig:
    """How the expert weights are stored.

    method:      "FP8" (E4M3 codes + float32 scales) or "BF16".
    per_channel: FP8 scales: True = one scale per output row; False = block-wise, one scale per
                 group_size x group_size block (DeepSeek-V3 `weight_scale_inv`).
    group_size:  0 when per_channel; the block edge (even, > 0, default 128) when block-wise.

    per_channel and group_size state one fact twice (group_size 0 <=> per-channel), and KTransformers
    code sets them one at a time, so the order of assignment does not matter: a field you have not set
    follows the one you set (on a fresh config `per_channel = False` gives group_size 128 and
    `group_size = 64` gives per_channel False), while a value you did set is never changed behind your
    back: setting the other field against it raises ValueError, whichever comes first
    (`per_channel = True` and `group_size = 128`). To switch an explicitly set config to the other
    scale mode, assign both at once (`cfg.quant_config = {"method": "FP8", "per_channel": False,
    "group_size": 64}`) or first release group_size with `group_size = None` (it then follows the mode).
    """

    def __init__(self, method="FP8", per_channel=None, group_size=None):
        method = _as_choice("QuantConfig", "method", method, QUANT_METHODS)
        # the scale fields the caller chose (the others follow them); not part of equality
        chosen = frozenset(name for name, value in (("per_channel", per_channel), ("group_size", group_size))
                           if value is not None)
        if per_channel is not None:
            per_channel = _as_bool("QuantConfig", "per_channel", per_channel)
        if group_size is not None:
            group_size = _as_int("QuantConfig", "group_size", group_size, 0)
        if per_channel is None:                 # not given: follows group_size, per-channel by default
            per_channel = group_size is None or group_size == 0
        if group_size is None:
            group_size = 0 if per_channel else DEFAULT_BLOCK
        _check_scale_mode(per_channel, group_size)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "per_channel", per_channel)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "_chosen", chosen)

    def __setattr__(self, name, value):
        if name == "method":
            object.__setattr__(self, name, _as_choice("QuantConfig", "method", value, QUANT_METHODS))
        elif name == "per_channel":
            self._set_scale_mode("per_channel", _as_bool("QuantConfig", "per_channel", value))
        elif name == "group_size" and value is None:
            object.__setattr__(self, "group_size", 0 if self.per_channel else DEFAULT_BLOCK)
            object.__setattr__(self, "_chosen", self._chosen - {"group_size"})
        elif name == "group_size":
            self._set_scale_mode("group_size", _as_int("QuantConfig", "group_size", value, 0))
        else:
            raise AttributeError(f"QuantConfig has no field {name!r}; fields: method, per_channel, group_size")

    def _set_scale_mode(self, name, value):
        per_channel, group_size = (value, self.group_size) if name == "per_channel" else (self.per_channel, value)
        if per_channel != (group_size == 0):
            other = "group_size" if name == "per_channel" else "per_channel"
            if name == "per_channel":
                group_size = 0 if per_channel else DEFAULT_BLOCK
            else:
                per_channel = group_size == 0
            if other in self._chosen:
                wanted = {"method": self.method, "per_channel": per_channel, "group_size": group_size}
                raise ValueError(f"QuantConfig.{name} = {value!r} contradicts {other} = {getattr(self, other)!r} "
                                 f"set before (group_size 0 means per-channel); to change both, assign them at "
                                 f"once: cfg.quant_config = {wanted}")
        _check_scale_mode(per_channel, group_size)
        object.__setattr__(self, "per_channel", per_channel)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "_chosen", self._chosen | {name})

    def __eq__(self, other):
        if not isinstance(other, QuantConfig):
            return NotImplemented
        return (self.method, self.per_channel, self.group_size) == (other.method, other.per_channel, other.group_size)

    __hash__ = None  # mutable

    def __repr__(self):
        return f"QuantConfig(method={self.method!r}, per_channel={self.per_channel}, group_size={self.group_size})"


def _check_scale_mode(per_channel, group_size):
    if per_channel and group_size != 0:
        raise ValueError(f"QuantConfig.group_size must be 0 with per_channel=True (one scale per output row), "
                         f"got {group_size}; use per_channel=False for block-wise scales")
    if not per_channel and group_size <= 0:
        raise ValueError(f"QuantConfig.group_size must be > 0 (the block edge, e.g. {DEFAULT_BLOCK}) with "
                         f"per_channel=False, got {group_size}; use per_channel=True for per-channel scales")
    if group_size > MAX_BLOCK_EDGE:
        raise ValueError(f"QuantConfig.group_size must be at most {MAX_BLOCK_EDGE} (the kernels' block edges are "
                         f"32-bit), got {group_size}")
    if not per_channel and group_size % 2:
        raise ValueError(f"QuantConfig.group_size must be even, got {group_size}: {ODD_BLOCK_EDGE}")


_MOE_FIELDS = ("expert_num", "num_experts_per_tok", "hidden_size", "intermediate_size", "scoring_func",
               "norm_topk_prob", "n_group", "topk_group", "group_score", "routed_scaling_factor", "hidden_act",
               "swiglu_limit", "threads", "quant_config")


class MoeConfig:
    """One MoE layer: sizes, routing rule, activation, threads and weight format.

    expert_num, num_experts_per_tok (alias routed_expert_num), hidden_size, intermediate_size: the sizes.
    Routing (see ktfp8.routing.route): scoring_func "softmax" | "sigmoid"; norm_topk_prob renormalises
    the top-k weights; n_group / topk_group: grouped top-k keeps the topk_group best of n_group equal
    groups of experts (n_group = 1: no grouping); group_score: a group's score is its "best" score or
    the sum of its two best ("top2_sum"), None = the scoring's rule (softmax: best, sigmoid: top2_sum);
    routed_scaling_factor multiplies the final weights.
    hidden_act: the gate's activation, "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU with tanh GELU, Gemma
    4).  swiglu_limit: None, or L > 0 for the clamped SwiGLU of DeepSeek-V4 and GLM-5-Next,
    silu(min(gate, L)) * clamp(up, -L, L) (with either activation).
    threads: None = $KTFP8_NUM_THREADS, else $OMP_NUM_THREADS, else all cores (an explicit
    MoE(..., threads=) overrides it).
    quant_config: a QuantConfig (or a mapping of its fields); default FP8 per-channel.

    Every assignment is checked against the other fields and rejected (ValueError / TypeError, cfg
    unchanged) if the result would be invalid; so when shrinking, lower num_experts_per_tok before
    expert_num and topk_group before n_group.
    """

    def __init__(self, expert_num, num_experts_per_tok=None, hidden_size=None, intermediate_size=None, *,
                 scoring_func="softmax", norm_topk_prob=True, n_group=1, topk_group=1, group_score=None,
                 routed_scaling_factor=1.0, hidden_act="silu", swiglu_limit=None, threads=None, quant_config=None,
                 routed_expert_num=None):
        if routed_expert_num is not None:
            if num_experts_per_tok is not None and num_experts_per_tok != routed_expert_num:
                raise ValueError(f"MoeConfig: num_experts_per_tok={num_experts_per_tok!r} and its alias "
                                 f"routed_expert_num={routed_expert_num!r} disagree")
            num_experts_per_tok = routed_expert_num
        given = dict(expert_num=expert_num, num_experts_per_tok=num_experts_per_tok, hidden_size=hidden_size,
                     intermediate_size=intermediate_size)
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise TypeError(f"MoeConfig needs {', '.join(missing)}")
        values = {name: _check_moe_field(name, value) for name, value in dict(
            given, scoring_func=scoring_func, norm_topk_prob=norm_topk_prob, n_group=n_group,
            topk_group=topk_group, group_score=group_score, routed_scaling_factor=routed_scaling_factor,
            hidden_act=hidden_act, swiglu_limit=swiglu_limit, threads=threads,
            quant_config=QuantConfig() if quant_config is None else quant_config).items()}
        _check_moe_combination(values)
        for name in _MOE_FIELDS:
            object.__setattr__(self, name, values[name])

    @property
    def routed_expert_num(self):
        """KTransformers' name for num_experts_per_tok (experts chosen per token)."""
        return self.num_experts_per_tok

    def __setattr__(self, name, value):
        if name == "routed_expert_num":
            name = "num_experts_per_tok"
        if name not in _MOE_FIELDS:
            raise AttributeError(f"MoeConfig has no field {name!r}; fields: {', '.join(_MOE_FIELDS)}")
        value = _check_moe_field(name, value)
        _check_moe_combination(dict(vars(self), **{name: value}))
        object.__setattr__(self, name, value)

    def __eq__(self, other):
        if not isinstance(other, MoeConfig):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # mutable

    def __repr__(self):
        return "MoeConfig(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in _MOE_FIELDS) + ")"

    @classmethod
    def from_hf_config(cls, path_or_dict, **overrides):
        """MoeConfig from a Hugging Face config: a dict, a PretrainedConfig, a config.json path or a
        model folder holding one. Multimodal configs are read from their `text_config` (or
        `language_config`). `overrides` (threads=..., quant_config=...) replace or add constructor arguments.

        Qwen2-MoE / Qwen3-MoE: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob;
        softmax top-k. Mixtral: num_local_experts, intermediate_size; softmax top-k, always
        renormalised. DeepSeek-V2: n_routed_experts, softmax; topk_method "greedy" (no groups) or
        "group_limited_greedy" (n_group, topk_group; group score = best expert);
        routed_scaling_factor, norm_topk_prob. DeepSeek-V3: sigmoid, topk_method "noaux_tc" (group score
        = sum of the two best biased scores). Mistral 4 / Mistral Large 4: softmax, a group scored by the
        sum of its two best (group_score "top2_sum"). Ernie 4.5 (moe_num_experts, moe_k) and Hunyuan-A13B
        (moe_topk, per-layer lists of one value): softmax, always renormalised. A field the file leaves
        out takes the default of that family's reference code (e.g. DeepSeek-V3: norm_topk_prob True,
        routed_scaling_factor 2.5).
        GLM-4.5 (glm4_moe), MiniMax-M2, DeepSeek-V3.2 and the other _NOAUX_TC_FAMILIES route as DeepSeek-V3
        without saying so in config.json.  A model_type outside the families ktfp8 knows must name its
        routing (scoring_func or topk_method, in the file or as an override), else ValueError; a dict
        without model_type takes MoeConfig's defaults for what it leaves out.
        swiglu_limit: read for DeepSeek-V4, GLM-5-Next and HY-V4 (default 10); another family's config.json
        naming a SwiGLU clamp is refused unless swiglu_limit is given.  hidden_act (Gemma's
        hidden_activation): transformers' names of SiLU and of the tanh GELU (HF_ACTIVATIONS); another is
        refused unless hidden_act is given.
        Routers no MoeConfig describes are refused unless scoring_func is given (_UNDESCRIBED_ROUTERS): Gemma 4's,
        Diffusion Gemma's, Laguna's, Muse Spark's, Kolibri's, Phi-MoE's, LongCat-Flash's, Zaya's and DeepSeek-V4's;
        A.X-K2's with groups, Ernie 4.5's with a moe_norm_min above the released 1e-12.  Cohere2-MoE with shared
        experts averages them with the routed sum: its routed weights come halved (halve the shared experts' output
        too).
        Note: transformers' DeepseekV2 ignores norm_topk_prob while DeepSeek's own code honours it; every
        released V2 checkpoint sets it to false, where both agree.
        """
        # (KTransformers' name of the top-k stands for num_experts_per_tok)
        given = {"num_experts_per_tok" if name == "routed_expert_num" else name for name in overrides}
        fields = _fields_from_hf(_read_hf_config(path_or_dict), given=frozenset(given))
        fields.update(overrides)
        return cls(**fields)


MOEConfig = MoeConfig  # KTransformers' spelling


def _positive_float32(name, value, also=""):
    """MoeConfig.<name> as a float: a number (not a bool) that is finite and > 0 as a float32 too; `also`
    names what else the field takes ("None or "), in the messages."""
    if not _is_number(value):
        raise TypeError(f"MoeConfig.{name} must be {also}a number, got {type(value).__name__} {value!r}")
    try:
        with np.errstate(over="ignore"):
            as_float32 = np.float32(value)
        finite = math.isfinite(value)
    except OverflowError:       # an int past the largest float (10**400)
        as_float32, finite = np.float32(np.inf), False
    if not (finite and value > 0 and np.isfinite(as_float32) and as_float32 > 0):
        raise ValueError(f"MoeConfig.{name} must be {also}finite and > 0 in float32, got {value!r}")
    return float(value)


def _check_moe_field(name, value):
    if name in ("expert_num", "num_experts_per_tok", "hidden_size", "intermediate_size", "n_group", "topk_group"):
        return _as_int("MoeConfig", name, value, 1, MAX_SIZE)
    if name == "scoring_func":
        return _as_choice("MoeConfig", name, value, SCORING_FUNCS)
    if name == "hidden_act":
        return _as_choice("MoeConfig", name, value, HIDDEN_ACTS)
    if name == "group_score":
        return None if value is None else _as_choice("MoeConfig", name, value, GROUP_SCORES)
    if name == "norm_topk_prob":
        return _as_bool("MoeConfig", name, value)
    if name == "routed_scaling_factor":
        # route() multiplies in float32: a factor that is finite as a Python float but not as a
        # float32 (1e40 -> inf, 1e-50 -> 0) would make every weight inf or 0
        return _positive_float32(name, value)
    if name == "swiglu_limit":
        # the kernels clamp in float32: 1e-50 would clamp to 0
        return None if value is None else _positive_float32(name, value, "None or ")
    if name == "threads":
        return None if value is None else check_threads("MoeConfig.threads", _as_int("MoeConfig", name, value, 1))
    if name == "quant_config":
        return as_quant_config(value, "MoeConfig.quant_config")
    raise AssertionError(name)


def as_quant_config(value, name):
    """`value` if a QuantConfig, a QuantConfig of its fields if a mapping, else TypeError naming `name`."""
    if isinstance(value, QuantConfig):
        return value
    if isinstance(value, Mapping):
        return QuantConfig(**value)
    hint = " (a MoeConfig holds one: cfg.quant_config)" if isinstance(value, MoeConfig) else ""
    raise TypeError(f"{name} must be a QuantConfig or a mapping of its fields, got {type(value).__name__}{hint}")


def _check_moe_combination(v):
    E, k, G, g = v["expert_num"], v["num_experts_per_tok"], v["n_group"], v["topk_group"]
    if k > E:
        raise ValueError(f"MoeConfig.num_experts_per_tok ({k}) must be <= expert_num ({E})")
    if E % G:
        raise ValueError(f"MoeConfig.n_group ({G}) must divide expert_num ({E})")
    if g > G:
        raise ValueError(f"MoeConfig.topk_group ({g}) must be <= n_group ({G})")
    if g * (E // G) < k:
        raise ValueError(f"MoeConfig: grouped top-k keeps topk_group * expert_num / n_group = {g} * {E} / {G} "
                         f"= {g * (E // G)} experts, fewer than num_experts_per_tok ({k})")


# --- Hugging Face config.json -> MoeConfig fields -------------------------------------------------

_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")   # last: Ernie 4.5
# after the first: Ernie 4.5, Hunyuan-A13B, Gemma 4, Kimi Linear
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token")
# The width the routed experts compute at, first key set wins: NemotronH (moe_latent_size) and Muse Spark
# (moe_hidden_size) project x to the experts' own width.  Read by from_hf_config and by convert's checks.
_EXPERT_HIDDEN_KEYS = ("moe_latent_size", "moe_hidden_size", "hidden_size")
_EXPERT_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")

# Routing values each family's reference code uses when config.json leaves the field out.
_FAMILY_DEFAULTS = {
    "qwen2_moe": {"norm_topk_prob": False},
    "qwen3_moe": {"norm_topk_prob": False},
    "deepseek_v2": {"norm_topk_prob": False, "routed_scaling_factor": 1.0, "topk_method": "greedy"},
    "deepseek_v3": {"norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "topk_method": "noaux_tc"},
    "deepseek_v32": {"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
    "axk1": {"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
    "axk2": {"routed_scaling_factor": 2.5}, "exaone_moe": {"routed_scaling_factor": 2.5},
    "glm5_next_text": {"routed_scaling_factor": 2.5}, "glm_moe_dsa": {"routed_scaling_factor": 2.5},
    "glm4_moe_lite": {"routed_scaling_factor": 1.8}, "minicpm5_moe": {"routed_scaling_factor": 3.66},
    "hy_v4": {"routed_scaling_factor": 2.827}, "hy_v4_vl_text": {"routed_scaling_factor": 2.827},
    "hy_v3": {"routed_scaling_factor": 2.826},          # its config.json's router_scaling_factor
    "beam": {"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
    "flex_olmo": {"norm_topk_prob": False}, "olmoe": {"norm_topk_prob": False}, "dots1": {"norm_topk_prob": False},
    "kimi_linear": {"routed_scaling_factor": 2.446},
    "jamba": {"norm_topk_prob": False},                 # softmax top-k, never renormalised
    "qwen3_omni_moe_talker_text": {"norm_topk_prob": False},
    # DeepSeek-V2's router under a vision-language model: topk_method given, no norm_topk_prob, never renormalised
    "deepseek_ocr2_text": {"norm_topk_prob": False, "topk_method": "greedy"},
    "unlimited_ocr_text": {"norm_topk_prob": False, "topk_method": "greedy"},
    # Mistral 4 (Small 4) and Mistral Large 4: softmax scores, a group scored by its two best.
    "mistral4": {"group_score": "top2_sum"}, "mistral_large4_text": {"group_score": "top2_sum"},
}
# Families whose router is DeepSeek-V3's (sigmoid scores, a correction bias, group-limited top-k:
# topk_method "noaux_tc") although their config.json names no topk_method, and families that route by
# softmax top-k (Mistral 4's groups scored as _FAMILY_DEFAULTS says).  Each is checked against its
# transformers router (tests/test_routing.py).  Any other model_type must name its routing (scoring_func /
# topk_method, in config.json or as overrides): a guess would route silently wrong (GLM-4.5 read as
# softmax, for one).
# Dots 3 Note's published config.json holds its text model's fields at the top level, under model_type dots3_note.
_NOAUX_TC_FAMILIES = ("afmoe", "axk1", "axk2", "beam", "deepseek_v32", "dots1", "dots3_note", "dots3_note_text",
                      "exaone_moe", "flint", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "glm5_next_text",
                      "glm_moe_dsa", "hy_v3", "hy_v4", "hy_v4_vl_text", "kimi_linear", "lfm2_moe", "mimo_v2_flash",
                      "minicpm5_moe", "minimax_m2", "nemotron_h", "solar_open")
_SOFTMAX_FAMILIES = ("cohere2_moe", "ernie4_5_moe", "ernie4_5_vl_moe_text", "flex_olmo", "granitemoe",
                     "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "jamba", "lara_mini",
                     "mellum", "minimax", "mistral4", "mistral_large4_text", "mixtral", "olmoe", "qwen2_moe",
                     "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_omni_moe_talker_text",
                     "qwen3_omni_moe_text", "qwen3_vl_moe_text", "qwen4_exp_text")
for _family in _NOAUX_TC_FAMILIES:
    _FAMILY_DEFAULTS[_family] = {**_FAMILY_DEFAULTS.get(_family, {}), "topk_method": "noaux_tc"}
_KNOWN_FAMILIES = frozenset(_FAMILY_DEFAULTS) | frozenset(_SOFTMAX_FAMILIES)
# Families whose router has a step MoeConfig has no field for (transformers 5.25) -> (the config.json
# field whose value brings that step in, or None where it is always there; the test of that value; what
# the router then does)
_ALWAYS = (None, lambda value: True)
# Ernie 4.5's routers divide the top-k weights by max(their sum, moe_norm_min).  They choose by softmax
# probability plus a bias, so the chosen probabilities can sum to anything above 0: any moe_norm_min can act.
# The released 1e-12 acts only where the chosen k sum below 1e-12 (logits some 28 apart, the bias choosing
# the unlikely ones), and is read as route()'s division by the sum; a larger value is refused.
_NORM_MIN = ("moe_norm_min", lambda n: _is_number(n) and not n <= 1e-12,
             "divides its top-k weights by their sum clamped below at moe_norm_min, where route() divides by the sum")
_UNDESCRIBED_ROUTERS = {**{f: (*_ALWAYS, "routes by softmax top-k, renormalised, then times a learned per-expert "
                                         "scale (router.per_expert_scale, a checkpoint weight)")
                           for f in ("gemma4", "gemma4_text", "diffusion_gemma", "diffusion_gemma_text")},
                        "ernie4_5_moe": _NORM_MIN, "ernie4_5_vl_moe_text": _NORM_MIN,
                        **{f: (*_ALWAYS, "chooses its experts by logits + e_score_correction_bias (the bias added to "
                                         "the logits, not to the sigmoid scores as DeepSeek-V3 adds it), then weights "
                                         "them by the sigmoid of their logits")
                           for f in ("kolibri1", "kolibri1_1")},
                        "phimoe": (*_ALWAYS, "routes by sparsemixer: two experts whatever num_experts_per_tok, the "
                                             "best logit and the best of the rest, each weighted by a softmax over "
                                             "only the logits within 2 * router_jitter_noise (relative) of its pick"),
                        "longcat_flash": (*_ALWAYS, "routes by softmax over its n_routed_experts and zero_expert_num "
                                                    "(default 256) zero-computation experts, which add the token "
                                                    "itself times their weight instead of an expert's output"),
                        "zaya": (*_ALWAYS, "routes by softmax over its num_experts and a skip expert (chosen, it "
                                           "computes nothing), its logits from a router MLP carrying state from layer "
                                           "to layer"),
                        "deepseek_v4": (*_ALWAYS, "routes its first MoE layers ('hash_moe' in mlp_layer_types, "
                                                  "3 by default) by a fixed token id -> experts table, and scores "
                                                  "the logits by scoring_func, sqrt(softplus(x)) by default"),
                        "laguna": (*_ALWAYS, "routes as DeepSeek-V3 without groups, but its logits soft-capped "
                                             "when moe_router_logit_softcapping > 0 and the experts' sum times "
                                             "moe_routed_scaling_factor"),
                        "muse_spark_text": (*_ALWAYS, "routes by the sigmoid of its logits times output_multiplier, "
                                                      "which the router applies to the logits it returns"),
                        "axk2": ("n_group", lambda n: _is_number(n) and n > 1,
                                 "keeps its best groups by masking the others' experts with 0, not -inf, so an "
                                 "expert outside them can win where a kept one's biased score is below 0")}
# Routers that renormalise whatever config.json says (their config classes have no norm_topk_prob, or
# their routers do not read it); Cohere2-MoE's softmax one too (`expert_selection_fn`, below)
# (Granite's softmax over the top-k logits is the top-k of the softmax, renormalised)
_ALWAYS_RENORMALISED = ("afmoe", "ernie4_5_moe", "ernie4_5_vl_moe_text", "granitemoe", "granitemoe_swa",
                        "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "minimax", "minimax_m2",
                        "mistral_large4_text", "mixtral", "qwen3_5_moe_text", "qwen3_vl_moe_text")
_DEEPSEEK_V2_ROUTERS = ("deepseek_v2", "deepseek_ocr2_text", "unlimited_ocr_text")   # softmax, topk_method given
# config.json keys a family's router does not read (its config class has no such field), which a
# config.json may carry all the same (fine-tunes copy DeepSeek's fields): the family's own value stands,
# as in its transformers router (each entry, read, changed ktfp8's routing away from that router's:
# tests/test_routing.py).  Cohere2-MoE reads its scoring as expert_selection_fn only.
_NOT_READ = {
    **{f: ("scoring_func", "routed_scaling_factor", "n_group", "topk_group", "topk_method")
       for f in _SOFTMAX_FAMILIES if f not in ("mistral4", "mistral_large4_text")},
    "mistral4": ("scoring_func",), "mistral_large4_text": ("scoring_func",),
    **{f: ("scoring_func",) for f in _DEEPSEEK_V2_ROUTERS},
    **{f: ("topk_method",) for f in (*_NOAUX_TC_FAMILIES, "deepseek_v3")},
}
for _family in ("afmoe", "flint", "minimax_m2"):     # AFMoE's scale is its route_scale, below
    _NOT_READ[_family] += ("routed_scaling_factor", "n_group", "topk_group")
_NOT_READ["lfm2_moe"] += ("n_group", "topk_group")
for _family in ("deepseek_ocr2_text", "unlimited_ocr_text", "jamba"):     # their routers never renormalise
    _NOT_READ[_family] += ("norm_topk_prob",)
_NOT_READ["hy_v3"] += ("routed_scaling_factor", "n_group", "topk_group")    # its router_scaling_factor is read
# Other names a family's config.json gives a field under, read for that family only (another family's router
# does not read them: a stray route_scale scaled a Qwen3-MoE's weights, a stray expert_selection_fn made a
# Mixtral's softmax sigmoid, a helper's audit) -> the names read, first found wins.  Where both names are
# read, the one its transformers config class keeps comes first: the attribute_map alias, applied after the
# dataclass field (Inkling-2's routed_scaling_factor over its route_scale, Kimi Linear's own names over the
# common ones).  And for any family, Gemma's name of the activation.
_FAMILY_KEY_ALIASES = {"cohere2_moe": {"scoring_func": ("expert_selection_fn",)},   # "softmax" (default), "sigmoid"
                       "inkling2_text": {"routed_scaling_factor": ("routed_scaling_factor", "route_scale")},
                       "afmoe": {"routed_scaling_factor": ("route_scale",)},
                       "hy_v3": {"routed_scaling_factor": ("router_scaling_factor",)},
                       "kimi_linear": {"norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
                                       "n_group": ("num_expert_group", "n_group"),
                                       "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok")}}
_KEY_ALIASES = {"hidden_act": ("hidden_activation",)}
_TOPK_METHOD_SCORING = {"group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}
# Families whose experts clamp their SwiGLU as MoeConfig.swiglu_limit does (gate at most L before silu, up
# within +-L; transformers 5.25's experts modules) -> L where config.json leaves swiglu_limit out.  Other
# clamps (after the activation, per layer, with an alpha: Bailing, Step-3.5, GPT-OSS, MiniMax-M3) are not
# computed: a config.json naming one is refused, a silently unclamped layer being a wrong one.
_SWIGLU_LIMIT_DEFAULTS = {"deepseek_v4": 10.0, "glm5_next_text": 10.0, "hy_v4": 10.0, "hy_v4_vl_text": 10.0}
_CLAMP_KEYS = ("swiglu_limit", "swiglu_limits", "swiglu_alpha", "expert_swiglu_limit_list")


def _read_hf_config(source):
    if hasattr(source, "to_dict") and callable(source.to_dict):   # a transformers PretrainedConfig
        source = source.to_dict()
    if isinstance(source, Mapping):
        config = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no Hugging Face config at {path!r} (expected a config.json file or a "
                                    f"model folder holding one)") from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:   # Recursion: nested too deep
            raise ValueError(f"{path!r} is not a readable JSON config: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path!r} holds a JSON {type(config).__name__}, expected an object")
    else:
        raise TypeError(f"path_or_dict must be a dict, a transformers config or a path, got {type(source).__name__}")
    if not any(key in config for key in _EXPERT_COUNT_KEYS):
        for key in ("text_config", "language_config"):
            if isinstance(config.get(key), Mapping):
                return dict(config[key])
    return config


def _one_value(value):
    """A config.json size as one layer sees it: a per-layer list holding one value (Hunyuan-A13B's moe_topk,
    moe_intermediate_size) is that value; any other value, an empty or mixed list too, stays as it is."""
    if isinstance(value, (list, tuple)) and value and all(v == value[0] for v in value):
        return value[0]
    return value


def _is_number(value):
    """A real number that is not a bool (JSON true is a Python bool; NumPy's bool_ is no numbers.Real)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _routed_sum_scale(config, family):
    """What a family's block multiplies the routed experts' sum by after them, beyond routed_scaling_factor:
    Cohere2-MoE with shared experts averages the two sums by default (shared_expert_combination_strategy
    "average"), so its routed weights are halved here, and its shared experts' output must be halved too."""
    shared = config.get("num_shared_experts")
    if family == "cohere2_moe" and _is_number(shared) and shared > 0 and \
            config.get("shared_expert_combination_strategy", "average") == "average":
        return 0.5
    return 1.0


def _hidden_act(name):
    """MoeConfig.hidden_act of a config.json activation name (transformers' ACT2FN key)."""
    if isinstance(name, str) and name in HF_ACTIVATIONS:
        return HF_ACTIVATIONS[name]
    raise ValueError(f"Hugging Face config: hidden_act {name!r} is not an activation ktfp8 computes; "
                     f"known: {', '.join(map(repr, HF_ACTIVATIONS))}")


def _swiglu_limit(config, family):
    """MoeConfig.swiglu_limit of a config.json dict (see _SWIGLU_LIMIT_DEFAULTS)."""
    if family in _SWIGLU_LIMIT_DEFAULTS:
        limit = config.get("swiglu_limit")
        return _SWIGLU_LIMIT_DEFAULTS[family] if limit is None else limit

    def sets_clamp(value):      # None, 0 and lists of them (Bailing's per-layer list) clamp nothing
        if isinstance(value, (list, tuple)):
            return any(sets_clamp(v) for v in value)
        return value is not None and value != 0

    clamp = next((key for key in _CLAMP_KEYS if sets_clamp(config.get(key))), None)
    if clamp is not None:
        raise ValueError(f"Hugging Face config (model_type {family!r}) sets {clamp} = {config[clamp]!r}: its experts "
                         f"clamp their SwiGLU, which ktfp8 computes only as DeepSeek-V4 does, silu(min(gate, L)) * "
                         f"clamp(up, -L, L); if this model's experts compute exactly that, pass swiglu_limit=L")
    return None


def _fields_from_hf(config, given=frozenset()):
    """MoeConfig fields of a config.json dict, but for those in `given` (the caller passes them itself:
    config.json's value is not read, nor refused; scoring_func given stands for the whole routing)."""
    routing_given = "scoring_func" in given
    family = config.get("model_type")
    if family is not None and not isinstance(family, str):
        raise ValueError(f"Hugging Face config: model_type must be a string, got {type(family).__name__} {family!r}")
    defaults = _FAMILY_DEFAULTS.get(family, {})
    key, applies, what = _UNDESCRIBED_ROUTERS.get(family, (None, lambda value: False, ""))
    if not routing_given and applies(config.get(key)):
        setting = f" with {key} = {config[key]!r}" if config.get(key) is not None else ""
        raise ValueError(f"Hugging Face config: model_type {family!r}{setting} {what}, which no MoeConfig routing "
                         f"describes: route with that model's router and call the MoE with its topk_ids / "
                         f"topk_weights (ktfp8.hf does so inside transformers); for a MoeConfig to call it that way, "
                         f"pass scoring_func=... (its routing fields then go unused)")
    names_routing = any(config.get(key) is not None for key in ("scoring_func", "topk_method"))
    if family is not None and family not in _KNOWN_FAMILIES and not (names_routing or routing_given):
        raise ValueError(f"Hugging Face config: model_type {family!r} names no scoring_func or topk_method, "
                         f"and ktfp8 does not know how that family routes; give its routing: "
                         f"MoeConfig.from_hf_config(..., scoring_func='softmax' or 'sigmoid', norm_topk_prob=..., "
                         f"n_group=..., topk_group=..., routed_scaling_factor=...)")

    def get(key, default=None):
        names = _FAMILY_KEY_ALIASES.get(family, {}).get(key) or (() if key in _NOT_READ.get(family, ()) else (key,))
        keys = (*names, *_KEY_ALIASES.get(key, ()))
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        return defaults.get(key, default) if value is None else value

    def need(field, keys):
        """The first of the family's own names of `field` (_FAMILY_KEY_ALIASES) and `keys` that config.json
        sets; a per-layer list (Hunyuan-A13B's moe_topk) must hold one value, as MoeConfig describes one
        layer (or the caller gives the field)."""
        if field in given:
            return None
        keys = tuple(dict.fromkeys((*_FAMILY_KEY_ALIASES.get(family, {}).get(field, ()), *keys)))
        for key in keys:
            value = _one_value(config.get(key))
            if isinstance(value, (list, tuple)) and family == "ernie4_5_vl_moe_text" and key == "moe_intermediate_size":
                raise ValueError(f"Hugging Face config (model_type {family!r}): {key} is {value}, its text "
                                 f"experts' and its vision experts' widths; a MoeConfig is one set of experts: pass "
                                 f"{field}={value[0]} (text) or {field}={value[1]} (vision)")
            if isinstance(value, (list, tuple)):
                raise ValueError(f"Hugging Face config (model_type {family!r}): {key} is {value}, not one value "
                                 f"for every layer; a MoeConfig is one layer: pass that layer's {field}=...")
            if value is not None:
                return value
        raise ValueError(f"Hugging Face config (model_type {family!r}) has no {' / '.join(keys)} field")

    topk_method = get("topk_method")
    if family in _DEEPSEEK_V2_ROUTERS and topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"Hugging Face config: model_type {family!r} routes by topk_method 'greedy' or "
                         f"'group_limited_greedy' (DeepSeek-V2's softmax router), got {topk_method!r}")
    scoring_func = get("scoring_func", _TOPK_METHOD_SCORING.get(topk_method, "softmax"))
    n_group, topk_group = get("n_group", 1), get("topk_group", 1)
    if topk_method == "greedy":
        n_group = topk_group = 1
    elif topk_method in _TOPK_METHOD_SCORING:
        if scoring_func != _TOPK_METHOD_SCORING[topk_method]:
            raise ValueError(f"Hugging Face config: topk_method {topk_method!r} needs scoring_func "
                             f"{_TOPK_METHOD_SCORING[topk_method]!r}, got {scoring_func!r}")
    elif topk_method is not None:
        raise ValueError(f"Hugging Face config: unsupported topk_method {topk_method!r} "
                         f"(known: greedy, group_limited_greedy, noaux_tc)")
    renormalised = family in _ALWAYS_RENORMALISED or (family == "cohere2_moe" and scoring_func == "softmax")
    # DeepSeek-V2's topk_methods come with its default, no renormalisation; every other router's is to
    renormalises_by_default = topk_method not in ("greedy", "group_limited_greedy")
    norm_topk_prob = True if renormalised else get("norm_topk_prob", renormalises_by_default)
    return dict(
        expert_num=need("expert_num", _EXPERT_COUNT_KEYS),
        num_experts_per_tok=need("num_experts_per_tok", _TOP_K_KEYS),
        hidden_size=need("hidden_size", _EXPERT_HIDDEN_KEYS),
        intermediate_size=need("intermediate_size", _EXPERT_INTERMEDIATE_KEYS),
        scoring_func=scoring_func, norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
        group_score=defaults.get("group_score"),
        routed_scaling_factor=None if "routed_scaling_factor" in given else
        get("routed_scaling_factor", 1.0) * _routed_sum_scale(config, family),
        hidden_act=None if "hidden_act" in given else _hidden_act(get("hidden_act", "silu")),
        swiglu_limit=None if "swiglu_limit" in given else _swiglu_limit(config, family))
