"""``slipstream replay LOG_DIR``: what a rollout log holds, and offline training from it.

The log (learner/state/rollout_log.py) is every result the learner accepted, as the protocol's bytes.
Read back it answers what the run generated — rewards, staleness at acceptance, token versions,
per server, and how many records were torn or corrupt — and it is a data set:

- ``--train``: re-training through the learner's own :class:`learner.train.trainer.Trainer` (the
  configured loss, importance correction and optimizer) on batches of ``batch_prompts`` whole
  groups in log order; no servers. Behavior log-probs are the logged ones (the policy that
  generated them), so the importance weights correct for the distance to the offline policy.
- ``--dpo``: Direct Preference Optimization on pairs built from each group's best and worst
  completion by reward (groups whose rewards are all equal give no pair), by
  :class:`learner.train.dpo.DPOTrainer`: the learner's policy loading (device, dtype, LoRA), its
  log-prob forward and micro-batches, ``ops.dpo_loss``; the reference is the initial policy.

A sample appears once in the statistics and the data even when the log holds it twice (a resumed
life re-logs the samples it restored): the first record wins.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from learner.state.rollout_log import LIFE, LogReader


def read_samples(log_dir: str | Path) -> tuple[list[dict], dict[str, Any]]:
    """Every logged sample once (log order) as ``{"sample", "server", "accepted_version",
    "life"}``, and the log's counters (segments, records, torn, corrupt, lives, duplicates)."""
    reader = LogReader(Path(log_dir))
    out: list[dict] = []
    seen: set[str] = set()
    lives = 0
    dup = 0
    for rec in reader:
        if rec.kind == LIFE:
            lives += 1
            continue
        for s in rec.result.samples:
            if s.sample_id in seen:
                dup += 1
                continue
            seen.add(s.sample_id)
            out.append({"sample": s, "server": rec.result.server_id,
                        "accepted_version": int(rec.meta.get("version", 0)),
                        "life": rec.meta.get("life")})
    info = {**reader.stats(), "lives": lives, "duplicate_samples": dup}
    return out, info


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def staleness_of(entry: dict) -> int:
    """Staleness when the learner accepted it: its version then − the oldest token's version."""
    tv = entry["sample"].token_versions
    return entry["accepted_version"] - int(tv.min()) if len(tv) else 0


def groups_of(entries: list[dict]) -> list[list[dict]]:
    """Complete groups (every group_index of group_size present), in order of first appearance."""
    by: dict[str, dict[int, dict]] = defaultdict(dict)
    for e in entries:
        s = e["sample"]
        by[s.assignment_id].setdefault(s.group_index, e)
    out = []
    for members in by.values():
        size = next(iter(members.values()))["sample"].group_size
        if len(members) == size:
            out.append([members[i] for i in range(size)])
    return out


def trained_ids_near(log_dir: str | Path) -> Path | None:
    """RUN_DIR/trained_ids.jsonl when the log is the default RUN_DIR/rollout_log."""
    p = Path(log_dir).resolve().parent / "trained_ids.jsonl"
    return p if p.is_file() else None


def replay_stats(log_dir: str | Path, trained_ids: str | Path | None = None) -> dict[str, Any]:
    """The statistics; with ``trained_ids`` (default: the run directory's, when found) also how many
    logged samples the run's final weights were trained on (rolled-back steps not counted)."""
    entries, info = read_samples(log_dir)
    rewards = [e["sample"].reward for e in entries]
    stale = [staleness_of(e) for e in entries]
    versions = [int(v) for e in entries if len(e["sample"].token_versions)
                for v in (e["sample"].token_versions.min(), e["sample"].token_versions.max())]
    mean, std = _mean_std(rewards)
    per: dict[str, list[dict]] = defaultdict(list)
    for e in entries:
        per[e["server"]].append(e)
    servers = {}
    for sid, es in sorted(per.items()):
        m, sd = _mean_std([e["sample"].reward for e in es])
        servers[sid] = {"samples": len(es), "reward_mean": m, "reward_std": sd,
                        "staleness_mean": sum(staleness_of(e) for e in es) / len(es)}
    return {
        **info,
        "samples": len(entries),
        "groups": len(groups_of(entries)),
        "reward_mean": mean, "reward_std": std,
        "staleness_mean": sum(stale) / len(stale) if stale else float("nan"),
        "staleness_max": max(stale, default=0),
        "staleness_histogram": dict(sorted(Counter(stale).items())),
        "token_version_min": min(versions, default=0), "token_version_max": max(versions, default=0),
        "accepted_version_min": min((e["accepted_version"] for e in entries), default=0),
        "accepted_version_max": max((e["accepted_version"] for e in entries), default=0),
        "servers": servers,
        **_trained(entries, trained_ids if trained_ids is not None else trained_ids_near(log_dir)),
    }


