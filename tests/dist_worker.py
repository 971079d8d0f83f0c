"""One rank of the expert-parallel tests: tests/test_distributed.py runs main(SCENARIO, OUT_DIR) in N
processes on loopback (dist_launch.py), rank and world in the environment as torchrun sets them
(`python tests/dist_worker.py SCENARIO OUT_DIR` under torchrun works too).  Writes OUT_DIR/rank{r}.npz
or .json for the test to check.

Scenarios: equal (outputs and memory for every format, then the refusals that must not hang),
differ (each rank its own inputs: refused on every rank, then a call with the same ones works),
kill (the last rank SIGKILLs itself before the call), stall (the last rank never calls)."""
import json
import os
import signal
import sys
import time

import ml_dtypes
import numpy as np

E, H, I, K, T = 7, 136, 40, 3, 9
FORMATS = ["fp8_per_channel", "fp8_block", "bf16"]
TIMEOUT_S = 20          # every collective in "equal"; kill/stall use FAIL_TIMEOUT_S
FAIL_TIMEOUT_S = 3


def config(fmt, expert_num=E, hidden=H, k=K):
    import ktfp8
    cfg = ktfp8.MoeConfig(expert_num=expert_num, num_experts_per_tok=k, hidden_size=hidden,
                          intermediate_size=I)
    cfg.quant_config.method = "BF16" if fmt == "bf16" else "FP8"
    cfg.quant_config.per_channel = fmt != "fp8_block"
    cfg.quant_config.group_size = 32 if fmt == "fp8_block" else 0
    return cfg


def inputs(seed=0):
    from moe_oracle import random_routing
    x = np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(T, E, K, seed=seed, skip_fraction=0.1)
    return x, ids, w


def layer(fmt):
    from moe_oracle import make_experts
    return make_experts(fmt, E, H, I, seed=3, block=32)[0]


def equal(rank, size, out_dir):
    import torch

    from ktfp8.distributed import ExpertParallelMoE
    from ktfp8.moe import MoE
    result = {}
    x, ids, w = inputs()
    for fmt in FORMATS:
        experts = layer(fmt)
        ep = ExpertParallelMoE(config(fmt), experts, threads=1, timeout_s=TIMEOUT_S)
        result[f"{fmt}_f32"] = ep(x, ids, w)
        x_bf16 = x.astype(ml_dtypes.bfloat16)
        result[f"{fmt}_bf16x_f32"] = ep(x_bf16.astype(np.float32), ids, w)
        result[f"{fmt}_bf16"] = ep(x_bf16, ids, w).view(np.uint16)
        y_tensor = ep(torch.from_numpy(x).bfloat16(), torch.from_numpy(ids), torch.from_numpy(w))
        result[f"{fmt}_tensor_bf16"] = y_tensor.view(torch.int16).numpy().view(np.uint16)
        result[f"{fmt}_nbytes"] = np.array([ep.nbytes, MoE(config(fmt), experts, threads=1).nbytes])
        result[f"{fmt}_range"] = np.array([ep.expert_range.start, ep.expert_range.stop])
    # from a checkpoint: this rank maps only its experts; the same layer gives the same output, bit for bit
    from ktfp8.loader import FP8SafeTensorLoader
    from test_expert_shards import _write_checkpoint
    from pathlib import Path
    loader = FP8SafeTensorLoader(_write_checkpoint(Path(out_dir) / f"checkpoint{rank}", layer(FORMATS[0])))
    ep = ExpertParallelMoE.from_loader(loader, 0, config=config(FORMATS[0]), threads=1, timeout_s=TIMEOUT_S)
    result["from_loader_f32"] = ep(x, ids, w)
    result["from_loader_range"] = np.array([ep.moe.expert_range.start, ep.moe.expert_range.stop])
    errors = {}
    # a rank whose layer differs: every rank refuses, none hangs on a mismatched all-reduce
    try:
        ExpertParallelMoE(config("bf16", hidden=H + 8 * (rank == size - 1)),
                          _bf16_layer(H + 8 * (rank == size - 1)), threads=1, timeout_s=TIMEOUT_S)
    except ValueError as err:
        errors["mismatch"] = str(err)
    # the same layer, the last rank computing GeGLU: refused, not a sum of SwiGLU and GeGLU shares
    gelu = config("bf16")
    gelu.hidden_act = "gelu_pytorch_tanh" if rank == size - 1 else "silu"
    try:
        ExpertParallelMoE(gelu, _bf16_layer(H), threads=1, timeout_s=TIMEOUT_S)
    except ValueError as err:
        errors["activation_mismatch"] = str(err)
    try:    # fewer experts than ranks: refused before any collective
        ExpertParallelMoE(config("bf16", expert_num=size - 1, k=1), _bf16_layer(H, size - 1),
                          timeout_s=TIMEOUT_S)
    except ValueError as err:
        errors["too_few_experts"] = str(err)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    _write_json(out_dir, rank, errors)


