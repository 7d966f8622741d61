#!/usr/bin/env bash
# The GPU group on one CUDA machine: `bash tests/gpu/run.sh` from the repository root (< 8 min on
# one H200). Packages the machine lacks (pyzmq, pydantic, pytest-asyncio, ...) travel as wheels in
# .whl/: `bash tests/gpu/fetch_wheels.sh` makes them on a machine with PyPI. Results go to $OUT
# (or /tmp): gpu.log, gpu.xml (JUnit) and gpu_bench.json (the speed figures the tests print).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/env.sh
export SLIPSTREAM_REQUIRE_GPU=1 SLIPSTREAM_GPU_BENCH_JSON="$out/gpu_bench.json"
set -o pipefail
timeout 470 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="-ra" \
    --junitxml "$out/gpu.xml" "$@" 2>&1 | tee "$out/gpu.log"
