"""The "ktfp8" experts implementations of transformers: which experts modules they take, how a module's
weights become a ktfp8 layer (once), and the forward function transformers dispatches to.

transformers 5 keeps a MoE block's routed experts in one module (fused `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I], HF Linear layout) called as experts(hidden_states, top_k_index, top_k_weights)
after its own router: exactly what ktfp8.MoE computes, so routing stays in transformers."""
import copy
import functools
import math
import threading
import warnings

import torch

from ..backends import requested_threads
from ..config import HIDDEN_ACTS, MoeConfig, QuantConfig
from ..experts import quantize_experts
from . import op
from .layer import build_layer, check_activation_dtype, local_experts

# transformers experts classes whose layout the kernels compute (act(gate) * up, no bias), act one of
# MoeConfig's HIDDEN_ACTS (activation_of tells which)
SUPPORTED_EXPERTS = {"Qwen2MoeExperts": "qwen2_moe", "Qwen3MoeExperts": "qwen3_moe",
                     "DeepseekV2Experts": "deepseek_v2", "DeepseekV3Experts": "deepseek_v3",
                     "MixtralExperts": "mixtral", "OlmoeExperts": "olmoe", "Glm4MoeExperts": "glm4_moe",
                     "MiniMaxM2Experts": "minimax_m2", "Glm4MoeLiteExperts": "glm4_moe_lite",
                     "DeepseekV32Experts": "deepseek_v32", "MiniMaxExperts": "minimax",
                     "Qwen3NextExperts": "qwen3_next", "Qwen3_5MoeExperts": "qwen3_5_moe_text",
                     "Qwen3VLMoeTextExperts": "qwen3_vl_moe_text", "Mistral4Experts": "mistral4",
                     "Ernie4_5_MoeExperts": "ernie4_5_moe", "HunYuanMoEV1Experts": "hunyuan_v1_moe",
                     # the same experts code as those above, under other names (transformers 5.25's source;
                     # tests/test_hf_families.py builds each family from its own config class)
                     "AfmoeExperts": "afmoe", "AXK1Experts": "axk1", "BeamExperts": "beam",
                     "Cohere2MoeExperts": "cohere2_moe", "Dots1Experts": "dots1", "ExaoneMoeExperts": "exaone_moe",
                     "FlexOlmoExperts": "flex_olmo", "FlintExperts": "flint", "GraniteMoeExperts": "granitemoe",
                     "GraniteMoeSWAExperts": "granitemoe_swa", "GraniteMoeSharedExperts": "granitemoeshared",
                     "HYV3Experts": "hy_v3", "JambaExperts": "jamba", "KimiLinearExperts": "kimi_linear",
                     "Kolibri1Experts": "kolibri1", "LagunaExperts": "laguna", "LaraMiniExperts": "lara_mini",
                     "LongcatFlashExperts": "longcat_flash", "MellumExperts": "mellum",
                     "MiMoV2FlashExperts": "mimo_v2_flash", "MiniCPM5MoeExperts": "minicpm5_moe",
                     "PhimoeExperts": "phimoe", "Lfm2MoeExperts": "lfm2_moe", "SolarOpenExperts": "solar_open",
                     "ZayaExperts": "zaya", "AXK2Experts": "axk2", "Dots3NoteExperts": "dots3_note",
                     "GlmMoeDsaExperts": "glm_moe_dsa", "GraniteMoeHybridExperts": "granitemoehybrid",
                     "Kolibri1_1Experts": "kolibri1_1",
                     # (the text models of vision-language or speech models: each checked alone)
                     "DeepseekOcr2TextExperts": "deepseek_ocr2_text",
                     "Ernie4_5_VLMoeMoeExperts": "ernie4_5_vl_moe_text", "Glm4vMoeTextExperts": "glm4v_moe_text",
                     "MistralLarge4TextExperts": "mistral_large4_text",
                     "Qwen3OmniMoeThinkerTextExperts": "qwen3_omni_moe_text",
                     "Qwen3OmniMoeTalkerTextExperts": "qwen3_omni_moe_talker_text",
                     "Qwen4ExpTextExperts": "qwen4_exp_text", "UnlimitedOcrTextExperts": "unlimited_ocr_text",
                     # a clamped SwiGLU, silu(min(gate, L)) * clamp(up, -L, L): MoeConfig.swiglu_limit
                     "DeepseekV4Experts": "deepseek_v4", "Glm5NextTextExperts": "glm5_next_text",
                     "HYV4Experts": "hy_v4", "HYV4VLExperts": "hy_v4_vl_text",
                     # GeGLU, gelu_tanh(gate) * up: MoeConfig.hidden_act "gelu_pytorch_tanh"
                     "Gemma4TextExperts": "gemma4_text", "DiffusionGemmaTextExperts": "diffusion_gemma_text"}