def _bf16_layer(hidden, experts=E):
    from ktfp8.experts import ExpertWeights
    zeros = np.zeros((experts, I, hidden), ml_dtypes.bfloat16)
    return ExpertWeights("bf16", zeros, zeros, np.zeros((experts, hidden, I), ml_dtypes.bfloat16))


def fail(rank, size, out_dir, how):
    from ktfp8.distributed import ExpertParallelError, ExpertParallelMoE
    ep = ExpertParallelMoE(config("bf16"), layer("bf16"), threads=1, timeout_s=FAIL_TIMEOUT_S)
    x, ids, w = inputs()
    ep(x, ids, w)                           # one good call: the group works
    if rank == size - 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 30    # stall: never call again, leave once the others reported
        while time.monotonic() < deadline and not os.path.exists(os.path.join(out_dir, "rank0.json")):
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    try:
        ep(x, ids, w)
        report = {"error": None}
    except ExpertParallelError as err:
        report = {"error": str(err)}
    report["seconds"] = time.monotonic() - start
    _write_json(out_dir, rank, report)
    os._exit(0)         # the group is broken: skip torch's shutdown, which may wait on it


def differ(rank, size, out_dir):
    """Each rank its own tokens (data parallel): every rank refuses each such call, and the group still
    works for the next call with the same inputs."""
    from ktfp8.distributed import ExpertParallelError, ExpertParallelMoE
    ep = ExpertParallelMoE(config("fp8_per_channel"), layer("fp8_per_channel"), threads=1, timeout_s=TIMEOUT_S)
    x, ids, w = inputs()
    x_own, ids_own, w_own = inputs(seed=rank)
    cases = {"x": (x_own, ids, w), "topk_ids": (x, ids_own, w_own), "tokens": (x[: T - rank], ids[: T - rank],
                                                                             w[: T - rank])}
    report = {}
    for name, args in cases.items():
        try:
            ep(*args)
            report[name] = None
        except ExpertParallelError as err:
            report[name] = str(err)
    # arguments that rank 1 alone gets wrong, and its MoE refuses: the others hear of it at once
    wide = np.concatenate([x, np.ones((T, 8), np.float32)], axis=1)
    for name, bad in (("wide_x", (wide, ids, w)), ("fortran_x", (np.asfortranarray(x), ids, w))):
        start = time.monotonic()
        try:
            ep(*(bad if rank == 1 else (x, ids, w)))
            report[name] = None
        except (ExpertParallelError, ValueError) as err:
            report[name] = [type(err).__name__, str(err), time.monotonic() - start]
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), ep(x, ids, w))
    _write_json(out_dir, rank, report)


def _write_json(out_dir, rank, obj):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".partial", path)


def main(scenario, out_dir):
    from ktfp8.distributed import init_process_group
    rank, size = init_process_group(timeout_s=TIMEOUT_S)
    if scenario == "equal":
        equal(rank, size, out_dir)
    elif scenario == "differ":
        differ(rank, size, out_dir)
    else:
        fail(rank, size, out_dir, scenario)


if __name__ == "__main__":
    main(*sys.argv[1:])
