"""Expert parallelism on one machine: the benchmark MoE layer (ktfp8.bench.layers.BENCH_LAYER: E=64,
top-8, hidden 2048, intermediate 768, FP8 per-channel) run by 1 process over all the cores, then by N
ranks (torch.distributed, gloo on loopback) each holding 1/N of the experts on cores/N threads.

    python bench/expert_parallel.py [--ranks 1,2] [--tokens 1,8,64,512] [--repeat 2] [--json FILE]
    python bench/expert_parallel.py --model-layers 2 [--prompt-tokens 256] [--decode-tokens 16]

Per rank and token count: MoE-layer milliseconds per call (median over fresh routings), of which the
partial compute and the all-reduce (which includes waiting for the slowest rank), a bare all-reduce of
the same message after a barrier (the transport alone), tokens/s, packed expert bytes and RSS.
Configurations alternate `--repeat` times and the fastest of each is kept (this machine is shared).

--model-layers N: the model instead of the layer - ktfp8.bench.model's Qwen3-30B-A3B-wide model (128
experts, top-8) with its first N layers, the same random weights on every rank, experts quantized by
ktfp8.hf (each rank only its own); prefill and decode tokens/s of greedy generation and RSS per rank."""
import argparse
import dataclasses
import json
import multiprocessing
import os
import queue as queue_module
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # a source checkout built in place

FMT = "fp8_per_channel"


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _experts(layer, part):
    """Random FP8 experts of `part` only (a rank never holds the others), as a shard of the layer."""
    from ktfp8.bench import layers as L
    sub = L.random_experts(dataclasses.replace(layer, experts=len(part)), FMT, seed=part.start)
    return dataclasses.replace(sub, first_expert=part.start, total_experts=layer.experts)


