"""ops.weights_finite against a slow reference: each element squared and summed in Python, the
tensor is healthy when that sum is a float32 number (finite and below float32's largest)."""

from __future__ import annotations

import math

import pytest
import torch

import ops

F32_MAX = float(torch.finfo(torch.float32).max)


def reference(tensors: list[torch.Tensor]) -> bool:
    for t in tensors:
        total = 0.0
        for x in t.double().flatten().tolist():
            if not math.isfinite(x):
                return False
            total += x * x
        if not total <= F32_MAX:          # the float32 sum of squares would overflow
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["healthy", "nan", "inf", "huge", "large_but_fine", "empty"])
def test_weights_finite_matches_the_reference(dtype, case):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)]
    if case == "nan":
        tensors[1][1] = float("nan")
    elif case == "inf":
        tensors[0][2, 3] = float("-inf")
    elif case == "huge" and dtype != torch.float16:      # fp16 cannot hold 1e20: that is inf
        tensors[0][0, 0] = 1e20
    elif case == "large_but_fine":
        tensors[0] *= 1000 if dtype == torch.float16 else 1e15
    elif case == "empty":
        tensors = [torch.zeros(0, dtype=dtype)]
    assert ops.weights_finite(tensors) == reference(tensors)
    assert ops.weights_finite(tensors) == (case in ("healthy", "large_but_fine", "empty")
                                           or (case == "huge" and dtype == torch.float16))


def test_fp16_weights_whose_norm_passes_fp16_range_are_healthy():
    # 1e5 elements of 100: an fp16 norm would be inf (max 65504); the float32 norm is 31623
    assert ops.weights_finite([torch.full((100_000,), 100.0, dtype=torch.float16)])
