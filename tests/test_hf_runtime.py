"""ktfp8.hf around the forward: torch.compile, inference_mode, prepare(), the custom op, and the errors
a user gets for what it cannot run."""
import copy
import gc
import json
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5")

import ktfp8  # noqa: E402
import ktfp8.hf  # noqa: E402
from hf_oracle import PROMPT, experts_module, logits, model_folders, tiny_model_settings  # noqa: E402
from ktfp8.hf import op  # noqa: E402
from moe_oracle import nmse  # noqa: E402
from threads import run_in_threads  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    yield from tiny_model_settings(monkeypatch)          # float32 kernels, 1 thread


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return model_folders("qwen3_moe", tmp_path_factory)


def test_torch_compile_traces_the_custom_op(qwen3):
    """fullgraph=True: the experts are one op in the graph (no graph break); aot_eager runs the fake
    implementation through AOTAutograd like inductor does, without inductor's C++ build time."""
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    want = logits(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert nmse(logits(compiled), want) < 1e-12


def test_custom_op_fake_and_real_agree(qwen3):
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    handle = experts_module(model, 0)._ktfp8_handle
    x = torch.randn(5, 160)
    ids = torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    torch.library.opcheck(torch.ops.ktfp8.moe.default, (x, ids, weights, handle),
                          test_utils=("test_schema", "test_faketensor"))
    with torch.inference_mode():
        y = torch.ops.ktfp8.moe(x, ids, weights, handle)
        ref = torch.ops.ktfp8.moe(x.to(torch.bfloat16), ids.to(torch.int32), weights, handle)
    assert y.dtype == torch.float32 and ref.dtype == torch.bfloat16
    assert nmse(ref.float(), y) < 1e-4          # bfloat16 activations: rounding of x and y only


def _layer_calls(monkeypatch):
    """Who called the registered layer, call by call: "ktfp8_experts_forward" (the experts module, on
    its own) or "moe" (the custom op ktfp8::moe's implementation)."""
    calls = []
    real = op.layer_of

    def spy(handle):
        calls.append(sys._getframe(1).f_code.co_name)
        return real(handle)
    monkeypatch.setattr(op, "layer_of", spy)
    return calls


def test_eager_inference_skips_the_op_and_a_gradient_still_meets_it(qwen3, monkeypatch):
    """Eager inference calls the layer straight, without the custom op's dispatch (a fixed cost per
    layer and token), and gives the op's result bit for bit.  A forward that may need a gradient still
    goes through the op, so the backward is refused by name rather than silently leaving the experts'
    share out of the gradient; so does a profiled one, so that the profile names the experts."""
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    experts = experts_module(model, 0)
    handle = experts._ktfp8_handle
    x = torch.randn(5, 160)
    ids = torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    calls = _layer_calls(monkeypatch)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = experts(x, ids, weights)
            assert calls[-1] == "ktfp8_experts_forward"
            assert torch.equal(y, torch.ops.ktfp8.moe(x, ids, weights, handle)) and calls[-1] == "moe"
    experts(x, ids, weights)                                     # nothing asks for a gradient
    assert calls[-1] == "ktfp8_experts_forward"
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        experts(x, ids, weights)
    assert calls[-1] == "moe" and "ktfp8::moe" in {event.name for event in prof.events()}
    x.requires_grad_(True)
    y = experts(x, ids, weights)
    assert calls[-1] == "moe"
    with pytest.raises(RuntimeError, match="ktfp8.moe"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="ktfp8.moe"):
        model(PROMPT).logits.sum().backward()   # its parameters want gradients


def test_torch_func_transforms_and_make_fx_meet_the_op(qwen3, monkeypatch):
    """Under functionalize, vmap and make_fx (which traces real tensors), the experts give their eager
    result: their tensors go through the op, which unwraps or records them, and never reach the layer's
    NumPy views as wrappers (functionalize read another tensor's numbers, vmap failed, make_fx baked
    the result into its graph as a constant)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    experts = experts_module(ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32), 0)
    ids = torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    x, x2 = torch.randn(5, 160), torch.randn(5, 160)
    calls = _layer_calls(monkeypatch)
    with torch.no_grad():
        want = experts(x2, ids, weights)
        assert torch.equal(torch.func.functionalize(lambda a: experts(a, ids, weights))(x2), want)
        assert torch.equal(torch.func.vmap(lambda a: experts(a, ids, weights))(torch.stack([x, x2]))[1], want)
        traced = make_fx(lambda a, b, c: experts(a, b, c))(x, ids, weights)
        assert torch.equal(traced(x2, ids, weights), want)
    assert set(calls[1:]) == {"moe"}


def test_jit_trace_records_the_op(qwen3):
    """torch.jit.trace under no_grad records the op, not the layer's NumPy result as a constant: the
    trace gives the module's own result on activations it did not see."""
    experts = experts_module(ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32), 0)
    ids = torch.randint(0, 4, (5, 2))
    weights = torch.rand(5, 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # torch.jit.trace is deprecated
        traced = torch.jit.trace(experts, (torch.randn(5, 160), ids, weights), check_trace=False)
        x = torch.randn(5, 160)
        assert torch.equal(traced(x, ids, weights), experts(x, ids, weights))


def test_meta_and_fake_tensors_get_the_ops_fake_result(qwen3):
    """Shapes without data (meta tensors, FakeTensorMode) go through the op's fake implementation, in
    inference as in training: a tensor of the activations' shape, dtype and kind, no error."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    experts = experts_module(ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32), 0)
    with torch.no_grad():
        y = experts(torch.empty(5, 160, device="meta"), torch.zeros(5, 2, dtype=torch.int64, device="meta"),
                    torch.empty(5, 2, device="meta"))
        assert y.device.type == "meta" and y.shape == (5, 160) and y.dtype == torch.float32
        with FakeTensorMode():
            y = experts(torch.empty(5, 160), torch.zeros(5, 2, dtype=torch.int64), torch.empty(5, 2))
        assert isinstance(y, FakeTensor) and y.shape == (5, 160)


def test_prepare_quantizes_now_and_releases_the_bf16_weights(qwen3):
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)
    want = logits(ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)))
    before = sum(p.numel() for p in model.parameters())
    assert ktfp8.hf.prepare(model) is model
    assert model.config._experts_implementation == "ktfp8"
    ex = experts_module(model, 0)
    released = 4 * (2 * 96 * 160 + 160 * 96) * 2        # experts x (gate_up + down) x 2 layers
    assert before - sum(p.numel() for p in model.parameters()) == released
    moe = op.layer_of(ex._ktfp8_handle).moe
    assert moe.nbytes < released                         # 1 byte per weight (+ scales), not 4
    ktfp8.hf.prepare(model)                              # a second call changes nothing
    with torch.inference_mode():
        got = logits(model)
    np.testing.assert_array_equal(got, want)


def test_prepare_reaches_experts_built_from_a_copy_of_the_config(qwen3):
    """Dots3-Note's vision experts take config.per_layer_config[i], a copy made with the model, which
    set_experts_implementation does not reach: after prepare they still ran as "grouped_mm" over their
    released weights (ValueError at the first image).  prepare sets each module's own config too."""
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)
    want = logits(ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)))
    ex = experts_module(model, 1)
    ex.config = copy.copy(ex.config)
    ktfp8.hf.prepare(model)
    assert ex.config is not model.config and ex.config._experts_implementation == "ktfp8"
    np.testing.assert_array_equal(logits(model), want)


