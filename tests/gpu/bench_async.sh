#!/usr/bin/env bash
# Issue 12's async benchmark on one CUDA GPU: `bash tests/gpu/bench_async.sh` from the repository
# root (at most 8 min on one H200; prepared on CPU, where `--device cpu` runs the same commands). The
# learner and the HF engine share the GPU (device auto), at η = 0 and 2, on the demo's tiny model
# and on a random model of SmolLM2-135M's size with the same tokenizer (bench_async.py --body).
# TRL's GRPOTrainer is the baseline when `import trl` works here (its wheels, with datasets and
# pyarrow, are over what a device call may carry: without them the TRL rows are skipped with a
# note). Results in $OUT (or /tmp): bench_async_gpu_{tiny,smollm2}.json and .log.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/env.sh
trl=/nonexistent
if python3 -c "import trl" 2>/dev/null; then trl="$(command -v python3)"; fi
common=(--workloads demo --etas "0,2" --no-is-ablation --trl-python "$trl" --trl-threads 4
        --trl-bf16-threads 4 --trl-attn auto --skip 3 --run-timeout-s 220 "$@")
timeout 240 python3 tests/bench/bench_async.py "${common[@]}" --samples 3840 \
    --out "$out/bench_async_gpu_tiny.json" 2>&1 | tee "$out/bench_async_gpu_tiny.log" || echo "[gpu] tiny: exit $?"
timeout 240 python3 tests/bench/bench_async.py "${common[@]}" --samples 2560 --body smollm2-135m \
    --out "$out/bench_async_gpu_smollm2.json" 2>&1 | tee "$out/bench_async_gpu_smollm2.log" || echo "[gpu] smollm2: exit $?"
