"""Token log-probabilities and entropies without materializing float32 ``[B, T, V]`` tensors.

log π(y_t | x, y_<t) = z_t[y_t]/τ − logsumexp_v(z_t[v]/τ)                      (z = logits, τ = temperature)
H_t = −Σ_v p_v log p_v,  p = softmax(z_t/τ)

The naive ``log_softmax(logits.float(), -1).gather(-1, tokens)`` allocates a float32 copy of the whole
``[B, T, V]`` logits (1 GiB at B=8, T=1024, V=32768). Here the vocabulary reduction runs over chunks of
``chunk_size`` tokens: each chunk is upcast to float32 (the reduction is always fp32, also for bf16
logits), reduced (``log_softmax``, or an in-place logsumexp on our own float32 copy) and the target
gathered; only one ``[chunk, V]`` temporary exists at any time. This is the "selective log-softmax" of TRL (``trl/trainer/utils.py::selective_log_softmax``)
and the chunked cross-entropy of Liger-Kernel / Apple's Cut-Cross-Entropy (Wijmans et al. 2024) done
with plain torch ops. The backward passes are custom autograd Functions that recompute ``softmax`` per
chunk from the saved float32 ``logsumexp`` ([B, T]); the only ``[B, T, V]`` tensor they allocate is the
gradient itself.

``token_logprobs_from_hidden`` goes one step further (as Cut-Cross-Entropy): it never builds the logits,
recomputing ``hidden_chunk @ W.T`` per chunk in the forward and again in the backward.

Shapes: logits ``[B, T, V]`` (or ``[N, V]``) with ``logits[:, t]`` predicting ``tokens[:, t]``; tokens
``[B, T]`` int; results ``[B, T]`` float32 (float64 when the inputs are float64).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .masked import compute_dtype

__all__ = ["entropy_from_hidden", "entropy_from_logits", "token_logprobs", "token_logprobs_from_hidden"]

# Default chunk: about 1 Mi elements (4 MiB of float32) per temporary. Measured on CPU: chunks of
# 1-4 Mi elements run 2-3x faster than one [T, V] row at a time (cache reuse across the passes, and
# far below glibc's 32 MiB mmap threshold, so temporaries are recycled instead of page-faulted in
# anew); 1 Mi was the fastest for bf16 input (fp32 copy + log_softmax output per chunk).
_CHUNK_ELEMENTS = 1 << 20


def _auto_chunk(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    return int(chunk_size)


def _chunks(batch: int, seq: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, time slice) pairs covering [batch, seq] with about ``rows`` tokens each.

    Slicing the [B, T, V] tensor this way only makes views, so a non-contiguous input (e.g.
    ``logits[:, :-1]``) is never copied as a whole.
    """
    if seq <= rows:
        per = max(1, rows // max(seq, 1))
        for b0 in range(0, batch, per):
            yield slice(b0, b0 + per), slice(0, seq)
    else:
        for b in range(batch):
            for t0 in range(0, seq, rows):
                yield slice(b, b + 1), slice(t0, t0 + rows)


def _as_3d(logits: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """View ``[..., T, V]`` logits as [B, T, V] (and tokens as [B, T])."""
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
    lead = logits.shape[:-1]
    if tokens is not None and tokens.shape != lead:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match logits {tuple(logits.shape)}")
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
        tokens = None if tokens is None else tokens.unsqueeze(0)
    elif logits.dim() > 3:
        logits = logits.reshape(-1, logits.shape[-2], logits.shape[-1])
        tokens = None if tokens is None else tokens.reshape(-1, tokens.shape[-1])
    return logits, tokens


def _scaled(chunk: torch.Tensor, dtype: torch.dtype, temperature: float, owned: bool = False) -> torch.Tensor:
    """chunk.to(dtype) / temperature; a new tensor when needed, or always when ``owned`` is set
    (the caller will modify the result in place and must not write into the input)."""
    x = chunk.to(dtype)
    if temperature != 1.0:
        return x / temperature if x is chunk else x.div_(temperature)
    if owned and x is chunk:
        x = x.clone()
    return x


def _logits_chunk(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """(h @ W.T).to(dtype) / τ for a chunk of hidden states [n, H] -> [n, V]; scaled in place (the
    matmul result is ours), so at most the matmul output and its float32 copy ever coexist."""
    z = (h @ weight.T).to(dtype)  # [n, V]
    return z.div_(temperature) if temperature != 1.0 else z


def _logsumexp(x: torch.Tensor, owned: bool) -> torch.Tensor:
    """logsumexp over the last axis with one temporary (none when ``owned``: x is overwritten).

    max-shifted: m + log Σ exp(x − m); rows that are all −inf give −inf.
    """
    m = x.amax(dim=-1, keepdim=True)  # [..., 1]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    y = x.sub_(m) if owned else x - m  # [..., V]
    return y.exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


def _check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


class _TokenLogprobs(torch.autograd.Function):
    """log p(tokens) from logits [B, T, V]; saves only logits (a reference) and lse [B, T] (fp32)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int):
        B, T, _ = logits.shape
        cdt = compute_dtype(logits.dtype)
        out = torch.empty(B, T, dtype=cdt, device=logits.device)  # [B, T]
        lse = torch.empty(B, T, dtype=cdt, device=logits.device)  # [B, T]
        for bs, ts in _chunks(B, T, rows):
            chunk = logits[bs, ts]  # [b, t, V] view
            x = _scaled(chunk, cdt, temperature)  # [b, t, V] fp32 (a copy for bf16 or τ != 1)
            idx = tokens[bs, ts].unsqueeze(-1)  # [b, t, 1]
            if x is not chunk:
                # Our own fp32 copy: reduce it in place (no second [chunk, V] buffer).
                target = x.gather(-1, idx).squeeze(-1)  # [b, t]
                lse_c = _logsumexp(x, owned=True)  # [b, t]; overwrites x
                selected = target - lse_c
            else:
                # A view of fp32 logits: one fused, vectorized log_softmax kernel (fewer passes and
                # thread barriers than max / sub / exp / sum); lse recovered as z[y] − log p(y).
                logp = torch.log_softmax(x, dim=-1)  # [b, t, V]
                selected = logp.gather(-1, idx).squeeze(-1)  # [b, t]
                del logp
                lse_c = x.gather(-1, idx).squeeze(-1) - selected  # [b, t]
                bad = ~torch.isfinite(lse_c)  # the token has a −inf logit: compute lse directly
                if bool(bad.any()):
                    lse_c = torch.where(bad, _logsumexp(x, owned=False), lse_c)
            del x  # free before the next chunk is allocated (peak: one chunk)
            out[bs, ts] = selected
            lse[bs, ts] = lse_c
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        tau, (B, T, _) = ctx.temperature, logits.shape
        cdt = lse.dtype
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        in_place = grad.dtype == cdt  # fp32/fp64: compute straight into the gradient buffer
        for bs, ts in _chunks(B, T, ctx.rows):
            chunk = logits[bs, ts]  # [b, t, V]
            if in_place:
                gl = grad[bs, ts]  # a view of the output buffer
                if tau != 1.0:
                    torch.div(chunk, tau, out=gl)
                else:
                    gl.copy_(chunk)
            else:
                gl = _scaled(chunk, cdt, tau, owned=True)  # [b, t, V] fp32 copy
            g = grad_out[bs, ts].to(cdt).unsqueeze(-1)  # [b, t, 1]
            # d/dz_v log p(y) = (1[v = y] − p_v) / τ
            gl.sub_(lse[bs, ts].unsqueeze(-1)).exp_()  # softmax [b, t, V]
            gl.mul_(-g).scatter_add_(-1, tokens[bs, ts].unsqueeze(-1), g)
            if tau != 1.0:
                gl.div_(tau)
            if not in_place:
                grad[bs, ts] = gl
            del gl
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each token: ``log_softmax(logits / τ)[..., tokens]`` -> [B, T] float32.

    logits: [B, T, V] (any float dtype, any strides; ``logits[:, t]`` predicts ``tokens[:, t]``);
    tokens: [B, T] integer ids in [0, V) at every position (use the pad id, not −100, at padding;
    mask the result afterwards). ``chunk_size`` is the number of tokens reduced at once
    (None: about 1 Mi logits per chunk). The reduction is float32 per chunk (numerically safe for
    bf16 logits); peak extra memory is O(chunk_size · V), not O(B · T · V). Differentiable w.r.t.
    ``logits`` (custom backward, recomputes the softmax per chunk).

    Source: TRL ``selective_log_softmax``; temperature scaling as in verl/vLLM (logits / τ).
    """
    temperature = _check_temperature(temperature)
    logits3, tokens3 = _as_3d(logits, tokens)
    rows = _auto_chunk(chunk_size, logits3.shape[-1])
    out = _TokenLogprobs.apply(logits3, tokens3.long(), temperature, rows)
    return out.reshape(tokens.shape)


class _EntropyFromLogits(torch.autograd.Function):
    """H(softmax(logits/τ)) per position; saves logits (a reference), lse and H ([B, T] fp32)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float, rows: int):
        B, T, _ = logits.shape
        cdt = compute_dtype(logits.dtype)
        ent = torch.empty(B, T, dtype=cdt, device=logits.device)  # [B, T]
        lse = torch.empty(B, T, dtype=cdt, device=logits.device)  # [B, T]
        for bs, ts in _chunks(B, T, rows):
            x = _scaled(logits[bs, ts], cdt, temperature, owned=True)  # [b, t, V], a private copy
            m = x.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # [b, t, 1]
            y = x.sub_(m)  # z − max
            p = torch.exp(y)  # unnormalized, [b, t, V]
            log_s = p.sum(dim=-1, keepdim=True).log_()  # [b, t, 1]
            logp = y.sub_(log_s)  # log softmax
            torch.exp(logp, out=p)
            # −Σ p log p: a sum of non-negative terms (no cancellation, unlike lse − Σ p·z);
            # −inf logits (a vocabulary mask) give 0·(−inf) = NaN, counted as 0.
            ent[bs, ts] = -p.mul_(logp).nan_to_num_(nan=0.0).sum(dim=-1)
            lse[bs, ts] = (m + log_s).squeeze(-1)
            del x, y, p, logp
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature, ctx.rows = temperature, rows
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        tau, (B, T, _) = ctx.temperature, logits.shape
        cdt = lse.dtype
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for bs, ts in _chunks(B, T, ctx.rows):
            x = _scaled(logits[bs, ts], cdt, tau, owned=True)  # [b, t, V], a private copy
            logp = x.sub_(lse[bs, ts].unsqueeze(-1))  # [b, t, V]
            p = torch.exp(logp)
            # dH/dz_v = −p_v (log p_v + H) / τ   (p_v = 0 at −inf logits: 0·(−inf) = NaN -> 0)
            gl = logp.add_(ent[bs, ts].unsqueeze(-1)).mul_(p).neg_().nan_to_num_(nan=0.0)
            gl.mul_(grad_out[bs, ts].to(cdt).unsqueeze(-1))
            if tau != 1.0:
                gl.div_(tau)
            grad[bs, ts] = gl
            del x, logp, p, gl
        return grad, None, None


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy of softmax(logits / τ) at every position: logits [B, T, V] -> [B, T] float32.

    H = −Σ_v p_v log p_v with log p = z − logsumexp(z) (z = logits/τ), reduced in float32 per chunk of
    ``chunk_size`` tokens (None: automatic), so no float32 [B, T, V] copy is made. Differentiable
    (custom backward: dH/dz_v = −p_v (log p_v + H)). Source: verl ``entropy_from_logits``.
    """
    temperature = _check_temperature(temperature)
    logits3, _ = _as_3d(logits, None)
    rows = _auto_chunk(chunk_size, logits3.shape[-1])
    return _EntropyFromLogits.apply(logits3, temperature, rows).reshape(logits.shape[:-1])


class _TokenLogprobsFromHidden(torch.autograd.Function):
    """log p(tokens) from hidden [N, H] and W [V, H]; logits exist one chunk at a time, also in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int):
        N = hidden.shape[0]
        cdt = compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        out = torch.empty(N, dtype=cdt, device=hidden.device)  # [N]
        lse = torch.empty(N, dtype=cdt, device=hidden.device)  # [N]
        for i in range(0, N, rows):
            z = _logits_chunk(hidden[i : i + rows], weight, cdt, temperature)  # [n, V]
            selected = z.gather(-1, tokens[i : i + rows].unsqueeze(-1)).squeeze(-1)  # [n]
            lse_c = _logsumexp(z, owned=True)  # [n]; overwrites z
            out[i : i + rows] = selected - lse_c
            del z
            lse[i : i + rows] = lse_c
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, tokens, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        tau, rows, cdt = ctx.temperature, ctx.rows, lse.dtype
        N = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # dW is accumulated over chunks in (at least) float32, then cast to the weight dtype.
        grad_w = torch.zeros(weight.shape, dtype=compute_dtype(weight.dtype), device=weight.device) if need_w else None
        for i in range(0, N, rows):
            h = hidden[i : i + rows]  # [n, H]
            z = _logits_chunk(h, weight, cdt, tau)  # [n, V]
            g = grad_out[i : i + rows].to(cdt).unsqueeze(-1)  # [n, 1]
            gz = z.sub_(lse[i : i + rows].unsqueeze(-1)).exp_()  # softmax [n, V]
            gz.mul_(-g).scatter_add_(-1, tokens[i : i + rows].unsqueeze(-1), g)
            if tau != 1.0:
                gz.div_(tau)  # dlogp/dlogits [n, V]
            if need_h:
                grad_h[i : i + rows] = gz.to(weight.dtype) @ weight  # [n, H]
            if need_w:
                grad_w.addmm_(gz.T, h.to(grad_w.dtype))  # [V, H]
            del z, gz
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """log_softmax(hidden @ W.T / τ)[tokens] without ever holding the [B, T, V] logits -> [B, T].

    hidden: [B, T, H] final hidden states (after the last norm); lm_head_weight W: [V, H];
    tokens: [B, T]. Logits exist ``chunk_size`` tokens at a time (matmul in the input dtype, softmax
    reduction in float32). Backward recomputes each chunk's logits (Cut-Cross-Entropy, Wijmans et al.
    2024; Liger-Kernel fused linear cross-entropy): dL/dh = G @ W, dL/dW = Σ_chunks Gᵀ @ h with
    G = (onehot(y) − softmax) · g / τ, accumulated in float32. Peak extra memory O(chunk_size · V).
    """
    temperature = _check_temperature(temperature)
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match hidden {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[-1]}], got {tuple(lm_head_weight.shape)}"
        )
    if chunk_size is None:
        chunk_size = _auto_chunk(None, lm_head_weight.shape[0])
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_t = tokens.reshape(-1).long()  # [N]
    out = _TokenLogprobsFromHidden.apply(flat_h, lm_head_weight, flat_t, temperature, int(chunk_size))
    return out.reshape(tokens.shape)


def entropy_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Entropy of softmax(hidden @ W.T / τ) at every position -> [B, T] float32, logits one chunk
    of ``chunk_size`` tokens at a time (the twin of :func:`token_logprobs_from_hidden`).

    Each chunk's logits go through :func:`entropy_from_logits` (float32 reduction). Under
    ``torch.no_grad`` (entropy as a statistic) a chunk's logits are freed before the next one is
    built: peak extra memory O(chunk_size · V). With gradients, autograd keeps every chunk's
    logits for the backward, as the logits path would: use it for an entropy bonus only when the
    [B, T, V] logits fit.
    """
    temperature = _check_temperature(temperature)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[-1]}], got {tuple(lm_head_weight.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    parts = [entropy_from_logits(flat_h[i : i + chunk_size] @ lm_head_weight.T, temperature=temperature)
             for i in range(0, flat_h.shape[0], chunk_size)]  # each [n]
    if not parts:
        return torch.zeros(hidden.shape[:-1], dtype=compute_dtype(hidden.dtype), device=hidden.device)
    return torch.cat(parts).reshape(hidden.shape[:-1])
