"""entropy_from_hidden against the loop twin (float64), in chunks and under no_grad."""

from __future__ import annotations

import pytest
import torch
from ops_twins import entropy_loop

from ops import entropy_from_hidden


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_from_hidden_matches_the_loop_over_full_logits(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 6, generator=g)
    weight = torch.randn(13, 6, generator=g)
    out = entropy_from_hidden(hidden, weight, temperature=temperature, chunk_size=chunk_size)
    ref = entropy_loop(hidden.double() @ weight.double().T, temperature)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_entropy_from_hidden_gradient_matches_the_logits_path():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    entropy_from_hidden(hidden, weight, chunk_size=3).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    z = hidden @ weight.T
    (-(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)).sum().backward()
    assert torch.allclose(gh, hidden.grad, atol=1e-10) and torch.allclose(gw, weight.grad, atol=1e-10)


def test_entropy_from_hidden_in_bf16_reduces_in_float32():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 4, 8, generator=g).to(torch.bfloat16)
    weight = torch.randn(11, 8, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        out = entropy_from_hidden(hidden, weight, chunk_size=5)
    ref = entropy_loop((hidden.double() @ weight.double().T), 1.0)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, atol=0.1)
