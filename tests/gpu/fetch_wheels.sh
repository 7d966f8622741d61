#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64; it has torch, transformers, peft, msgpack,
# prometheus-client, pytest, numpy, safetensors but not these). Writes .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pyzmq==27.3.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 pytest-asyncio==1.5.0
