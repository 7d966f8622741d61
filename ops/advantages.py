"""Advantage estimators: GAE, group-relative (GRPO / Dr. GRPO / RLOO), REINFORCE++, V-trace.

Mask semantics (shared by ``gae``, ``reinforce_pp_advantages`` and ``vtrace``): the counted tokens
of a row form its trajectory, in order; masked positions (left/right padding, or tool/observation
tokens inside a multi-turn completion) are *skipped*: the recursion passes through them without
decaying and without reading their rewards or values, exactly as if they were cut out of the row.
So left padding, right padding and interior holes all give, on the counted tokens, the values of
the compacted unpadded sequence. Results at masked positions are 0. The value after the last
counted token is 0 (a completion ends its episode). This is verl's multi-turn GAE
(``core_algos.compute_gae_advantage_return``, "skip values and TD-error on observation tokens").
"""

from __future__ import annotations

import torch

from .kl import LOG_RATIO_CLAMP
from .masked import compute_dtype, masked_whiten
from .names import ADVANTAGE_METHODS, GROUP_ADVANTAGE_METHODS

__all__ = [
    "ADVANTAGE_METHODS",
    "GROUP_ADVANTAGE_METHODS",
    "discounted_reverse_cumsum",
    "gae",
    "group_advantages",
    "reinforce_pp_advantages",
    "returns_to_go",
    "vtrace",
]


# Block length of the time axis in ``discounted_reverse_cumsum`` (an L×L discount matrix per block).
_BLOCK = 32