def test_threads_calling_a_model_before_its_first_forward_quantize_each_layer_once(qwen3, monkeypatch):
    """Six Python threads calling a model set to "ktfp8" before its first forward: each layer was quantized
    once per thread that found it unprepared, and each attach freed the layer another thread was about to
    run (RuntimeError "no layer registered under handle" in 2 of 12 trials of a helper's audit)."""
    import threading
    registered = []
    register = op.register
    monkeypatch.setattr(op, "register", lambda layer: registered.append(layer) or register(layer))
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)
    model.set_experts_implementation("ktfp8")
    start, results = threading.Barrier(6), {}

    def call(i):
        start.wait()
        try:
            results[i] = logits(model)
        except Exception as err:      # noqa: BLE001 -- reported below, by thread
            results[i] = err

    run_in_threads(call, [(i,) for i in range(6)])
    errors = [r for r in results.values() if isinstance(r, Exception)]
    assert not errors, errors[0]
    assert len(registered) == len(ktfp8.hf.experts.experts_modules(model))
    for r in results.values():
        np.testing.assert_array_equal(r, results[0])


def test_a_failed_prepare_names_the_layer_and_leaves_the_model_consistent(qwen3):
    """An Inf weight in the second layer: prepare names that layer, and the first layer, already quantized
    (its transformers weights released), still runs on ktfp8; the model's next forward meets the same
    error.  It said only "down holds inf", and left the model on its old implementation, whose first
    layer then had no weights ("ktfp8 released its transformers expert weights")."""
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)
    bad = experts_module(model, 1)
    with torch.no_grad():
        bad.down_proj[2, 5, 7] = float("inf")
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.experts: down holds inf at \[2, 5, 7\]"):
        ktfp8.hf.prepare(model)
    assert experts_module(model, 0).gate_up_proj.numel() == 0 and model.config._experts_implementation == "ktfp8"
    with pytest.raises(ValueError, match=r"down holds inf at \[2, 5, 7\]"):
        logits(model)


