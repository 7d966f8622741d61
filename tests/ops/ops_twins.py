"""Slow, obviously-correct twins of the optimized ``ops`` functions: Python loops over rows and
tokens, float64, straight from the formulas. Tests compare the fast versions against these."""

from __future__ import annotations

import math

import torch


def _rows(mask: torch.Tensor) -> list[list[int]]:
    """Counted positions of each row, in order."""
    return [[t for t in range(mask.shape[1]) if bool(mask[b, t] != 0)] for b in range(mask.shape[0])]


# --- log-probs ---------------------------------------------------------------------------------------

def token_logprobs_loop(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    B, T, _ = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            z = logits[b, t].double() / temperature
            out[b, t] = z[tokens[b, t]] - torch.logsumexp(z, 0)
    return out


def entropy_loop(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    B, T, _ = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p = torch.softmax(logits[b, t].double() / temperature, 0)
            out[b, t] = -sum(float(pi) * math.log(float(pi)) for pi in p if pi > 0)
    return out


# --- masked statistics -------------------------------------------------------------------------------

def counted_values(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(x[b, t]) for b, ts in enumerate(_rows(mask)) for t in ts]


def masked_mean_loop(x, mask) -> float:
    vals = counted_values(x, mask)
    return sum(vals) / len(vals) if vals else 0.0


def masked_var_loop(x, mask, unbiased=True) -> float:
    vals = counted_values(x, mask)
    n = len(vals)
    if n - (1 if unbiased else 0) <= 0:
        return 0.0
    mu = sum(vals) / n
    return sum((v - mu) ** 2 for v in vals) / (n - 1 if unbiased else n)


def aggregate_loop(loss, mask, agg, norm_tokens=None) -> float:
    """``norm_tokens``: the constant of seq_mean_token_sum_norm (None: the mask's length)."""
    rows = _rows(mask)
    if agg == "token_mean":
        return masked_mean_loop(loss, mask)
    per_row = []
    for b, ts in enumerate(rows):
        if not ts:
            continue
        s = sum(float(loss[b, t]) for t in ts)
        if agg == "seq_mean_token_sum":
            per_row.append(s)
        elif agg == "seq_mean_token_sum_norm":
            per_row.append(s / (norm_tokens if norm_tokens is not None else mask.shape[1]))
        else:
            per_row.append(s / len(ts))
    return sum(per_row) / len(per_row) if per_row else 0.0


def loss_normalizer_loop(mask, agg, norm_tokens=None) -> float:
    """What the aggregation divides by, counted by hand: the mask weights (token_mean) or the rows
    with a counted token (the seq_mean modes; times the constant for seq_mean_token_sum_norm);
    1.0 when nothing is counted."""
    if agg == "token_mean":
        n = sum(float(mask[b, t]) for b, ts in enumerate(_rows(mask)) for t in ts)
    else:
        n = float(sum(1 for ts in _rows(mask) if ts))
        if agg == "seq_mean_token_sum_norm":
            n *= norm_tokens if norm_tokens is not None else mask.shape[1]
    return n if n != 0 else 1.0


# --- advantages --------------------------------------------------------------------------------------

def gae_loop(rewards, values, mask, gamma, lam):
    """verl's reverse loop over time with multi-turn masking (skip values and TD-errors on masked)."""
    B, T = rewards.shape
    m = (mask != 0).double()
    r, v = rewards.double(), values.double()
    adv = torch.zeros(B, T, dtype=torch.float64)
    lastgaelam = torch.zeros(B, dtype=torch.float64)
    nextvalues = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        adv[:, t] = lastgaelam
    adv = adv * m
    return adv, (adv + v) * m


def gae_compact_loop(rewards, values, mask, gamma, lam):
    """GAE written per row on the list of counted tokens (a second, independent twin)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b, ts in enumerate(_rows(mask)):
        a = 0.0
        for i in reversed(range(len(ts))):
            t = ts[i]
            v_next = float(values[b, ts[i + 1]]) if i + 1 < len(ts) else 0.0
            delta = float(rewards[b, t]) + gamma * v_next - float(values[b, t])
            a = delta + gamma * lam * a
            adv[b, t] = a
            ret[b, t] = a + float(values[b, t])
    return adv, ret


def returns_to_go_loop(rewards, mask, gamma):
    B, T = rewards.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b, ts in enumerate(_rows(mask)):
        g = 0.0
        for t in reversed(ts):
            g = float(rewards[b, t]) + gamma * g
            out[b, t] = g
    return out


def vtrace_sum(behavior, target, rewards, values, mask, gamma, rho_bar, c_bar):
    """V-trace straight from eq. 1 of Espeholt et al. (2018): explicit sums of products, O(T²)."""
    B, T = rewards.shape
    vs = torch.zeros(B, T, dtype=torch.float64)
    pg = torch.zeros(B, T, dtype=torch.float64)
    for b, ts in enumerate(_rows(mask)):
        n = len(ts)
        ratio = [math.exp(min(max(float(target[b, t]) - float(behavior[b, t]), -20.0), 20.0)) for t in ts]
        rho = [min(rho_bar, x) for x in ratio]
        c = [min(c_bar, x) for x in ratio]
        V = [float(values[b, t]) for t in ts] + [0.0]
        r = [float(rewards[b, t]) for t in ts]
        v_s = []
        for s in range(n):
            total = V[s]
            for t in range(s, n):
                prod = 1.0
                for i in range(s, t):
                    prod *= c[i]
                total += gamma ** (t - s) * prod * rho[t] * (r[t] + gamma * V[t + 1] - V[t])
            v_s.append(total)
        v_s.append(0.0)
        for s in range(n):
            vs[b, ts[s]] = v_s[s]
            pg[b, ts[s]] = rho[s] * (r[s] + gamma * v_s[s + 1] - V[s])
    return vs, pg


def group_advantages_loop(scores, group_size, method, eps=1e-6):
    s = [float(x) for x in scores]
    out = []
    for g0 in range(0, len(s), group_size):
        grp = s[g0 : g0 + group_size]
        n = len(grp)
        mean = sum(grp) / n
        for i, x in enumerate(grp):
            if method == "dr_grpo":
                out.append(x - mean)
            elif n == 1:
                out.append(0.0)
            elif method == "grpo":
                std = math.sqrt(sum((y - mean) ** 2 for y in grp) / (n - 1))
                out.append((x - mean) / (std + eps))
            else:  # rloo
                others = [y for j, y in enumerate(grp) if j != i]
                out.append(x - sum(others) / len(others))
    return torch.tensor(out, dtype=torch.float64)


# --- losses ------------------------------------------------------------------------------------------

def ppo_token_losses_loop(logprobs, proximal, advantages, mask, clip_low, clip_high, dual_clip, is_weights):
    B, T = logprobs.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue
            lr = min(max(float(logprobs[b, t]) - float(proximal[b, t]), -20.0), 20.0)
            r = math.exp(lr)
            a = float(advantages[b, t])
            loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            w = 1.0 if is_weights is None else float(is_weights[b, t])
            out[b, t] = w * loss
    return out


def gspo_loop(logprobs, proximal, advantages, mask, clip_low, clip_high, is_weights, agg):
    """GSPO as the paper writes it, with the sequence ratio itself in the graph (not the token
    form): s_i = exp(mean_t (log π − log π_prox)), l_t = w_t max(−A_t s_i, −A_t clip(s_i)), token by
    token in float64, aggregated like ``aggregate_loop``. Returns a 0-dim tensor with a gradient
    into ``logprobs`` (a float64 leaf the caller made)."""
    terms, rows = [], _rows(mask)
    for b, ts in enumerate(rows):
        if not ts:
            continue
        log_s = sum(logprobs[b, t] - float(proximal[b, t]) for t in ts) / len(ts)
        s = torch.exp(torch.clamp(log_s, -20.0, 20.0))
        row = []
        for t in ts:
            a = float(advantages[b, t])
            loss = torch.maximum(-a * s, -a * torch.clamp(s, 1 - clip_low, 1 + clip_high))
            row.append(loss * (1.0 if is_weights is None else float(is_weights[b, t])))
        terms.append(row)
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    if agg == "token_mean":
        flat = [x for row in terms for x in row]
        return sum(flat) / len(flat)
    per_row = [sum(row) if agg == "seq_mean_token_sum" else sum(row) / len(row) for row in terms]
    return sum(per_row) / len(per_row)


def cispo_grad_loop(logprobs, proximal, advantages, mask, clip_low, clip_high, is_weights, normalizer):
    """The CISPO gradient token by token: −w_t clip(r_t, 1 − ε_low, 1 + ε_high) A_t / normalizer
    at every counted token (float64), the clipped ones included."""
    B, T = logprobs.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue
            r = math.exp(min(max(float(logprobs[b, t]) - float(proximal[b, t]), -20.0), 20.0))
            w = 1.0 if is_weights is None else float(is_weights[b, t])
            out[b, t] = -w * min(max(r, 1 - clip_low), 1 + clip_high) * float(advantages[b, t]) / normalizer
    return out


def importance_loop(prox, behav, mask, mode, cap, veto=None, bounds=(0.5, 5.0)):
    """Returns (weights, keep) as float64 / bool tensors, per the mode definitions, token by token."""
    B, T = prox.shape
    w = torch.zeros(B, T, dtype=torch.float64)
    keep = torch.zeros(B, T, dtype=torch.bool)
    for b, ts in enumerate(_rows(mask)):
        raw = [math.exp(min(max(float(prox[b, t]) - float(behav[b, t]), -20.0), 20.0)) for t in ts]
        if mode == "geo_mis":
            geo = math.exp(sum(math.log(x) for x in raw) / len(raw)) if raw else 1.0
            vetoed = veto is not None and any(x < veto for x in raw)
            if 1.0 / cap <= geo <= cap and not vetoed:
                for t in ts:
                    w[b, t], keep[b, t] = 1.0, True
            continue
        if mode.startswith("seq"):
            geo = math.exp(sum(math.log(x) for x in raw) / len(raw)) if raw else 1.0
            raw = [geo] * len(ts)
        for t, x in zip(ts, raw, strict=True):
            if mode == "none":
                w[b, t], keep[b, t] = 1.0, True
            elif mode.endswith("tis"):
                w[b, t], keep[b, t] = min(x, cap), True
            elif mode == "icepop":
                if bounds[0] <= x <= bounds[1]:
                    w[b, t], keep[b, t] = x, True
            elif 1.0 / cap <= x <= cap:
                w[b, t], keep[b, t] = x, True
    return w, keep


def behavior_anchored_loop(weights, prox, behav, mask):
    """w'_t = w_t * mu/pi_prox token by token (0 where not counted), float64."""
    B, T = prox.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                out[b, t] = float(weights[b, t]) * math.exp(min(max(float(behav[b, t]) - float(prox[b, t]), -20.0), 20.0))
    return out


def m2po_loop(prox, behav, mask, threshold):
    """M2PO as its paper says it: remove the counted token of largest (log w)², one at a time, until
    the mean of (log w)² over the rest is <= threshold (among equal values the later row-major
    position goes first). Returns keep (bool [B, T])."""
    sq = {}
    for b, ts in enumerate(_rows(mask)):
        for t in ts:
            lw = min(max(float(prox[b, t]) - float(behav[b, t]), -20.0), 20.0)
            sq[(b, t)] = lw * lw
    # float32 like the fast version's inputs, so ties and the threshold compare the same numbers
    sq = {k: float(torch.tensor(v, dtype=torch.float32)) for k, v in sq.items()}
    kept = sorted(sq, key=lambda k: (sq[k], k))          # ascending value, then position
    while kept and sum(sq[k] for k in kept) / len(kept) > threshold:
        kept.pop()                                       # the largest (last among equals)
    keep = torch.zeros(mask.shape, dtype=torch.bool)
    for k in kept:
        keep[k] = True
    return keep


def kl_token_loop(lp, ref, kind):
    """Per-token KL(π ‖ π_ref) estimates from Schulman's note, one token at a time: [B, T] float64."""
    B, T = lp.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            lr = float(ref[b, t]) - float(lp[b, t])      # log (π_ref / π)
            if kind == "k1":
                out[b, t] = -lr
            elif kind == "k2":
                out[b, t] = 0.5 * lr * lr
            else:
                lr = min(max(lr, -20.0), 20.0)
                out[b, t] = math.expm1(lr) - lr
    return out


def value_token_losses_loop(v, old, ret, clip):
    """½·max((V − R)², (V_clip − R)²) per token (½(V − R)² without clip): [B, T] float64."""
    loss = torch.zeros(v.shape, dtype=torch.float64)
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            e1 = (float(v[b, t]) - float(ret[b, t])) ** 2
            if clip is None:
                loss[b, t] = 0.5 * e1
            else:
                vc = float(old[b, t]) + min(max(float(v[b, t]) - float(old[b, t]), -clip), clip)
                loss[b, t] = 0.5 * max(e1, (vc - float(ret[b, t])) ** 2)
    return loss


def dpo_loss_loop(pc, pr, rc, rr, beta, label_smoothing=0.0) -> float:
    """DPO (Rafailov et al. 2023) pair by pair: mean of −(1−ε)·log σ(u) − ε·log σ(−u),
    u = β((log π_c − log π_r) − (log π_ref,c − log π_ref,r)), over sequence log-probs [N]."""
    total = 0.0
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
        u = beta * ((a - b) - (c - d))
        total += (1 - label_smoothing) * math.log1p(math.exp(-u)) + label_smoothing * math.log1p(math.exp(u))
    return total / len(pc.tolist())


def shape_token_rewards_loop(scores, mask, kl, coef):
    """−coef·KL_t on every counted token, plus the score on the last counted one: [B, T] float64."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b, ts in enumerate(_rows(mask)):
        for t in ts:
            out[b, t] = -coef * float(kl[b, t]) if kl is not None else 0.0
        if ts:
            out[b, ts[-1]] += float(scores[b])
    return out