# those experts classes -> the attribute holding their L (None: no clamp)
SWIGLU_LIMIT_ATTRS = {"DeepseekV4Experts": "limit", "Glm5NextTextExperts": "swiglu_limit",
                      "HYV4Experts": "swiglu_limit", "HYV4VLExperts": "swiglu_limit"}
# those experts classes that call F.silu in their forward rather than an act_fn attribute
SILU_INLINE = ("Glm5NextTextExperts", "HYV4Experts", "HYV4VLExperts")
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_EXPERTS.values())

# experts_implementation name -> how the weights are held
IMPLEMENTATIONS = {"ktfp8": lambda: QuantConfig("FP8", per_channel=True),
                   "ktfp8_block": lambda: QuantConfig("FP8", per_channel=False, group_size=128),
                   "ktfp8_bf16": lambda: QuantConfig("BF16")}
RELEASED = ("gate_up_proj", "down_proj")


def is_experts_module(module):
    """A module transformers' @use_experts_implementation made dispatchable (it sets these flags)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_concatenated", "gate_up_proj", "down_proj"))


def _unsupported(what):
    return ValueError(f"ktfp8 experts implementation: {what} is not supported; supported model types: "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def check_model_type(config):
    """Raises ValueError unless the model, or the text model of a multimodal one (where its experts are:
    model_type "qwen3_5_moe" holds a "qwen3_5_moe_text" text_config), is of a supported type."""
    model_type = getattr(config, "model_type", None)
    get_text_config = getattr(config, "get_text_config", None)
    text_type = getattr(get_text_config(), "model_type", None) if callable(get_text_config) else None
    if model_type not in SUPPORTED_MODEL_TYPES and text_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(f"model type {model_type!r}")


def check_supported(module):
    """Raises ValueError naming the module's class when ktfp8 cannot run it."""
    name = type(module).__name__
    if name not in SUPPORTED_EXPERTS:
        raise _unsupported(f"{name} (model type {getattr(module.config, 'model_type', None)!r})")
    layout = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                  has_post_expert_norm=False, _is_expert_parallel=False)
    problems = [f"{k}={getattr(module, k)}" for k, v in layout.items() if getattr(module, k, v) != v]
    if activation_of(module) is None:
        config = module.config
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        problems.append(f"hidden_act={act!r} (the kernels compute {' or '.join(HIDDEN_ACTS)})")
    if problems:
        raise _unsupported(f"{name} with {', '.join(problems)}")


def _reference_activations(x):
    """HIDDEN_ACTS name -> that activation of float64 `x`, written from its definition."""
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    return {"silu": x * torch.sigmoid(x), "gelu_pytorch_tanh": 0.5 * x * (1 + torch.tanh(inner))}


def activation_of(module):
    """The HIDDEN_ACTS name of the function `module` applies to its gate, or None where it is none of
    them: read off its act_fn's values (a config's activation name says what ACT2FN built, not what the
    forward calls: LFM2-MoE's act_fn is F.silu whatever the config says), SiLU where the class calls
    F.silu itself (SILU_INLINE)."""
    name = type(module).__name__
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None:
        return "silu" if name in SILU_INLINE else None
    x = torch.linspace(-12, 12, 481, dtype=torch.float64)
    with torch.no_grad():
        try:
            got = act_fn(x.clone())      # (an in-place activation would change x)
            if not isinstance(got, torch.Tensor) or got.shape != x.shape:
                return None
            got = got.to(torch.float64)
        except Exception:  # an activation that refuses float64 (or another odd one) is none of these
            return None
    return next((act for act, want in _reference_activations(x).items()
                 if torch.allclose(got, want, rtol=1e-6, atol=1e-12)), None)


