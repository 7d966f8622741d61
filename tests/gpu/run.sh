#!/usr/bin/env bash
# The GPU group on one CUDA machine: `bash tests/gpu/run.sh` from the repository root (< 8 min on
# one H200). Packages the machine lacks (pyzmq, pydantic, pytest-asyncio, ...) travel as wheels in
# .whl/: `bash tests/gpu/fetch_wheels.sh` makes them on a machine with PyPI. Results go to $OUT
# (or /tmp): gpu.log, gpu.xml (JUnit) and gpu_bench.json (the speed figures the tests print).
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/slipstream-site .whl/*.whl
    export PYTHONPATH="/tmp/slipstream-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 SLIPSTREAM_REQUIRE_GPU=1
out="${OUT:-/tmp}"
export SLIPSTREAM_GPU_BENCH_JSON="$out/gpu_bench.json"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
set -o pipefail
timeout 470 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="-ra" \
    --junitxml "$out/gpu.xml" "$@" 2>&1 | tee "$out/gpu.log"
