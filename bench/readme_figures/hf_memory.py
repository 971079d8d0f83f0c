"""The README's memory table (Hugging Face transformers, "Memory, measured"): peak and steady memory of
a fresh process loading a 2-layer Qwen3-30B-A3B-wide model one way or the other.

    python bench/readme_figures/hf_memory.py make BF16_FOLDER     # ktfp8.bench.model's model, saved
    python -m ktfp8.convert --input-type bf16 --input-path BF16_FOLDER --output-path FP8_FOLDER
    python bench/readme_figures/hf_memory.py bf16 BF16_FOLDER     # transformers + prepare
    python bench/readme_figures/hf_memory.py fp8 FP8_FOLDER       # ktfp8.hf.from_pretrained

make: ktfp8.bench.model.build_model(2) (hidden 2048, 128 experts, top-8, moe_intermediate 768, first 2
of 48 layers, vocabulary 8192, random BF16 weights) saved by transformers (2.4 GB of BF16 experts).
bf16: AutoModelForCausalLM.from_pretrained(dtype=bfloat16, experts_implementation="ktfp8"), then
ktfp8.hf.prepare (every layer quantized now).  fp8: ktfp8.hf.from_pretrained of the converted folder.
Prints VmHWM, VmRSS, RssAnon and RssFile (/proc/self/status) before loading, when ready, and after a
forward of 8 tokens; run each in a fresh process."""
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # a source checkout built in place


def status():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)

    def gb(key):
        return int(fields[key].split()[0]) * 1024 / 1e9
    return (f"VmHWM {gb('VmHWM'):.2f} GB, VmRSS {gb('VmRSS'):.2f} GB (RssAnon {gb('RssAnon'):.2f}, "
            f"RssFile {gb('RssFile'):.2f})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("make", "bf16", "fp8"):
        print(__doc__, file=sys.stderr)
        return 2
    way, path = argv
    import torch
    if way == "make":
        from ktfp8.bench import model as M
        M.build_model(2).save_pretrained(path)
        print("saved", path)
        return 0
    import ktfp8.hf
    from transformers import AutoModelForCausalLM
    print("imported:", status())
    if way == "bf16":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="ktfp8")
        print("loaded:", status())
        ktfp8.hf.prepare(model)
    else:
        model = ktfp8.hf.from_pretrained(path)
    gc.collect()
    print("ready:", status())
    packed = sum(ktfp8.hf.op.layer_of(layer.mlp.experts._ktfp8_handle).moe.nbytes for layer in model.model.layers)
    print(f"packed experts {packed / 1e9:.2f} GB")
    with torch.inference_mode():
        model(torch.arange(8).reshape(1, 8))
    print("after a forward:", status())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