def rank_main(rank, world, port, threads, tokens, rounds, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch

    from ktfp8.bench import layers as L
    from ktfp8.experts import split_experts
    from ktfp8.moe import MoE
    layer = L.BENCH_LAYER
    cfg = layer.config(FMT)
    base_rss = rss_bytes()
    part = split_experts(layer.experts, world)[rank]
    if world > 1:
        from ktfp8 import distributed as D
        D.init_process_group(timeout_s=120)
        moe = D.ExpertParallelMoE(cfg, _experts(layer, part), threads=threads)
    else:
        moe = MoE(cfg, _experts(layer, part), threads=threads)
    rows = []
    for T in tokens:
        x = L.activations(layer, T)
        draws = L.routing_rounds(layer, T, rounds + 1, seed=T)      # same seed: every rank routes alike
        moe(x, *draws[0][:2])                                      # warm-up
        totals, computes, reduces, bare = [], [], [], []
        for ids, w, _ in draws[1:]:
            if world > 1:
                D.all_reduce_sum(torch.zeros(1))                   # a barrier: start together
                before = dict(moe.timings)
            start = time.perf_counter()
            moe(x, ids, w)
            totals.append(time.perf_counter() - start)
            if world > 1:
                computes.append(moe.timings["compute_s"] - before["compute_s"])
                reduces.append(moe.timings["allreduce_s"] - before["allreduce_s"])
                message = torch.zeros(T, layer.hidden)
                D.all_reduce_sum(torch.zeros(1))
                start = time.perf_counter()
                D.all_reduce_sum(message)
                bare.append(time.perf_counter() - start)
        ms = lambda v: 1e3 * statistics.median(v) if v else None   # noqa: E731
        rows.append({"T": T, "call_ms": ms(totals), "compute_ms": ms(computes) if world > 1 else ms(totals),
                     "allreduce_ms": ms(reduces), "bare_allreduce_ms": ms(bare),
                     "message_bytes": T * layer.hidden * 4 if world > 1 else 0})
    queue.put({"rank": rank, "world": world, "threads": threads, "experts": [part.start, part.stop],
               "packed_bytes": moe.nbytes, "rss_before_experts": base_rss, "rss_after_packing": rss_bytes(),
               "rows": rows})
    if world > 1:
        torch.distributed.destroy_process_group()


def model_rank_main(rank, world, port, threads, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch

    import ktfp8.hf
    from ktfp8.bench import model as M
    from ktfp8.hf import op
    torch.set_num_threads(threads)
    if world > 1:
        from ktfp8 import distributed as D
        D.init_process_group(timeout_s=600)
    model = M.build_model(args.model_layers, seed=0)
    bf16_rss = M.rss_gb()[0]
    ktfp8.hf.prepare(model, "ktfp8", threads=threads)
    prompt = torch.randint(0, 8192, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    speeds = M.measure(model, prompt, args.decode_tokens, args.repeat)
    layers = [op.layer_of(b.mlp.experts._ktfp8_handle).moe for b in model.model.layers]
    allreduce = sum(getattr(m, "timings", {}).get("allreduce_s", 0.0) for m in layers)
    calls = sum(getattr(m, "timings", {}).get("calls", 0) for m in layers)
    queue.put({"rank": rank, "world": world, "threads": threads, **speeds,
               "packed_bytes": sum(m.nbytes for m in layers), "rss_bf16_model_gb": bf16_rss,
               "rss_gb": M.rss_gb()[0], "peak_rss_gb": M.rss_gb()[1],
               "allreduce_ms_per_call": 1e3 * allreduce / calls if calls else None})
    if world > 1:
        torch.distributed.destroy_process_group()


def model_report(results, args):
    print(f"\nQwen3-30B-A3B widths, first {args.model_layers} layers; prompt {args.prompt_tokens}, "
          f"decode {args.decode_tokens} tokens; best of {args.repeat}")
    print(f"{'ranks':>5} {'rank':>4} {'threads':>7} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'packed GiB':>10} {'RSS GB':>7} {'peak GB':>7} {'all-reduce ms/call':>18}")
    for world, ranks in results.items():
        for r in ranks:
            ar = "-" if r["allreduce_ms_per_call"] is None else f"{r['allreduce_ms_per_call']:.2f}"
            print(f"{world:>5} {r['rank']:>4} {r['threads']:>7} {r['prefill']:>13.2f} {r['decode']:>12.2f} "
                  f"{r['packed_bytes'] / 2**30:>10.2f} {r['rss_gb']:>7.2f} {r['peak_rss_gb']:>7.2f} {ar:>18}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, cores, target, *args):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    threads = max(1, cores // world)
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, threads, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 1800
    while len(results) < world:         # a rank that dies sends nothing: stop then, not at the deadline
        try:
            results.append(queue.get(timeout=1))
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
    for p in procs:
        p.join(60)
        if p.exitcode is None:
            p.kill()
    if len(results) < world or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return sorted(results, key=lambda r: r["rank"])


def _merge(best, new):
    """Keeps, per rank and T, the run whose slowest rank was fastest."""
    if best is None:
        return new
    for i, row in enumerate(new[0]["rows"]):
        if max(r["rows"][i]["call_ms"] for r in new) < max(r["rows"][i]["call_ms"] for r in best):
            for b, n in zip(best, new):
                b["rows"][i] = n["rows"][i]
    return best


def report(results):
    print(f"\n{'ranks':>5} {'T':>5} {'call ms':>9} {'compute ms':>10} {'all-reduce ms':>13} "
          f"{'bare ms':>8} {'msg KiB':>8} {'tokens/s':>9}")
    for world, ranks in results.items():
        for i, row in enumerate(ranks[0]["rows"]):
            per_rank = [r["rows"][i] for r in ranks]
            call = max(r["call_ms"] for r in per_rank)
            compute = max(r["compute_ms"] for r in per_rank)
            fmt = lambda v: "-" if v is None else f"{v:.2f}"   # noqa: E731
            reduce = max((r["allreduce_ms"] for r in per_rank if r["allreduce_ms"] is not None), default=None)
            bare = max((r["bare_allreduce_ms"] for r in per_rank if r["bare_allreduce_ms"] is not None),
                       default=None)
            print(f"{world:>5} {row['T']:>5} {call:>9.2f} {compute:>10.2f} {fmt(reduce):>13} {fmt(bare):>8} "
                  f"{row['message_bytes'] / 1024:>8.0f} {row['T'] / call * 1e3:>9.1f}")
    print(f"\n{'ranks':>5} {'rank':>4} {'experts':>9} {'threads':>7} {'packed MiB':>10} {'RSS before':>10} "
          f"{'RSS after':>9}")
    for world, ranks in results.items():
        for r in ranks:
            print(f"{world:>5} {r['rank']:>4} {r['experts'][0]:>3}-{r['experts'][1]:<5} {r['threads']:>7} "
                  f"{r['packed_bytes'] / 2**20:>10.1f} {r['rss_before_experts'] / 2**20:>10.1f} "
                  f"{r['rss_after_packing'] / 2**20:>9.1f}")


def main(argv=None):
    from ktfp8 import backends
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--tokens", default="1,8,64,512", help="comma-separated T (default 1,8,64,512)")
    p.add_argument("--rounds", type=int, default=9, help="timed calls per T (default 9)")
    p.add_argument("--repeat", type=int, default=2, help="alternate the configurations this often (default 2)")
    p.add_argument("--cores", type=int, default=backends.usable_cores(),
                   help="cores shared by the ranks (default: one per core this process may use)")
    p.add_argument("--model-layers", type=int, default=0, help="run the model with this many layers instead")
    p.add_argument("--prompt-tokens", type=int, default=256, help="model: prompt length (default 256)")
    p.add_argument("--decode-tokens", type=int, default=16, help="model: generated tokens (default 16)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.model_layers:
        best = {w: run(w, args.cores, model_rank_main, args) for w in worlds}
        model_report(best, args)
    else:
        best = {w: None for w in worlds}
        for _ in range(args.repeat):
            for w in worlds:
                best[w] = _merge(best[w], run(w, args.cores, rank_main, tokens, args.rounds))
        report(best)
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in best.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