def test_from_pretrained_applies_config_overrides(qwen3, monkeypatch):
    """Keyword arguments naming config attributes change the config, as transformers' from_pretrained
    does when it loads the config itself; they went to the model's constructor ("unexpected keyword
    argument 'use_cache'").  A bad threads= is refused before the model loads."""
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32, use_cache=False, output_router_logits=True,
                                     attn_implementation="eager")
    assert model.config.use_cache is False and model.config.output_router_logits is True
    assert model.config._attn_implementation == "eager"
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", None)    # nothing may load
    with pytest.raises(ValueError, match="threads must be a positive int or None, got 0"):
        ktfp8.hf.from_pretrained(qwen3["fp8"], threads=0)


def test_prepare_sets_the_thread_count_of_layers_already_prepared(qwen3):
    """from_pretrained's model (and one prepared before) takes prepare(model, threads=n) as its layers'
    new thread count; a bad count is refused before any layer changes."""
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32, threads=1)
    layers = [op.layer_of(experts_module(model, i)._ktfp8_handle) for i in (0, 1)]
    want = logits(model)
    assert ktfp8.hf.prepare(model, threads=2) is model
    assert [layer.threads for layer in layers] == [2, 2]
    np.testing.assert_array_equal(logits(model), want)      # the same bits on any thread count
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            ktfp8.hf.prepare(model, threads=bad)
        assert [layer.threads for layer in layers] == [2, 2]


def test_set_experts_implementation_switches_a_loaded_model(qwen3):
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32)
    model.set_experts_implementation("ktfp8_block")
    logits(model)
    assert op.layer_of(experts_module(model, 1)._ktfp8_handle).moe.config.quant_config.per_channel is False


def test_unsupported_models_are_refused_by_name(tmp_path):
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="gpt_oss"):
        ktfp8.hf.prepare(model)
    model.set_experts_implementation("ktfp8")          # transformers accepts the name; the first call refuses
    with pytest.raises(ValueError, match="GptOssExperts"):
        model(torch.tensor([[1, 2, 3]]))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="'llama'"):
        ktfp8.hf.prepare(llama)
    # no experts module: transformers never calls an experts implementation, the model runs as it is
    AutoModelForCausalLM.from_pretrained(tmp_path / "llama", experts_implementation="ktfp8")(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="holds no routed experts"):    # not "experts are 'fp32'"
        ktfp8.hf.from_pretrained(tmp_path / "llama")


