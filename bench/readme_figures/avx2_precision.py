"""The README's `avx2` precision figures (Backends): `avx2` scales a call's activations by one power of
two, so a token far smaller than the call's largest loses precision it keeps in a call of its own.
Two tokens A and B in one call (the same experts), B R times smaller than A, against B alone: the
largest difference in B's row over B's largest value, for A of magnitude 1, 1e5, 1e10 and 1e15 and R
from 1e16 to 1e26.  Layer: E=8, top-2, H=2048, I=768, FP8 per-channel from N(0, 0.02) weights.

    python bench/readme_figures/avx2_precision.py [--backend avx2]"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # a source checkout built in place
import ktfp8  # noqa: E402

E, K, H, I = 8, 2, 2048, 768
MAGNITUDES = (1.0, 1e5, 1e10, 1e15)
RATIOS = (1e16, 1e18, 1e20, 1e21, 1e22, 1e23, 1e24, 1e25, 1e26)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="avx2", help="the backend to measure (default avx2)")
    args = p.parse_args(argv)
    cfg = ktfp8.MoeConfig(expert_num=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I)
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal(s) * 0.02).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I))]
    moe = ktfp8.MoE(cfg, ktfp8.quantize_experts(*weights, cfg.quant_config), backend=args.backend, threads=1)
    print(f"backend {moe.backend}")
    ids = np.array([[1, 5], [1, 5]], np.int64)
    w = np.array([[0.6, 0.4], [0.6, 0.4]], np.float32)
    for a in MAGNITUDES:
        base = rng.standard_normal((2, H)).astype(np.float32)
        for r in RATIOS:
            x = base.copy()
            x[0] *= a
            x[1] *= np.float32(a / r)
            pair = moe(x, ids, w)[1].astype(np.float64)
            alone = moe(x[1:2], ids[1:2], w[1:2])[0].astype(np.float64)
            largest = np.abs(alone).max()
            error = np.abs(pair - alone).max() / largest if largest else float("nan")
            print(f"  A ~{a:.0e}, B ~{a / r:.0e} (R = {r:.0e}): max|y_B alone| {largest:.3e}, "
                  f"relative error of B's row {error:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
