# shellcheck shell=bash
# Sourced by the GPU scripts (run.sh, bench_async.sh) from the repository root: the carried wheels
# (.whl/, made by fetch_wheels.sh) installed aside, and the repository on the path.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/slipstream-site .whl/*.whl
    export PYTHONPATH="/tmp/slipstream-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export out="${OUT:-/tmp}"       # where the calling script writes its results
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