def _trained(entries: list[dict], path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    from learner.state.checkpoint import effective_trained_ids

    trained = set(effective_trained_ids(Path(path)))
    n = sum(e["sample"].sample_id in trained for e in entries)
    return {"trained_ids": str(path), "trained_samples": n, "untrained_samples": len(entries) - n}


def format_stats(st: dict[str, Any]) -> str:
    lines = [
        f"segments {st['segments']}  records {st['records']}  bytes {st['bytes']}  lives {st['lives']}",
        f"torn records skipped {st['torn']}  corrupt records skipped {st['corrupt']}  "
        f"({st['skipped_bytes']} bytes)  duplicate samples {st['duplicate_samples']}",
        f"samples {st['samples']}  complete groups {st['groups']}",
        f"reward mean {st['reward_mean']:.4f}  std {st['reward_std']:.4f}",
        f"staleness mean {st['staleness_mean']:.3f}  max {st['staleness_max']}  "
        f"histogram {st['staleness_histogram']}",
        f"token versions {st['token_version_min']}..{st['token_version_max']}  accepted at versions "
        f"{st['accepted_version_min']}..{st['accepted_version_max']}",
    ]
    if "trained_samples" in st:
        lines.append(f"trained {st['trained_samples']}  untrained {st['untrained_samples']}  "
                     f"(by {st['trained_ids']})")
    lines.append(f"{'server':<24} {'samples':>8} {'reward':>9} {'std':>8} {'staleness':>10}")
    for sid, s in st["servers"].items():
        lines.append(f"{sid[:24]:<24} {s['samples']:>8} {s['reward_mean']:>9.4f} {s['reward_std']:>8.4f} "
                     f"{s['staleness_mean']:>10.3f}")
    return "\n".join(lines)


# ---- offline re-training ------------------------------------------------------------------------

def train_offline(log_dir: str | Path, cfg: Any, model_path: str, steps: int,
                  emit=print, out: str | Path | None = None) -> list[dict[str, float]]:
    """Up to ``steps`` Trainer steps on batches of ``cfg.batch.batch_prompts`` logged groups; the policy
    saved to ``out`` (as the learner's ``final/``) when given."""
    from buffer import Batch
    from learner.config import TrainerConfig
    from learner.train.distributed import make_trainer

    entries, _ = read_samples(log_dir)
    groups = [g for g in groups_of(entries) if len(g) == cfg.batch.group_size]
    k = cfg.batch.batch_prompts
    trainer = make_trainer(TrainerConfig.of(cfg), model_path)
    stats_rows = []
    for step in range(min(steps, len(groups) // k)):
        chosen = groups[step * k:(step + 1) * k]
        es = [e for g in chosen for e in g]
        batch = Batch([e["sample"] for e in es], step, [staleness_of(e) for e in es],
                      [False] * len(es), [len(g) for g in chosen])
        stats = trainer.step(batch)
        stats_rows.append(stats)
        emit(json.dumps({"step": step, **{k_: round(v, 6) for k_, v in stats.items()
                                         if isinstance(v, float) and ("loss" in k_ or "reward" in k_
                                                                      or k_.startswith("is_"))}}))
    if not stats_rows:
        emit(json.dumps({"event": "no_batch", "groups": len(groups), "batch_prompts": k}))
    if out is not None:
        trainer.save_policy(Path(out))
        emit(json.dumps({"event": "saved", "policy": str(out)}))
    return stats_rows


# ---- offline DPO ---------------------------------------------------------------------------------

def dpo_pairs(entries: list[dict]) -> list[tuple[Any, Any]]:
    """(chosen, rejected) samples of the log's complete groups (learner.train.dpo.best_and_worst)."""
    from learner.train.dpo import best_and_worst

    return best_and_worst([[e["sample"] for e in g] for g in groups_of(entries)])


def dpo_offline(log_dir: str | Path, model_path: str, steps: int, beta: float = 0.1, lr: float = 1e-4,
                cfg: Any = None, emit=print, out: str | Path | None = None) -> list[float]:
    """``steps`` DPO steps (:class:`learner.train.dpo.DPOTrainer` under ``cfg``, the learner's
    config, default the defaults) on the log's pairs; the loss of every step. The policy is saved
    to ``out`` when given."""
    from learner.config import LearnerConfig, TrainerConfig
    from learner.train.dpo import DPOTrainer

    entries, _ = read_samples(log_dir)
    pairs = dpo_pairs(entries)
    if not pairs:
        emit(json.dumps({"event": "no_pairs", "samples": len(entries)}))
        return []
    trainer = DPOTrainer(TrainerConfig.of(cfg if cfg is not None else LearnerConfig()), model_path, pairs,
                         beta=beta, lr=lr)
    losses = []
    for step in range(steps):
        stats = trainer.step()
        losses.append(stats["dpo_loss"])
        emit(json.dumps({"step": step, "pairs": len(pairs), **{k: round(v, 6) for k, v in stats.items()}}))
    if out is not None:
        trainer.save_policy(out)
        emit(json.dumps({"event": "saved", "policy": str(out)}))
    return losses


def replay(args) -> int:
    """The CLI entry (deploy/cli.py)."""
    from protocol.errors import StartupError

    if not LogReader(Path(args.log_dir)).segment_paths():
        raise StartupError(f"replay: no rollout log segments (life-*.log) in {args.log_dir!r}; "
                           "point it at learner.rollout_log.path (default RUN_DIR/rollout_log)")
    st = replay_stats(args.log_dir)
    print(json.dumps(st, default=str) if args.json else format_stats(st), flush=True)
    if not (args.train or args.dpo):
        return 0
    from deploy.config_file import load_config

    cfg = load_config(args.config, args.overrides)
    model_path = args.model
    if model_path is None:
        from deploy.model_source import resolve_model

        model_path = resolve_model(cfg.model, log=lambda m: None)
    if args.train:
        train_offline(args.log_dir, cfg.learner, model_path, args.steps, out=args.out)
    else:
        dpo_offline(args.log_dir, model_path, args.steps, beta=args.beta, lr=args.lr, cfg=cfg.learner,
                    out=args.out)
    return 0
