"""The README's op-dispatch figure (Hugging Face transformers): what torch's custom op ktfp8::moe costs
an experts call.  A tiny Qwen3-MoE experts module (E=8, top-2, H=64, I=32, BF16, ktfp8.hf.prepare on 1
thread), under inference_mode: the module's own forward (the layer called directly, as eager inference
does), the same forward forced through the op (ktfp8.hf.experts._needs_the_op patched to True: only the
branch differs), torch.ops.ktfp8.moe itself, and the module with grad enabled and x requiring grad (the
op plus autograd's bookkeeping).  Blocks of --calls calls alternate --rounds times; medians of the
blocks' medians, us a call.

    python bench/readme_figures/op_dispatch.py [--rounds 15] [--calls 2000]"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # a source checkout built in place
import torch  # noqa: E402
import transformers  # noqa: E402

import ktfp8.hf  # noqa: E402
import ktfp8.hf.experts as hf_experts  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="alternations of the four sides (default 15)")
    p.add_argument("--calls", type=int, default=2000, help="calls a block (default 2000)")
    args = p.parse_args(argv)
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    model = ktfp8.hf.prepare(transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16), threads=1)
    experts = model.model.layers[0].mlp.experts
    handle = experts._ktfp8_handle
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    ids, w = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]], dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_(True)

    def block(fn):
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    def direct():
        return experts(x, ids, w)

    def via_op():
        return torch.ops.ktfp8.moe(x, ids, w, handle)

    def op_forced():
        real = hf_experts._needs_the_op
        hf_experts._needs_the_op = lambda *a: True
        try:
            return block(direct)
        finally:
            hf_experts._needs_the_op = real

    with torch.inference_mode():
        assert torch.equal(direct(), via_op())
    results = {"module (layer directly)": [], "module, op forced": [], "torch.ops.ktfp8.moe": [],
               "module, grad enabled (op + autograd)": []}
    for _ in range(args.rounds):
        with torch.inference_mode():
            results["module (layer directly)"].append(block(direct))
            results["module, op forced"].append(op_forced())
            results["torch.ops.ktfp8.moe"].append(block(via_op))
        results["module, grad enabled (op + autograd)"].append(block(lambda: experts(x_grad, ids, w)))
    for side, us in results.items():
        print(f"{side:40s} median {statistics.median(us):7.2f} us  (blocks {min(us):.2f}-{max(us):.2f})")
    extra = [b - a for a, b in zip(results["module (layer directly)"], results["module, op forced"])]
    print(f"the op's dispatch, per round: median {statistics.median(extra):.2f} us, "
          f"range {min(extra):.2f}-{max(extra):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
