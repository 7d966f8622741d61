"""Per-token log-probs (and entropies) of a Hugging Face causal LM without its ``[B, T, V]`` logits.

    log π(y_t) = log_softmax(h_t @ Wᵀ / τ)[y_t]      h: the decoder's last hidden state (after the
                                                     final norm), W: the LM head's weight

The model is called as usual (``model(...)``: hooks, PEFT adapters, gradient checkpointing all
apply) with ``logits_to_keep`` an empty index, so its head computes logits for no position; the
decoder's last hidden state is taken with a forward hook, and ``ops.token_logprobs_from_hidden``
builds the logits ``chunk_size`` tokens at a time, in the forward and again in its backward. At
SmolLM2-135M's vocabulary (49,152) a micro-batch of 32 × 512 tokens would hold 3 GiB of float32
logits (and as much again for their gradient); here one chunk is 0.2 GiB.

This path is used only where it computes the same function as ``model(...).logits``: the head is a
plain ``nn.Linear`` without bias (not a LoRA layer), the forward takes ``logits_to_keep``, and a
probe at load (:func:`exact_head_weight`) finds ``h @ Wᵀ`` equal to the model's own logits —
a model that rescales or soft-caps its logits after the head (Gemma 2, Cohere, Granite) fails the
probe and keeps the logits path. Every pass of a trainer goes through the same function with the
same chunking, so a no-grad pass and a gradient forward at the same weights and rows compute the
same numbers bit for bit (the trainer's sanity check relies on it).

Mixed precision (``autocast``, ``learner.runtime.autocast``): the model's forward runs under
``torch.autocast`` in that dtype (its matrix multiplications in bfloat16; the weights, their
gradients and the optimizer stay in the training dtype), and the head's projection, the
log-softmax and the entropy run outside it, in float32, on the decoder's last hidden state (the
residual stream, which autocast leaves in float32). Logits in bfloat16 would carry an error of
about 2⁻⁸ of their size into every log-prob; the head in float32 keeps it to what the decoder's
bfloat16 matmuls cause.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

import ops

__all__ = ["LogprobForward", "exact_head_weight", "row_temperature_groups"]

CHUNK_TOKENS = 1024
"""Tokens per logits chunk (ops.token_logprobs_from_hidden's default)."""


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _call(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
          hidden_only: bool, autocast: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One forward -> (last hidden state (b, L, H) or None, logits (b, L or 0, V)); under
    ``torch.autocast(autocast)`` when given (both then come back as float32)."""
    captured: list[torch.Tensor] = []
    hook = None
    kwargs = {}
    if hidden_only:
        decoder = _base(model).get_decoder()

        def grab(module, args, out):
            captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

        hook = decoder.register_forward_hook(grab)
        kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=input_ids.device)
    mixed = (torch.autocast(input_ids.device.type, dtype=autocast) if autocast is not None
             else contextlib.nullcontext())
    try:
        with mixed:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    hidden = captured[-1] if captured else None
    if autocast is None:
        return hidden, out.logits
    return (None if hidden is None else hidden.float()), out.logits.float()


@torch.no_grad()
def exact_head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The LM head's weight W when ``model``'s logits are exactly ``h @ Wᵀ`` (probed on a few
    tokens), else None (the caller keeps the logits path)."""
    base = _base(model)
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    try:
        base.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    device = head.weight.device
    V = head.weight.shape[0]
    ids = (torch.arange(6, device=device) * 7 % V)[None]                          # (1, 6)
    attn = torch.ones_like(ids)
    training = model.training
    model.eval()
    try:
        hidden, _ = _call(model, ids, attn, hidden_only=True)
        _, logits = _call(model, ids, attn, hidden_only=False)
    except Exception:  # noqa: BLE001 - any model that cannot do it keeps the logits path
        return None
    finally:
        model.train(training)
    if hidden is None or logits.shape[1] != ids.shape[1]:
        return None
    mine = (hidden @ head.weight.T).float()
    if not torch.allclose(mine, logits.float(), rtol=1e-3, atol=1e-3 * float(logits.float().abs().max()) + 1e-6):
        return None
    return head.weight


class LogprobForward:
    """``(log π (b, L-1), entropy (b, L-1) or None)`` of right-padded rows of one model, through
    the hidden-state path when :func:`exact_head_weight` allows it, else through its logits."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = CHUNK_TOKENS,
                 autocast: torch.dtype | None = None):
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.autocast = autocast
        self.uses_hidden = exact_head_weight(model) is not None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                 temperature: float | torch.Tensor, entropy: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
        """``entropy``: ``none``, ``stat`` (detached, computed without gradients) or ``grad``.

        ``temperature``: one τ for every row, or a (b,) tensor of each row's own τ (the sampling
        temperature its completion was drawn at; :func:`row_temperature_groups`). Rows are grouped
        by τ after one model forward, so a batch at a single τ computes exactly what the scalar
        call does."""
        groups = row_temperature_groups(temperature, int(input_ids.shape[0]))
        if self.uses_hidden:
            hidden, _ = _call(self.model, input_ids, attention_mask, hidden_only=True,
                              autocast=self.autocast)
            h = hidden[:, :-1]                                                     # (b, L-1, H)
            w = _base(self.model).get_output_embeddings().weight                   # (V, H)
            if self.autocast is not None:
                w = w.float()
            return _by_temperature(groups, h, targets, entropy, lambda x, y, tau, ent: self._hidden_part(
                x, w, y, tau, ent))
        _, logits = _call(self.model, input_ids, attention_mask, hidden_only=False,
                          autocast=self.autocast)
        return _by_temperature(groups, logits[:, :-1], targets, entropy, _logits_part)

    def _hidden_part(self, h, w, targets, tau, entropy):
        lp = ops.token_logprobs_from_hidden(h, w, targets, temperature=tau, chunk_size=self.chunk_tokens)
        ent = None
        if entropy == "grad":
            ent = ops.entropy_from_hidden(h, w, temperature=tau, chunk_size=self.chunk_tokens)
        elif entropy == "stat":
            with torch.no_grad():
                ent = ops.entropy_from_hidden(h.detach(), w.detach(), temperature=tau,
                                              chunk_size=self.chunk_tokens)
        return lp, ent


def _logits_part(logits, targets, tau, entropy):
    lp = ops.token_logprobs(logits, targets, temperature=tau)
    ent = None
    if entropy == "grad":
        ent = ops.entropy_from_logits(logits, temperature=tau)
    elif entropy == "stat":
        with torch.no_grad():
            ent = ops.entropy_from_logits(logits.detach(), temperature=tau)
    return lp, ent


def row_temperature_groups(temperature: float | torch.Tensor, rows: int) -> list[tuple[float, torch.Tensor | None]]:
    """``[(τ, row indices or None for all rows), ...]``: the rows of each distinct temperature.

    A scalar, or a tensor whose rows all share one value, is one group over every row (None), so
    the common case takes the same path as a scalar call, bit for bit."""
    if not isinstance(temperature, torch.Tensor):
        return [(float(temperature), None)]
    t = temperature.detach().reshape(-1).to("cpu", torch.float64)
    if t.numel() != rows:
        raise ValueError(f"{t.numel()} row temperatures for {rows} rows")
    values = torch.unique(t)
    if values.numel() == 1:
        return [(float(values[0]), None)]
    return [(float(v), torch.nonzero(t == v).reshape(-1)) for v in values]


def _by_temperature(groups, x: torch.Tensor, targets: torch.Tensor, entropy: str, part):
    """``part(x_rows, targets_rows, τ, entropy)`` per temperature group, put back in row order."""
    if len(groups) == 1:
        return part(x, targets, groups[0][0], entropy)
    lps, ents, order = [], [], []
    for tau, idx in groups:
        idx = idx.to(x.device)
        lp, ent = part(x[idx], targets[idx], tau, entropy)
        lps.append(lp)
        ents.append(ent)
        order.append(idx)
    inverse = torch.argsort(torch.cat(order))            # rows back in their order (differentiable)
    lp = torch.cat(lps)[inverse]
    ent = None if ents[0] is None else torch.cat(ents)[inverse]
    return lp, ent
