"""token_logprobs / entropy_from_logits / token_logprobs_from_hidden against loop twins."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import entropy_loop, token_logprobs_loop

from ops import entropy_from_logits, token_logprobs, token_logprobs_from_hidden


def _data(B=3, T=5, V=11, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits, tokens


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 4, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_matches_loop(chunk_size, temperature):
    logits, tokens = _data()
    out = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    ref = token_logprobs_loop(logits, tokens, temperature)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_token_logprobs_bf16_reduces_in_fp32():
    logits, tokens = _data(B=2, T=6, V=4096, dtype=torch.bfloat16, scale=8.0)
    out = token_logprobs(logits, tokens, chunk_size=3)
    assert out.dtype == torch.float32
    # Twin sees the same bf16 values, upcast to float64: only fp32-vs-fp64 reduction error remains.
    torch.testing.assert_close(out.double(), token_logprobs_loop(logits, tokens), atol=1e-4, rtol=1e-5)
    # The naive bf16 log_softmax is visibly worse than ours.
    naive = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    ref = token_logprobs_loop(logits, tokens)
    assert (out.double() - ref).abs().max() < (naive.double() - ref).abs().max()


def test_token_logprobs_float64_stays_float64_and_2d_input():
    logits, tokens = _data(B=1, T=4, dtype=torch.float64)
    out = token_logprobs(logits[0], tokens[0])
    assert out.dtype == torch.float64 and out.shape == (4,)
    torch.testing.assert_close(out, token_logprobs_loop(logits, tokens)[0])


def test_token_logprobs_non_contiguous_logits_shifted_view():
    """The usual learner call: logits[:, :-1] predicts input_ids[:, 1:] (a strided view)."""
    logits, ids = _data(B=2, T=7, V=13)
    out = token_logprobs(logits[:, :-1], ids[:, 1:], chunk_size=3)
    ref = token_logprobs_loop(logits[:, :-1].contiguous(), ids[:, 1:].contiguous())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_grad_matches_autograd_and_leaves_input_alone(temperature):
    logits, tokens = _data(B=2, T=5, V=9)
    logits.requires_grad_(True)
    before = logits.detach().clone()
    w = torch.randn(2, 5)
    (token_logprobs(logits, tokens, temperature, chunk_size=3) * w).sum().backward()
    g_fast = logits.grad.clone()
    logits.grad = None
    naive = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (naive * w).sum().backward()
    torch.testing.assert_close(g_fast, logits.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_token_logprobs_gradcheck(chunk_size):
    logits, tokens = _data(B=2, T=3, V=5, dtype=torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, 0.8, chunk_size), (logits,))


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 9),
    V=st.integers(2, 17),
    chunk=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_token_logprobs_property_shapes_and_row_permutation(B, T, V, chunk, seed):
    logits, tokens = _data(B, T, V, seed=seed)
    out = token_logprobs(logits, tokens, chunk_size=chunk)
    assert out.shape == (B, T)
    assert (out <= 1e-6).all()
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(token_logprobs(logits[perm], tokens[perm], chunk_size=chunk), out[perm])
    # Appending positions (padding columns) leaves the existing ones unchanged.
    pad_logits = torch.cat([logits, torch.randn(B, 3, V)], dim=1)
    pad_tokens = torch.cat([tokens, torch.zeros(B, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(token_logprobs(pad_logits, pad_tokens, chunk_size=chunk)[:, :T], out)


def test_token_logprobs_rejects_bad_arguments():
    logits, tokens = _data()
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens[:, :-1])
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens, chunk_size=0)


# --- entropy -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_entropy_matches_loop(chunk_size, temperature):
    logits, _ = _data()
    out = entropy_from_logits(logits, chunk_size=chunk_size, temperature=temperature)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), entropy_loop(logits, temperature), atol=1e-5, rtol=1e-5)


def test_entropy_bounds_and_masked_vocab():
    V = 8
    uniform = torch.zeros(1, 2, V)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((1, 2), torch.log(torch.tensor(8.0)).item()))
    one_hot = torch.full((1, 1, V), -float("inf"))
    one_hot[0, 0, 3] = 0.0
    assert entropy_from_logits(one_hot).item() == 0.0
    logits, _ = _data(V=V)
    logits[..., :3] = -float("inf")  # a vocabulary mask: 0·(−inf) must count as 0, not NaN
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out.double(), entropy_loop(logits), atol=1e-5, rtol=1e-5)


def test_entropy_grad_and_gradcheck():
    logits, _ = _data(B=2, T=3, V=6, dtype=torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, 2, 0.9), (logits,))
    w = torch.randn(2, 3, dtype=torch.float64)
    (entropy_from_logits(logits) * w).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    p = torch.softmax(logits, -1)
    (-(p * torch.log_softmax(logits, -1)).sum(-1) * w).sum().backward()
    torch.testing.assert_close(g, logits.grad)


# --- from hidden -------------------------------------------------------------------------------------

def _hidden(B=2, T=5, H=6, V=13, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, tokens


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_from_hidden_matches_logits_path(chunk_size, temperature):
    hidden, weight, tokens = _hidden()
    out = token_logprobs_from_hidden(hidden, weight, tokens, temperature=temperature, chunk_size=chunk_size)
    ref = token_logprobs_loop(hidden.double() @ weight.double().T, tokens, temperature)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_from_hidden_gradcheck():
    hidden, weight, tokens = _hidden(B=2, T=3, H=4, V=7, dtype=torch.float64)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs_from_hidden(h, w, tokens, 0.8, chunk_size=2), (hidden, weight)
    )
    # Only one input needing grad (frozen head, or frozen trunk) also works.
    frozen = weight.detach()
    assert torch.autograd.gradcheck(lambda h: token_logprobs_from_hidden(h, frozen, tokens, 1.0, 4), (hidden,))


def test_from_hidden_grads_match_autograd_fp32_and_bf16():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        hidden, weight, tokens = _hidden(B=2, T=4, H=8, V=32, dtype=dtype)
        h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        up = torch.randn(2, 4)
        (token_logprobs_from_hidden(h1, w1, tokens, chunk_size=3) * up).sum().backward()
        h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
        naive = torch.log_softmax(h2 @ w2.T, -1).gather(-1, tokens[..., None]).squeeze(-1)
        (naive * up.double()).sum().backward()
        assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
        torch.testing.assert_close(h1.grad.double(), h2.grad, atol=tol, rtol=tol)
        torch.testing.assert_close(w1.grad.double(), w2.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_with_masked_vocabulary(temperature):
    """−inf logits (a vocabulary mask): finite log-probs elsewhere, −inf for a masked token,
    and the same gradients as autograd through log_softmax."""
    logits, tokens = _data(B=2, T=3, V=7)
    logits[..., 5:] = -float("inf")
    tokens[0, 1] = 6  # a token the mask forbids
    logits.requires_grad_(True)
    out = token_logprobs(logits, tokens, temperature, chunk_size=2)
    assert out[0, 1] == -float("inf")
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = False
    ref = torch.log_softmax(logits.detach().double() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(out.detach().double()[keep], ref[keep], atol=1e-5, rtol=1e-5)
    w = torch.randn(2, 3)
    g_fast = torch.autograd.grad((out[keep] * w[keep]).sum(), logits)[0]
    naive = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    g_ref = torch.autograd.grad((naive[keep] * w[keep]).sum(), logits)[0]
    assert torch.isfinite(g_fast).all()
    torch.testing.assert_close(g_fast, g_ref, atol=1e-6, rtol=1e-5)


def test_token_logprobs_grad_through_shifted_view():
    logits, ids = _data(B=2, T=6, V=9)
    logits.requires_grad_(True)
    w = torch.randn(2, 5)
    g_fast = torch.autograd.grad((token_logprobs(logits[:, :-1], ids[:, 1:], chunk_size=4) * w).sum(), logits)[0]
    naive = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    g_ref = torch.autograd.grad((naive * w).sum(), logits)[0]
    torch.testing.assert_close(g_fast, g_ref, atol=1e-6, rtol=1e-5)
    assert (g_fast[:, -1] == 0).all()