def _refuse_other_implementations(module, args):
    """Forward pre-hook of a module whose experts ktfp8 holds: any other experts implementation (eager,
    batched_mm, grouped_mm, ...) would index the released empty weights and fail with an IndexError that
    names nothing.  transformers' set_experts_implementation offers no hook, so the forward says it."""
    name = module.config._experts_implementation
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"ktfp8 experts implementation: {type(module).__name__} is set to run as {name!r}, but "
                         f"ktfp8 released its transformers expert weights ({', '.join(RELEASED)}) when it took "
                         f"the experts ({describe(module._ktfp8_quant_config)}), so this model cannot switch back "
                         f"to another experts implementation; reload the model to use {name!r}")


def attach(module, layer, quant_config, source=None):
    """Makes `module` run `layer` (a callable over CPU tensors holding the experts as `quant_config`
    says) and releases its transformers weights (replaced by empty tensors: the memory goes back once
    nothing else holds them).  source: the FP8 folder the experts were read from, if any."""
    claim = op.register(layer)
    module._ktfp8_claim = claim                   # the layer stays registered while the module (or a copy) lives
    module._ktfp8_handle = claim.handle
    module._ktfp8_quant_config = copy.copy(quant_config)      # the caller's object may change later
    module._ktfp8_source = source
    for name in RELEASED:
        setattr(module, name, empty_parameter(getattr(module, name).dtype))
    module.register_forward_pre_hook(_refuse_other_implementations)
    module._register_state_dict_hook(_warn_experts_are_empty)


def empty_parameter(dtype):
    """The (0,) parameter that stands for a released expert weight.  Made outside inference mode, which
    a first call under torch.inference_mode() would otherwise give it: an inference tensor then refuses
    requires_grad_(True) and load_state_dict's copy outside that mode."""
    with torch.inference_mode(False):
        return torch.nn.Parameter(torch.empty(0, dtype=dtype, device="cpu"), requires_grad=False)


EMPTY_IN_STATE_DICT = ("state_dict(): ktfp8 holds the routed experts of this model packed for this CPU and "
                       "released their transformers weights, so its gate_up_proj / down_proj entries are empty "
                       "(0,) tensors, not the weights; for an FP8 checkpoint of the model, use the folder "
                       "python -m ktfp8.convert writes (save_pretrained refuses for the same reason)")


def _warn_experts_are_empty(module, state_dict, prefix, local_metadata):
    """state_dict hook of a module whose experts ktfp8 holds: the dict is still made (other code reads
    the rest of it), but torch.save(model.state_dict()) must not pass for a checkpoint unsaid.  Once per
    state_dict() call: every held module of the model shares that call's dict, and only the first one
    to fill it finds no other's released entries there (a flag on the dict would fail on the plain dict
    a caller may pass as destination=)."""
    own = {prefix + name for name in RELEASED}
    if not any(key.endswith(RELEASED) and key not in own and not value.numel() for key, value in state_dict.items()):
        warnings.warn(EMPTY_IN_STATE_DICT, RuntimeWarning, stacklevel=2)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def layer_top_k(module, block):
    """How many experts the router of `module`'s MoE block (`block`, which holds it) picks per token: its
    gate's top_k, as every supported family's router has one (Hunyuan's takes moe_topk[layer_idx] where
    config.json gives a per-layer list), else config.num_experts_per_tok (Gemma 4: top_k_experts) when
    that is one int."""
    top_k = getattr(getattr(block, "gate", None), "top_k", None)
    if top_k is None:
        config = module.config
        top_k = next((getattr(config, k) for k in ("num_experts_per_tok", "top_k_experts")
                      if getattr(config, k, None) is not None), None)
    if not _is_int(top_k):
        raise ValueError(f"ktfp8 experts implementation: cannot tell how many experts the router of "
                         f"{type(module).__name__} picks per token: its block {type(block).__name__} has no "
                         f"gate.top_k and the config's num_experts_per_tok / top_k_experts is {top_k!r}, "
                         f"not one int")
    return top_k


