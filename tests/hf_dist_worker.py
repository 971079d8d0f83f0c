"""One rank of tests/test_hf_distributed.py: a tiny transformers model whose experts ktfp8.hf splits over
the ranks, loaded both ways (FP8 folder memory-mapped; BF16 folder quantized on load).  Writes
OUT_DIR/rank{r}.npz: logits of hf_oracle.PROMPT, 16 greedy tokens, and each MoE layer's resident bytes."""
import os

import numpy as np


def run(bf16_folder, fp8_folder, out_dir):
    import torch
    from transformers import AutoModelForCausalLM

    import ktfp8.hf
    from hf_oracle import experts_module, greedy, logits
    from ktfp8.distributed import destroy_process_group, init_process_group
    from ktfp8.hf import op

    torch.set_num_threads(1)  # as the one-process oracle; OMP_NUM_THREADS came after torch's import
    rank, _ = init_process_group(timeout_s=60)
    models = {"fp8": ktfp8.hf.from_pretrained(fp8_folder, dtype=torch.float32, threads=1),
              "bf16": ktfp8.hf.prepare(AutoModelForCausalLM.from_pretrained(
                  bf16_folder, dtype=torch.float32, experts_implementation="ktfp8"), threads=1)}
    result = {}
    for path, model in models.items():
        result[f"{path}_logits"] = logits(model)
        result[f"{path}_tokens"] = np.array(greedy(model))
        layers = [i for i, block in enumerate(model.model.layers) if hasattr(block.mlp, "experts")]
        result[f"{path}_nbytes"] = np.array([op.layer_of(experts_module(model, i)._ktfp8_handle).moe.nbytes
                                             for i in layers])
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    destroy_process_group()


def prompt_of(rank):
    """Each rank's own prompt in run_data_parallel: the same length (so nothing but the check would
    stop expert parallel from summing shares of different tokens), other tokens."""
    from hf_oracle import PROMPT
    return PROMPT.roll(rank, dims=1)


def run_data_parallel(fp8_folder, out_dir):
    """Each rank its own prompt: expert parallel (the default) refuses; with KTFP8_EXPERT_PARALLEL=0
    every rank holds every expert and gets its prompt's logits.  Writes OUT_DIR/rank{r}.npz."""
    import torch

    import ktfp8.hf
    from hf_oracle import logits
    from ktfp8.distributed import ExpertParallelError, destroy_process_group, init_process_group

    torch.set_num_threads(1)
    rank, _ = init_process_group(timeout_s=60)
    model = ktfp8.hf.from_pretrained(fp8_folder, dtype=torch.float32, threads=1)
    try:
        logits(model, prompt_of(rank))
        refused = ""
    except ExpertParallelError as err:
        refused = str(err)
    os.environ["KTFP8_EXPERT_PARALLEL"] = "0"
    model = ktfp8.hf.from_pretrained(fp8_folder, dtype=torch.float32, threads=1)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), refused=np.array(refused),
             logits=logits(model, prompt_of(rank)))
    destroy_process_group()