def test_bad_folders_and_arguments(qwen3, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        ktfp8.hf.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="not FP8"):
        ktfp8.hf.from_pretrained(qwen3["bf16"])
    with pytest.raises(TypeError, match="dtype"):
        ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float16)
    with pytest.raises(TypeError, match="key_mapping"):
        ktfp8.hf.from_pretrained(qwen3["fp8"], key_mapping={})
    with pytest.raises(ValueError, match="quant_config"):
        ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"]), quant_config="int4")


def test_bad_activations(qwen3):
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    layer = op.layer_of(experts_module(model, 0)._ktfp8_handle)
    x, ids, w = torch.randn(3, 160), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    # a tensor without CPU data (meta here; CUDA takes the same path in the core) is refused, not read
    with pytest.raises(ValueError, match="x is a meta tensor"):
        layer(x.to("meta"), ids, w)
    with pytest.raises(TypeError, match="the model runs in torch.float16; ktfp8 takes float32 or bfloat16"):
        layer(x.half(), ids, w)             # (a model cast with .half() after its first forward)
    with pytest.raises(TypeError, match="topk_ids must have dtype int32 or int64"):
        layer(x, ids.float(), w)
    with pytest.raises(ValueError, match="expert id 9"):
        layer(x, torch.full((3, 2), 9), w)
    # a sparse tensor's own .contiguous() raised a message naming neither the argument nor the layout
    with pytest.raises(TypeError, match="x must be a dense tensor, got layout torch.sparse_coo"):
        layer(x.to_sparse(), ids, w)


def test_forward_mode_ad_is_refused_by_name(qwen3):
    """Forward-mode AD (dual tensors under torch.autograd.forward_ad, often under no_grad) went past the
    reverse-mode refusal, and the result carried the tangent of everything but the experts: a model's
    logits tangent without their share (a helper's hunt).  Outside a dual level nothing changes."""
    import torch.autograd.forward_ad as fwAD
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32, attn_implementation="eager")  # (sdpa has
    embeds = model.get_input_embeddings()(PROMPT).detach()                               # no forward AD)
    with fwAD.dual_level(), torch.no_grad():
        with pytest.raises(NotImplementedError, match=r"forward-mode AD \(torch.autograd.forward_ad\) through "
                                                      r"Qwen3MoeExperts is not supported"):
            model(inputs_embeds=fwAD.make_dual(embeds, torch.randn_like(embeds)))
        plain = model(inputs_embeds=embeds).logits          # no tangent: runs as before
    with torch.no_grad():
        assert torch.equal(plain, model(inputs_embeds=embeds).logits)


def test_float16_model_refused_before_its_weights_are_touched(qwen3):
    half = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float16)
    weights = experts_module(half, 0).gate_up_proj.detach().clone()
    refusal = r"torch\.float16.*float32 or bfloat16"
    with pytest.raises(TypeError, match=refusal):
        ktfp8.hf.prepare(half)
    half.set_experts_implementation("ktfp8")
    with pytest.raises(TypeError, match=refusal):
        half(PROMPT)
    assert torch.equal(experts_module(half, 0).gate_up_proj, weights)
    half.set_experts_implementation("eager")           # the model is as loaded: transformers still runs it
    assert np.isfinite(logits(half)).all()


def test_another_format_refused_once_quantized(qwen3, tmp_path):
    model = ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32))
    ktfp8.hf.prepare(model, "ktfp8")                    # the same format again: nothing to do
    with pytest.raises(ValueError, match="already quantized as FP8 per-channel"):
        ktfp8.hf.prepare(model, "ktfp8_bf16")
    assert model.config._experts_implementation == "ktfp8"
    model.set_experts_implementation("ktfp8_block")
    with pytest.raises(ValueError, match="already quantized as FP8 per-channel.*'ktfp8_block'"):
        logits(model)
    model.set_experts_implementation("ktfp8")
    logits(model)
    block64 = ktfp8.QuantConfig("FP8", per_channel=False, group_size=64)
    model = ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32), block64)
    ktfp8.hf.prepare(model)                             # the model's own implementation, "ktfp8_block"
    with pytest.raises(ValueError, match="already quantized as FP8 block-wise 64 x 64"):
        ktfp8.hf.prepare(model, ktfp8.QuantConfig("FP8", per_channel=False, group_size=32))
    fp8 = ktfp8.hf.from_pretrained(qwen3["fp8_block"], dtype=torch.float32)
    fp8.set_experts_implementation("ktfp8")
    with pytest.raises(ValueError, match="already quantized as FP8 block-wise 128 x 128"):
        logits(fp8)