def _discount_matrix(length: int, g: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """M[j, i] = g^(j − i) for j ≥ i else 0 ([L, L]), so (x @ M)[i] = Σ_{j≥i} g^(j−i) x_j."""
    idx = torch.arange(length, device=device)
    e = idx.unsqueeze(1) - idx.unsqueeze(0)  # [L, L] j − i
    powers = torch.pow(torch.tensor(g, dtype=torch.float64, device=device), e.clamp(min=0).to(torch.float64))
    return torch.where(e >= 0, powers, torch.zeros_like(powers)).to(dtype)


def discounted_reverse_cumsum(x: torch.Tensor, g: float, block: int = _BLOCK) -> torch.Tensor:
    """y_t = Σ_{s≥t} g^(s−t) x_s along the last axis (y_t = x_t + g·y_{t+1}, y_T = 0): [B, T] -> [B, T].

    Blocked solve instead of a Python loop over T: the time axis is cut into blocks of L; inside each
    block y = x @ M with the L×L discount matrix M (one batched GEMM); the value at each block start
    is carried into the previous block with weight g^(L−i), and those carries obey the same
    recursion with g^L, solved recursively over the T/L block heads. O(B·T·L) flops, O(log_L T) Python
    steps. (The associative-scan view of linear recurrences: Blelloch 1990; Martin & Cundy 2018.)
    """
    B, T = x.shape
    if T == 0:
        return x.clone()
    if T <= block:
        return x @ _discount_matrix(T, g, x.dtype, x.device)
    nb = -(-T // block)
    if nb * block != T:
        x = torch.cat([x, x.new_zeros(B, nb * block - T)], dim=1)
    local = x.reshape(B, nb, block) @ _discount_matrix(block, g, x.dtype, x.device)  # [B, nb, L]
    heads = discounted_reverse_cumsum(local[..., 0], g**block, block)  # [B, nb] y at each block start
    carry = torch.cat([heads[:, 1:], heads.new_zeros(B, 1)], dim=1)  # [B, nb] y at the next block start
    decay = torch.pow(
        torch.tensor(g, dtype=torch.float64, device=x.device),
        torch.arange(block, 0, -1, dtype=torch.float64, device=x.device),
    ).to(x.dtype)  # [L] g^(L−i)
    local.add_(carry.unsqueeze(-1) * decay)  # [B, nb, L]
    return local.view(B, nb * block)[:, :T]


def _has_holes(keep: torch.Tensor) -> bool:
    """True when some row's counted tokens are not one contiguous run."""
    starts = keep[:, 0].to(torch.int64) + (keep[:, 1:] > keep[:, :-1]).sum(1)  # [B] runs per row
    return bool((starts > 1).any())


def _compact_index(keep: torch.Tensor) -> torch.Tensor:
    """Position of each counted token in its compacted row ([B, T] int64; −1 before the first)."""
    return keep.to(torch.int64).cumsum(1) - 1


def _compact(x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Move each row's counted entries to the left, in order, zeros after: [B, T] -> [B, T]."""
    B, T = x.shape
    dst = torch.where(keep, pos, torch.full_like(pos, T))  # masked entries go to a dump column
    out = x.new_zeros(B, T + 1).scatter_(1, dst, torch.where(keep, x, torch.zeros_like(x)))
    return out[:, :T]


def _uncompact(y: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, y.gather(1, pos.clamp(min=0)), torch.zeros_like(y))


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) -> (advantages, returns), both [B, T].

    δ_t = r_t + γ V_{t+1} − V_t,   A_t = Σ_{s≥t} (γλ)^{s−t} δ_s,   R_t = A_t + V_t
    over the counted tokens of each row (module docstring: masked positions are skipped, V after the
    last counted token is 0, outputs at masked positions are 0). No whitening: apply
    ``masked_whiten(advantages, mask)`` if wanted. Computed without a Python loop over time
    (``discounted_reverse_cumsum``); equal to the reverse loop of verl / the seeds up to rounding.
    token_rewards, values, mask: [B, T]; float32 results (float64 for float64 inputs).
    """
    cdt = compute_dtype(torch.promote_types(token_rewards.dtype, values.dtype))
    if token_rewards.shape[-1] == 0:
        empty = torch.zeros(token_rewards.shape, dtype=cdt, device=token_rewards.device)
        return empty, empty.clone()
    keep = mask.bool()  # [B, T] (same as mask != 0)
    r = torch.where(keep, token_rewards.to(cdt), 0.0)
    v = v_full = torch.where(keep, values.to(cdt), 0.0)
    holes = _has_holes(keep)
    if holes:  # interior masked tokens: cut them out, solve, put the results back
        pos = _compact_index(keep)
        r, v = _compact(r, keep, pos), _compact(v, keep, pos)
    # δ_t = r_t + γ V_{t+1} − V_t. With padding zeroed, trailing pads make V_{last+1} = 0 and
    # leading pads are never read (the recursion runs backwards from the end).
    delta = r - v  # [B, T]
    delta[:, :-1].add_(v[:, 1:], alpha=gamma)
    adv = discounted_reverse_cumsum(delta, gamma * lam)  # [B, T]
    adv = _uncompact(adv, keep, pos) if holes else torch.where(keep, adv, 0.0)
    returns = adv + v_full  # both 0 at masked positions
    return adv, returns


def group_advantages(
    scores: torch.Tensor, group_size: int, method: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages for groups of ``group_size`` samples stored contiguously: [N] -> [N].

    - ``grpo``:    (r − mean_g) / (std_g + eps)   (Shao et al. 2024, DeepSeekMath; unbiased std as
                   TRL/verl; a group of one gets 0)
    - ``dr_grpo``: r − mean_g                      (Liu et al. 2025, "Understanding R1-Zero-like
                   training": no std normalization)
    - ``rloo``:    r − mean of the other G − 1 = G/(G − 1)·(r − mean_g)   (Ahmadian et al. 2024;
                   Kool et al. 2019; a group of one gets 0)
    """
    if method not in GROUP_ADVANTAGE_METHODS:
        raise ValueError(f"unknown group advantage method {method!r}; expected one of {GROUP_ADVANTAGE_METHODS}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores cannot be split into groups of {group_size}")
    cdt = compute_dtype(scores.dtype)
    s = scores.to(cdt).reshape(-1, group_size)  # [N/G, G]
    centered = s - s.mean(dim=-1, keepdim=True)  # [N/G, G]
    if group_size == 1 and method != "dr_grpo":
        return torch.zeros_like(centered).reshape(scores.shape)
    if method == "grpo":
        adv = centered / (s.std(dim=-1, keepdim=True) + eps)
    elif method == "rloo":
        adv = centered * (group_size / (group_size - 1))
    else:
        adv = centered
    return adv.reshape(scores.shape)


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over the counted tokens (masked positions skipped, 0 there): [B, T]."""
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0)
    return returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262; verl
    ``compute_reinforce_plus_plus_outcome_advantage``): [B, T] -> [B, T].

    Returns-to-go G_t = Σ_{s≥t} γ^{s−t} r_s over the counted tokens (``returns_to_go``), then
    whitened over the whole batch: masked_whiten(G, mask) (global normalization, no critic).
    0 at masked positions.
    """
    return masked_whiten(returns_to_go(token_rewards, mask, gamma), mask)


def _reverse_linear_scan(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """y_t = x_t + a_t · y_{t+1} (y_T = 0) along the last axis with ⌈log2 T⌉ vectorized doubling steps
    (Hillis–Steele scan of the affine maps y ↦ x + a·y). Works for any coefficients (zeros included)."""
    y, A = x.clone(), a.clone()
    T, k = x.shape[-1], 1
    while k < T:
        y_next = torch.nn.functional.pad(y[..., k:], (0, k))  # y_{t+k} (0 past the end)
        a_next = torch.nn.functional.pad(A[..., k:], (0, k))
        y = y + A * y_next
        A = A * a_next
        k *= 2
    return y


def _next_counted(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x at the next counted position after t (0 when there is none): [B, T] -> [B, T]."""
    B, T = keep.shape
    idx = torch.where(keep, torch.arange(T, device=keep.device).expand(B, T), T)  # [B, T]
    after = torch.cat([idx[:, 1:], idx.new_full((B, 1), T)], dim=1)
    nxt = after.flip(1).cummin(1).values.flip(1)  # [B, T] min counted index > t (T: none)
    return torch.cat([x, x.new_zeros(B, 1)], dim=1).gather(1, nxt)


@torch.no_grad()
def vtrace(
    behavior_logprobs: torch.Tensor,
    target_logprobs: torch.Tensor,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace off-policy value targets (Espeholt et al. 2018, IMPALA, eq. 1) -> (value_targets,
    pg_advantages), both [B, T], for training a critic on stale data.

    ρ_t = min(ρ̄, π_t/μ_t),  c_t = min(c̄, π_t/μ_t),  δ_t = ρ_t (r_t + γ V_{t+1} − V_t)
    v_s = V_s + Σ_{t≥s} γ^{t−s} (Π_{i=s}^{t−1} c_i) δ_t         (v_s − V_s = δ_s + γ c_s (v_{s+1} − V_{s+1}))
    pg_advantage_s = ρ_s (r_s + γ v_{s+1} − V_s)
    μ = behavior (engine) log-probs, π = target log-probs (e.g. the proximal recompute); log-ratios
    clamped to [−20, 20]; masked positions skipped as in ``gae``; V and v after the last counted token
    are 0. Vectorized with a log-depth scan (coefficients vary per token).
    """
    cdt = compute_dtype(torch.promote_types(token_rewards.dtype, values.dtype))
    if token_rewards.shape[-1] == 0:
        empty = torch.zeros(token_rewards.shape, dtype=cdt, device=token_rewards.device)
        return empty, empty.clone()
    keep = mask != 0  # [B, T]
    log_rho = torch.clamp(target_logprobs.to(cdt) - behavior_logprobs.to(cdt), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(torch.where(keep, log_rho, 0.0))  # [B, T]
    rho_clip = torch.clamp(rho, max=rho_bar)
    c = torch.clamp(rho, max=c_bar)
    r = torch.where(keep, token_rewards.to(cdt), 0.0)
    v = torch.where(keep, values.to(cdt), 0.0)
    v_next = _next_counted(v, keep)  # V at the next counted token
    delta = torch.where(keep, rho_clip * (r + gamma * v_next - v), 0.0)
    coef = torch.where(keep, gamma * c, 1.0)  # masked positions pass the carry through unchanged
    corr = _reverse_linear_scan(delta, coef)  # v_s − V_s at counted s
    corr_next = torch.cat([corr[:, 1:], corr.new_zeros(corr.shape[0], 1)], dim=1)  # = corr at next counted
    targets = torch.where(keep, v + corr, 0.0)
    pg_adv = torch.where(keep, rho_clip * (r + gamma * (v_next + corr_next) - v), 0.0)
    return targets, pg_adv


