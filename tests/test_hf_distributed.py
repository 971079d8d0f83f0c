"""Expert parallelism inside transformers models: ktfp8.hf under torch.distributed (gloo, loopback, 2 and
3 ranks; 3 does not divide the 4 experts: ranks hold 2, 1, 1) and `python -m ktfp8.generate` under
torchrun.  Oracle: the same model run by ktfp8.hf in one process (and that one is checked against
transformers' own experts by test_hf_models.py)."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_dist_worker  # noqa: E402
import ktfp8.hf  # noqa: E402
from dist_launch import REPO, free_port, run_ranks  # noqa: E402
from hf_oracle import experts_module, greedy, logits, model_folders  # noqa: E402
from hf_models import EXPERTS  # noqa: E402
from ktfp8.experts import split_experts  # noqa: E402
from ktfp8.generate import main as generate  # noqa: E402
from ktfp8.hf import op  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

KIND = "qwen3_moe"          # EXPERTS (4) experts per layer, 2 MoE layers
LIMIT_S = 120               # hard wall-clock bound per launch (a few seconds normally, more when loaded)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return model_folders(KIND, tmp_path_factory)


@pytest.fixture(scope="module")
def one_process(folders):
    """What ktfp8.hf gives in a single process: logits, greedy tokens, the layers' resident bytes.
    torch on one thread, as in the ranks (hf_dist_worker): its float32 sums depend on its thread count,
    and this model's router has a near-tie at the last prompt position (1 thread against 2 moved that
    row's logits by 1.8e-3 with the avx512_bf16 backend on a Zen 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(folders)
    finally:
        torch.set_num_threads(threads)


def _one_process(folders):
    models = {"fp8": ktfp8.hf.from_pretrained(folders["fp8"], dtype=torch.float32, threads=1),
              "bf16": ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(
                  folders["bf16"], dtype=torch.float32, experts_implementation="ktfp8"), threads=1)}
    out = {}
    for path, model in models.items():
        out[f"{path}_logits"] = logits(model)
        out[f"{path}_tokens"] = np.array(greedy(model))
        out[f"{path}_nbytes"] = np.array([op.layer_of(experts_module(model, i)._ktfp8_handle).moe.nbytes
                                          for i in (0, 1)])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_logits_and_greedy_tokens_equal_one_process(folders, one_process, world, tmp_path):
    results = run_ranks(hf_dist_worker.run, (str(folders["bf16"]), str(folders["fp8"]), str(tmp_path)), world,
                        LIMIT_S, tmp_path)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    parts = split_experts(EXPERTS, world)
    for rank in range(world):
        got = np.load(tmp_path / f"rank{rank}.npz")
        for path in ("fp8", "bf16"):
            want = one_process[f"{path}_logits"]
            # float32 model; only the grouping of the expert sums differs
            np.testing.assert_allclose(got[f"{path}_logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
            np.testing.assert_array_equal(got[f"{path}_tokens"], one_process[f"{path}_tokens"])
            share = len(parts[rank]) / EXPERTS
            np.testing.assert_allclose(got[f"{path}_nbytes"], one_process[f"{path}_nbytes"] * share, rtol=0.02)


def test_data_parallel_ranks_are_refused_unless_expert_parallel_is_off(folders, tmp_path):
    """Ranks with their own prompts (data parallel): under the default expert parallel every rank
    raises instead of summing shares of different tokens; with KTFP8_EXPERT_PARALLEL=0 each rank
    holds every expert and gets what one process gets for its prompt."""
    world = 2
    results = run_ranks(hf_dist_worker.run_data_parallel, (str(folders["fp8"]), str(tmp_path)), world, LIMIT_S,
                        tmp_path)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{out[-3000:]}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ktfp8.hf.from_pretrained(folders["fp8"], dtype=torch.float32, threads=1)
        for rank in range(world):
            got = np.load(tmp_path / f"rank{rank}.npz")
            assert "needs the same x, topk_ids and topk_weights on every rank" in str(got["refused"])
            want = logits(model, hf_dist_worker.prompt_of(rank))
            np.testing.assert_allclose(got["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    finally:
        torch.set_num_threads(threads)


def test_generate_under_torchrun_prints_the_tokens_of_one_process(folders, tmp_path, capfd):
    args = ["-m", "ktfp8.generate", "--model", str(folders["fp8"]), "--prompt-ids", "3,17,42,99,5",
            "--max-new-tokens", "12", "--json", "--threads", "1"]
    assert generate(args[2:]) == 0
    single = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)      # its own process group: a hang kills every rank
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun still running after {LIMIT_S} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line (rank 0 only), got:\n{out}"
    assert json.loads(lines[0])["ids"] == single["ids"]