def test_from_pretrained_refuses_arguments_it_would_ignore(qwen3):
    with pytest.raises(TypeError, match="output_loading_info"):
        ktfp8.hf.from_pretrained(qwen3["fp8"], output_loading_info=True)
    with pytest.raises(TypeError, match="torch_dtype.*dtype="):
        ktfp8.hf.from_pretrained(qwen3["fp8"], torch_dtype=torch.float32)
    with pytest.raises(TypeError, match="path must be .*got NoneType"):
        ktfp8.hf.from_pretrained(None)


def test_non_square_blocks_refused_before_loading(qwen3, tmp_path):
    folder = tmp_path / "non_square"
    folder.mkdir()
    for f in qwen3["fp8_block"].glob("*.safetensors"):
        (folder / f.name).symlink_to(f)
    config = json.loads((qwen3["fp8_block"] / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 64]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[32, 64\]: non-square blocks are not supported"):
        ktfp8.hf.from_pretrained(folder)


def test_fp8_formats_mixed_across_layers_refused(qwen3, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = {}
    for name in ("fp8", "fp8_block"):
        layer_taken = ".layers.0." if name == "fp8" else ".layers.1."
        for f in qwen3[name].glob("*.safetensors"):
            tensors.update({k: v for k, v in load_file(f).items() if ".experts." not in k or layer_taken in k})
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    (mixed / "config.json").write_bytes((qwen3["fp8_block"] / "config.json").read_bytes())
    with pytest.raises(ValueError, match="mixes FP8 per-channel and block-wise experts across layers"):
        ktfp8.hf.from_pretrained(mixed)


def test_save_pretrained_refused_once_ktfp8_holds_the_experts(qwen3, tmp_path):
    """save_pretrained would write [0]-shaped experts (released) that no loader can use: it refuses before
    writing anything, naming where an FP8 checkpoint comes from.  Before the first call of a model loaded
    with experts_implementation="ktfp8" the BF16 experts are still there, and it saves them."""
    fp8 = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    prepared = ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32))
    held = (r"ktfp8 holds the routed experts of this model \(2 experts modules, e\.g\. "
            r"model\.layers\.0\.mlp\.experts, packed FP8 per-channel\).*nothing was written\. ")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=held + f"For an FP8 checkpoint, the FP8 folder it was loaded from, "
                                                f"{qwen3['fp8']}, is that checkpoint"):
        fp8.save_pretrained(out)
    assert not out.exists()
    for model in (prepared, copy.deepcopy(prepared)):
        with pytest.raises(ValueError, match=held + r".*python -m ktfp8\.convert --input-type bf16"):
            model.save_pretrained(out)
        assert not out.exists()
    on_load = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32,
                                                   experts_implementation="ktfp8")
    gate_up = experts_module(on_load, 0).gate_up_proj.detach().clone()
    on_load.save_pretrained(out)                        # not quantized yet: a complete BF16 checkpoint
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager")
    assert torch.equal(experts_module(saved, 0).gate_up_proj, gate_up)
    logits(on_load)                                     # its first call quantizes and releases
    with pytest.raises(ValueError, match=held):
        on_load.save_pretrained(tmp_path / "after_first_call")
    assert not (tmp_path / "after_first_call").exists()