def layer_config(module, quant_config, top_k, threads=None):
    """ktfp8.MoeConfig of one experts module whose router picks `top_k` experts a token (layer_top_k;
    a per-layer value where the config has a list; routing fields unused: transformers routes)."""
    limit_attr = SWIGLU_LIMIT_ATTRS.get(type(module).__name__)
    return MoeConfig(expert_num=module.num_experts, num_experts_per_tok=top_k,
                     hidden_size=module.hidden_dim, intermediate_size=module.intermediate_dim,
                     hidden_act=activation_of(module), swiglu_limit=getattr(module, limit_attr) if limit_attr else None,
                     threads=threads, quant_config=quant_config)


def experts_modules(model):
    """[(name, experts module, the block holding it)] of every dispatchable experts module of `model`."""
    return [(f"{name}.{child_name}" if name else child_name, child, block)
            for name, block in model.named_modules() for child_name, child in block.named_children()
            if is_experts_module(child)]


def _check_weight(t, name):
    if t.device.type != "cpu":
        raise ValueError(f"ktfp8 experts: {name} is on {t.device}; ktfp8 runs on the CPU "
                         f"(load the model without device_map / .to('cuda'))")
    return t.detach()


# Taken while a module's experts are quantized: a model called from several Python threads before its
# first forward would otherwise quantize a layer once per thread, each attach freeing the layer another
# thread was about to run ("no layer registered under handle").
_PREPARING = threading.Lock()


def prepare_module(module, quant_config, top_k, threads=None):
    """Quantizes one experts module's weights as `quant_config` says, once; when already done, only
    sets its layer's thread count to `threads` (unless None).  top_k: experts its router picks a token
    (layer_top_k)."""
    with _PREPARING:
        if getattr(module, "_ktfp8_handle", None) is not None:
            if threads is not None:
                op.layer_of(module._ktfp8_handle).threads = threads
            return
        check_supported(module)
        inter = module.intermediate_dim
        gate_up = _check_weight(module.gate_up_proj, "gate_up_proj")
        down = _check_weight(module.down_proj, "down_proj")
        experts = quantize_experts(gate_up[:, :inter], gate_up[:, inter:], down, quant_config,
                                   experts=local_experts(module.num_experts))
        layer = build_layer(layer_config(module, quant_config, top_k, threads), experts, threads=threads)
        attach(module, layer, quant_config)


def _quant_config(spec):
    if spec is None:
        return IMPLEMENTATIONS["ktfp8"]()
    if isinstance(spec, QuantConfig):
        return spec
    if isinstance(spec, str) and spec in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[spec]()
    raise ValueError(f"quant_config must be a ktfp8.QuantConfig or one of {sorted(IMPLEMENTATIONS)}, got {spec!r}")


def implementation_name(quant_config):
    """The experts_implementation name that holds weights as `quant_config` says."""
    if quant_config.method == "BF16":
        return "ktfp8_bf16"
    return "ktfp8" if quant_config.per_channel else "ktfp8_block"


def describe(quant_config):
    """How `quant_config` holds the experts, in words."""
    if quant_config.method == "BF16":
        return "BF16"
    if quant_config.per_channel:
        return "FP8 per-channel"
    return f"FP8 block-wise {quant_config.group_size} x {quant_config.group_size}"


def check_held_as(module, wanted):
    """Raises ValueError when `module`'s experts are already quantized otherwise than `wanted`: a
    ktfp8.QuantConfig (exactly) or an implementation name (its format, whatever the block edge)."""
    held = getattr(module, "_ktfp8_quant_config", None)
    if held is None:
        return
    if isinstance(wanted, QuantConfig):
        same, asked = held == wanted, describe(wanted)
    else:
        same, asked = implementation_name(held) == wanted, repr(wanted)
    if not same:
        raise ValueError(f"ktfp8 experts implementation: the experts of {type(module).__name__} are already "
                         f"quantized as {describe(held)} ({implementation_name(held)!r}), which cannot change to "
                         f"{asked}; reload the model to choose another format")


