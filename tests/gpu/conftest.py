"""The GPU group (``-m gpu``): skipped where torch sees no CUDA device, a failure instead when
``SLIPSTREAM_REQUIRE_GPU=1`` (tests/gpu/run.sh sets it, so a GPU machine that cannot run them says so)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    if os.environ.get("SLIPSTREAM_REQUIRE_GPU") == "1":
        raise pytest.UsageError("SLIPSTREAM_REQUIRE_GPU=1 but torch sees no CUDA device")
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu/run.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