def test_state_dict_warns_that_held_experts_are_empty(qwen3):
    """model.state_dict() still works (other code reads the rest of it), but its expert entries are the
    released (0,) tensors: it warns, so that torch.save(model.state_dict()) is not taken for a checkpoint.
    A model whose experts ktfp8 does not hold yet (not called since loading) gives its weights, silently."""
    on_load = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32,
                                                   experts_implementation="ktfp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert on_load.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].numel() > 0
    logits(on_load)                                     # its first call quantizes and releases
    for model in (on_load, ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)):
        with pytest.warns(RuntimeWarning, match=r"state_dict\(\): ktfp8 holds the routed experts .* empty "
                                                r"\(0,\) tensors") as record:
            state = model.state_dict()
        assert len(record) == 1                         # once per call, not once per layer (2 here)
        assert state["model.layers.0.mlp.experts.down_proj"].shape == (0,)
        assert state["model.embed_tokens.weight"].numel() > 0
        # torch takes a plain dict as destination=, which no flag can be set on (an AttributeError before)
        with pytest.warns(RuntimeWarning, match=r"state_dict\(\): ktfp8 holds") as record:
            into = model.state_dict(destination={})
        assert len(record) == 1 and into.keys() == state.keys()


def test_a_first_call_under_inference_mode_leaves_an_ordinary_model(qwen3):
    """The (0,) parameters that replace the released weights were made at the first call, under
    inference_mode as generate runs it: inference tensors, which requires_grad_(True) and
    load_state_dict then refused outside that mode.  They are made outside it now, as prepare() does."""
    model = AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32, experts_implementation="ktfp8")
    want = logits(model)                                # its first call, under inference_mode
    assert not any(p.is_inference() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)         # the state_dict warning, tested above
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    model.requires_grad_(True)
    np.testing.assert_array_equal(logits(model), want)


def test_deepcopy_outlives_the_original(qwen3):
    """copy.deepcopy of a model copies its experts modules' int handle: the copy's claim keeps the (shared,
    never written) packed layer registered after the original is freed, until the last holder goes.
    Pickling, which would carry a handle to a process without that layer, is refused."""
    model = ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32)
    want = logits(model)
    handle = experts_module(model, 0)._ktfp8_handle
    copied = copy.deepcopy(model)
    del model
    gc.collect()
    np.testing.assert_array_equal(logits(copied), want)
    with pytest.raises(TypeError, match="whose experts ktfp8 holds cannot be pickled"):
        pickle.dumps(copied)
    del copied
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no layer registered under handle {handle}"):
        op.layer_of(handle)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_switching_back_to_transformers_experts_refused(qwen3, implementation):
    """Once ktfp8 took the experts, their transformers weights are gone: another implementation is refused at
    the next forward (transformers' set_experts_implementation has no hook), naming why; "ktfp8" runs again."""
    for model in (ktfp8.hf.from_pretrained(qwen3["fp8"], dtype=torch.float32),
                  ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(qwen3["bf16"], dtype=torch.float32))):
        want = logits(model)
        model.set_experts_implementation(implementation)
        refusal = (f"Qwen3MoeExperts is set to run as '{implementation}', but ktfp8 released its transformers "
                   f"expert weights .* when it took the experts \\(FP8 per-channel\\), so this model cannot switch "
                   f"back.*reload the model")
        with pytest.raises(ValueError, match=refusal):
            logits(model)
        model.set_experts_implementation("ktfp8")
        np.testing.assert_array_equal(logits(model), want)


@pytest.mark.parametrize("module, release", [("transformers", "5.23.0"), ("torch", "2.5.1+cpu")])
def test_import_refuses_a_release_older_than_the_tests_pass_on(module, release):
    code = f"import {module}; {module}.__version__ = {release!r}; import ktfp8.hf"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    oldest = ".".join(map(str, ktfp8.hf.MIN_VERSIONS[module]))
    assert proc.returncode == 1
    assert f"ImportError: ktfp8.hf needs {module} {oldest} or later, found {release}; upgrade it" in proc.stderr
