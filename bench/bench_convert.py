"""Conversion speed and peak memory of `python -m ktfp8.convert` on a generated BF16 MoE checkpoint,
and the SQNR of per-channel vs block-wise FP8 on the same weights.

    python bench/bench_convert.py --size-gb 2.4 --workdir /tmp/ktfp8-bench [--keep]

The checkpoint is written with the safetensors library (torch bf16 tensors): Qwen3-30B-A3B-shaped
experts (hidden 2048, moe_intermediate 768, 128 experts per layer), Gaussian rows whose scales vary by
a log-normal factor, as trained weights' rows do, plus a few non-expert tensors, in 1 GB shards.
Each conversion runs as a child process under /usr/bin/time, which reports its peak RSS."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, EXPERTS = 2048, 768, 128
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))      # run from a checkout without installing: ktfp8 from this tree


def generate(folder, size_bytes, seed=0):
    import torch
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    layer_bytes = 3 * EXPERTS * HIDDEN * INTER * 2
    layers = max(1, round(size_bytes / layer_bytes))
    weight_map, shard, shard_bytes, files = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    def add(name, tensor):
        nonlocal shard_bytes
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= 1e9:
            flush()

    add("model.embed_tokens.weight", (torch.randn(4096, HIDDEN, generator=gen) * 0.02).bfloat16())
    for layer in range(layers):
        p = f"model.layers.{layer}."
        add(p + "mlp.gate.weight", (torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.02).bfloat16())
        add(p + "self_attn.o_proj.weight", (torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.02).bfloat16())
        for e in range(EXPERTS):
            for proj, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
                rows = torch.exp(torch.randn(shape[0], 1, generator=gen) * 0.5) * 0.02
                add(p + f"mlp.experts.{e}.{proj}_proj.weight",
                    (torch.randn(*shape, generator=gen) * rows).bfloat16())
    add("lm_head.weight", (torch.randn(4096, HIDDEN, generator=gen) * 0.02).bfloat16())
    flush()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": HIDDEN,
              "moe_intermediate_size": INTER, "num_experts": EXPERTS, "num_experts_per_tok": 8,
              "num_hidden_layers": layers, "norm_topk_prob": True}
    (folder / "config.json").write_text(json.dumps(config))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def convert(src, dst, quant, threads, verify=False):
    cmd = [sys.executable, "-m", "ktfp8.convert", "--input-type", "bf16", "--input-path", str(src),
           "--output-path", str(dst), "--quant-config", quant, "--overwrite", "--max-shard-size", "1GB"]
    if threads:
        cmd += ["--threads", str(threads)]
    if verify:
        cmd += ["--verify"]
    out, err, rss = (dst.parent / n for n in ("stdout.txt", "stderr.txt", "maxrss.txt"))
    # /usr/bin/time forks the converter from a small process: a child forked from this (big) one
    # would count our pages in its peak RSS
    cmd = ["/usr/bin/time", "-f", "%M", "-o", str(rss)] + cmd
    started = time.perf_counter()
    with open(out, "w") as fo, open(err, "w") as fe:
        code = subprocess.run(cmd, stdout=fo, stderr=fe, cwd=REPO).returncode
    wall = time.perf_counter() - started
    if code:
        raise SystemExit(f"conversion failed:\n{err.read_text()}")
    return wall, int(rss.read_text().split()[-1]) * 1024, out.read_text()


def sqnr_lines(stdout):
    return [float(l.split()[1]) for l in stdout.splitlines() if l.startswith("SQNR")]


def sqnr_by_distribution(seed=0):
    """Per-channel vs 128x128 block-wise SQNR (dB) on [768, 2048] matrices of three kinds of weights:
    Gaussian rows of log-normal scale (as generated above), heavy-tailed (Student t, 3 dof), and
    Gaussian with 1% of input channels 10x larger (the outlier columns of trained LLM weights)."""
    import numpy as np
    from ktfp8 import fp8
    rng = np.random.default_rng(seed)
    shape = (INTER, HIDDEN)
    rows = np.exp(rng.standard_normal((shape[0], 1)) * 0.5)
    cols = np.where(rng.random(shape[1]) < 0.01, 10.0, 1.0)
    kinds = {"gaussian rows": rng.standard_normal(shape) * rows,
             "student-t(3)": rng.standard_t(3, shape) * rows,
             "outlier columns": rng.standard_normal(shape) * rows * cols}
    out = {}
    for kind, w in kinds.items():
        w = w.astype(np.float32)
        result = []
        for per_channel in (True, False):
            codes, scale = fp8.quantize(w, per_channel=per_channel)
            err = w.astype(np.float64) - fp8.dequantize(codes, scale)
            result.append(10 * np.log10(np.sum(w.astype(np.float64) ** 2) / np.sum(err ** 2)))
        out[kind] = tuple(result)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=2.4)
    ap.add_argument("--workdir", default="/tmp/ktfp8-bench")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--generate-only", metavar="FOLDER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_only:
        generate(Path(args.generate_only), args.size_gb * 1e9)
        return
    for kind, (channel, block) in sqnr_by_distribution().items():
        print(f"SQNR {kind:16s} per-channel {channel:6.2f} dB, block 128x128 {block:6.2f} dB", flush=True)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    try:
        src = work / "bf16"
        t = time.perf_counter()
        # in a child, so that this process stays small
        subprocess.run([sys.executable, __file__, "--generate-only", str(src), "--size-gb", str(args.size_gb)],
                       check=True)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        print(f"generated {size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
        os.sync()
        for label, quant in (("per-channel", '{"method":"FP8","per_channel":true}'),
                             ("block 128", '{"method":"FP8","per_channel":false,"group_size":128}')):
            wall, peak, _ = convert(src, work / "out", quant, args.threads)
            print(f"{label:12s} convert: {wall:6.1f} s, {size / 1e6 / wall:6.0f} MB/s of input, "
                  f"peak RSS {peak / 1e6:.0f} MB", flush=True)
        for label, quant in (("per-channel", '{"method":"FP8","per_channel":true}'),
                             ("block 128", '{"method":"FP8","per_channel":false,"group_size":128}')):
            wall, peak, stdout = convert(src, work / "out", quant, args.threads, verify=True)
            db = sqnr_lines(stdout)
            print(f"{label:12s} --verify run {wall:6.1f} s, peak RSS {peak / 1e6:.0f} MB; SQNR over {len(db)} tensors: mean "
                  f"{statistics.mean(db):.2f} dB, min {min(db):.2f}, max {max(db):.2f}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
