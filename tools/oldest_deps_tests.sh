#!/usr/bin/env bash
# The core tests against the oldest NumPy and ml_dtypes that pyproject.toml's dependencies accept (the
# lowest minor series of each, its last patch release), so that a user whose other packages pin an older
# NumPy gets what the declared range promises.  A second venv, .venv-oldest, holds those two and the
# core tests' own tools (no torch: the hf tests skip); the tests run on this checkout's in-place build,
# compiled against NumPy 2's headers as any wheel of ktfp8 is (pyproject's build-system).
# Needs tools/setup.sh first (the in-place build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# "numpy==1.24.*" from "numpy>=1.24": the minimums are read from pyproject.toml, not restated here
mapfile -t oldest < <("$PY" - <<'EOF'
import re
text = open("pyproject.toml").read()
deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
for name, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', deps):
    print(f"{name}=={version}.*")
EOF
)
[ ${#oldest[@]} -ge 2 ] || { echo "oldest_deps_tests: no minimum versions found in pyproject.toml" >&2; exit 1; }

.venv-oldest/bin/python -m pip --version >/dev/null 2>&1 || "$PY" -m venv --clear .venv-oldest
.venv-oldest/bin/python -m pip install -q "${oldest[@]}" pytest pytest-xdist hypothesis safetensors
.venv-oldest/bin/python -c 'import numpy, ml_dtypes; print(f"oldest dependencies: numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}")'
PYTHONPATH=. .venv-oldest/bin/python -m pytest -q -n auto -p no:cacheprovider \
    tests/test_moe.py tests/test_kernels.py tests/test_fp8_codec.py tests/test_routing.py tests/test_config.py \
    tests/test_packing.py tests/test_quantize_experts.py tests/test_convert.py tests/test_loader.py \
    tests/test_safetensors_io.py tests/test_moe_errors.py tests/test_tokens_per_expert.py tests/test_expert_shards.py \
    tests/test_properties.py tests/test_bad_inputs.py