def prepare(model, quant_config=None, *, threads=None):
    """Converts every routed-experts block of a transformers `model` now (instead of at its first call)
    and switches the model to the matching "ktfp8" experts implementation; returns the model.

    quant_config: a ktfp8.QuantConfig (e.g. block-wise with group_size=64) or an implementation name
    ("ktfp8", "ktfp8_block", "ktfp8_bf16"); default: the model's ktfp8 implementation, else "ktfp8".
    threads: kernel threads of these layers (default: KTFP8_NUM_THREADS, OMP_NUM_THREADS, all cores); on
    layers already prepared (ktfp8.hf.from_pretrained's, an earlier prepare), their new thread count.
    Experts already quantized in another format raise ValueError: the format is chosen once."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if threads is not None:
        requested_threads(threads)    # refused before anything changes, prepared layers or not
    check_model_type(model.config)
    check_activation_dtype(model.dtype)
    spec = quant_config
    if spec is None and getattr(model.config, "_experts_implementation", None) in IMPLEMENTATIONS:
        spec = model.config._experts_implementation
    quant_config = _quant_config(spec)
    wanted = quant_config if isinstance(spec, QuantConfig) else implementation_name(quant_config)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module that transformers' experts_implementation "
                         f"dispatches")
    top_ks = []
    for _, m, block in modules:
        check_supported(m)
        check_held_as(m, wanted)
        top_ks.append(layer_top_k(m, block))
    try:
        for (name, m, _), top_k in zip(modules, top_ks):
            try:
                prepare_module(m, quant_config, top_k, threads)
            except ValueError as err:
                if type(err) is not ValueError:
                    raise
                raise ValueError(f"{name}: {err}") from None    # which layer holds the weight it names
    finally:
        # the layers quantized before an error released their weights: they run on ktfp8 (and the model's
        # next forward meets the same error at the layer that raised it, not an unusable model)
        if any(getattr(m, "_ktfp8_handle", None) is not None for _, m, _ in modules):
            name = implementation_name(quant_config)
            model.set_experts_implementation(name)
            # a module built from its own copy of a config (Dots3-Note's vision experts take
            # config.per_layer_config[i], copied when the model was made) keeps its old implementation,
            # which would index its released weights
            for _, m, _ in modules:
                m.config._experts_implementation = name
    return model


# What _plain_eager asks torch: private functions, so where one is missing every call takes the op.
_FUNCTORCH_LEVEL = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTION_MODES = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _plain_eager():
    """Whether nothing of torch's stands between a call and its tensors: no functorch transform (vmap,
    jvp, functionalize: their wrappers look like plain CPU tensors but hold no data of their own), no
    dispatch mode (make_fx, FakeTensorMode), no function mode, no profiler (which names the op)."""
    if _FUNCTORCH_LEVEL is None or _DISPATCH_MODES is None or _FUNCTION_MODES is None:
        return False
    return (_FUNCTORCH_LEVEL() is None and _DISPATCH_MODES() == 0 and not _FUNCTION_MODES()
            and not getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


def _needs_the_op(hidden_states, top_k_weights):
    """Whether a call goes through the custom op ktfp8::moe rather than straight to the layer:
    - for anything but a plain CPU tensor: meta and fake tensors get their shape from the op's fake
      implementation, other devices the layer's own copy or refusal;
    - whenever torch transforms, traces or watches the call (torch.compile, torch.jit.trace, make_fx,
      vmap, functionalize, dispatch and function modes, the profiler): the op is what they can record
      and unwrap (jit.trace and make_fx would turn the layer's NumPy result into a constant; a
      functorch wrapper's memory is not its values);
    - when a gradient may flow through it: the op, which has no autograd formula, then refuses the
      backward by name, where the layer's tensor would drop that part of the gradient silently.
    Eager inference (generate, no_grad, inference_mode) calls the layer: the op's dispatch took 7-15 us
    of an experts call on a tiny layer (Zen 4 VM, 1 thread: 50 us against 34 with 64 experts;
    bench_call_overhead.py's median 37.5-38.3 against 30.4-30.9 with 8), a fixed cost per layer and
    token."""
    if type(hidden_states) is not torch.Tensor or not hidden_states.is_cpu:
        return True
    if not _plain_eager() or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad)


_FORWARD_AD = torch.autograd.forward_ad


def _refuse_tangents(module, *tensors):
    """Raises NotImplementedError where forward-mode AD (torch.autograd.forward_ad) carries a tangent
    on one of `tensors`: the kernels compute none, and the result would lack the experts' share of the
    tangent without a word (reverse mode is refused by the op's missing autograd formula).  Outside a
    dual level this is one integer compare."""
    if getattr(_FORWARD_AD, "_current_level", -1) < 0:
        return
    if any(isinstance(t, torch.Tensor) and _FORWARD_AD.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"ktfp8 experts implementation: forward-mode AD (torch.autograd.forward_ad) "
                                  f"through {type(module).__name__} is not supported: the ktfp8 kernels compute "
                                  f"no tangent; load the model with experts_implementation=\"eager\" for it")


def _forward_for(name):
    @torch.compiler.disable
    def first_call(module, dtype, top_k_shape):
        check_activation_dtype(dtype)
        if len(top_k_shape) != 2:
            raise ValueError(f"ktfp8 experts implementation: {type(module).__name__} got top_k_index of shape "
                             f"{tuple(top_k_shape)}, expected [tokens, experts per token]")
        # the router's own width: the layer's top-k even where the config lists one per layer (Hunyuan)
        try:
            prepare_module(module, IMPLEMENTATIONS[name](), top_k_shape[1])
        except ValueError as err:
            if type(err) is not ValueError:
                raise
            # the module does not know its name in the model; prepare() walks the model and does
            raise ValueError(f"{type(module).__name__}, quantized at its first forward: {err} (ktfp8.hf.prepare"
                             f"(model) before the first forward names the layer)") from None
        return module._ktfp8_handle

    def ktfp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        _refuse_tangents(self, hidden_states, top_k_weights)
        handle = getattr(self, "_ktfp8_handle", None)
        if handle is None:
            handle = first_call(self, hidden_states.dtype, tuple(top_k_index.shape))
        else:
            check_held_as(self, name)
        if _needs_the_op(hidden_states, top_k_weights):
            return torch.ops.ktfp8.moe(hidden_states, top_k_index, top_k_weights, handle)
        return op.layer_of(handle)(hidden_states, top_k_index, top_k_weights)

    ktfp8_experts_forward.__qualname__ = f"ktfp8_experts_forward[{name}]"
    return ktfp8_experts_forward


def held_experts(model):
    """[(name, module)] of the modules of `model` whose experts ktfp8 holds (their weights released)."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "_ktfp8_claim", None) is not None]


def _refuse_to_save(model, held):
    name, module = held[0]
    source = module._ktfp8_source
    if source is not None:
        where = f"the FP8 folder it was loaded from, {source}, is that checkpoint"
    else:
        where = ("make one from the BF16 folder the model was loaded from: python -m ktfp8.convert --input-type "
                 "bf16 --input-path BF16_FOLDER --output-path FP8_FOLDER (ktfp8.hf.from_pretrained loads it)")
    modules = f"{len(held)} experts module{'s' * (len(held) != 1)}, e.g. {name}"
    return ValueError(f"{type(model).__name__}.save_pretrained: ktfp8 holds the routed experts of this model "
                      f"({modules}, packed {describe(module._ktfp8_quant_config)}) and released their transformers "
                      f"weights, so the folder would hold empty experts; nothing was written. For an FP8 "
                      f"checkpoint, {where}")


def _guarded_save_pretrained(save_pretrained):
    """transformers' save_pretrained, refusing before it writes anything when ktfp8 holds experts of the model
    (it would write [0]-shaped experts that no loader can use).  A method wrapper, not a hook: the experts
    are taken at a forward where only the experts module is at hand, and transformers offers no save hook."""
    @functools.wraps(save_pretrained)
    def save_pretrained_unless_ktfp8_holds_experts(self, *args, **kwargs):
        held = held_experts(self)
        if held:
            raise _refuse_to_save(self, held)
        return save_pretrained(self, *args, **kwargs)

    save_pretrained_unless_ktfp8_holds_experts._ktfp8_guard = True
    return save_pretrained_unless_ktfp8_holds_experts


def register_implementations():
    """Adds the ktfp8 names to transformers' ALL_EXPERTS_FUNCTIONS and the guard to its save_pretrained
    (idempotent)."""
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    for name in IMPLEMENTATIONS:
        if name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, _forward_for(name))
    if not getattr(PreTrainedModel.save_pretrained, "_ktfp8_guard", False):
        PreTrainedModel.save_pretrained = _guarded_save_pretrained(PreTrainedModel.save_pretrained)
