"""Benchmarks for ``ops``: GAE, token_logprobs, token_logprobs_from_hidden (CPU; a script, not a test).

    .venv/bin/python tests/bench/bench_ops.py [--quick] [--out bench_results/bench_ops.json]

Prints a table and writes JSON. Every ratio is measured against baselines run in the same process
(speed) or in sibling processes started the same way (memory), never against stored numbers.

Targets (issue 3):
- GAE, B=256, T=4096, fp32: ≥ 3× faster than the reverse loop over time that the seeds (seed 000
  §2.3 ``compute_gae``) and verl use, equal to it within 1e-5.
- token_logprobs, B=8, T=1024, V=32768 (fp32 logits, 1 GiB): peak extra memory ≤ 1/8 of the naive
  ``log_softmax(logits, -1).gather(...)`` and time ≤ the selective gather − logsumexp approach
  (TRL ``selective_log_softmax``, copied below).
- token_logprobs_from_hidden: peak extra memory against materializing the logits (reported).

How peak memory is measured. Each (case, method) runs in a fresh child process (this script with
``--child``), so allocator state and leftovers from other methods cannot mix in. The child builds its
inputs, then resets the kernel's RSS high-water mark (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0)
and reads the current RSS from ``/proc/self/status``; it runs the method once and reads ``VmHWM``:
peak extra = VmHWM − RSS-before. The kernel tracks the high-water mark exactly (no sampling, so short
temporaries are not missed). The child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so every large
buffer is its own mmap and freed memory goes back to the OS at once (glibc's dynamic threshold
would otherwise keep freed blocks in the heap, where they could be reused without raising RSS and
make a method look cheaper than it is). The extra memory is the working set a method needs on top
of its inputs, including its [B, T] output. Where clear_refs is not writable, the child falls back to
sampling RSS from a thread every 0.5 ms (reported as ``mem_method: "sampled"``). Before measuring,
the child runs the method once on a tiny instance so that the code pages of the kernels it uses
(file-backed, also counted in RSS) are already resident. The expected sizes of
the dominant temporaries are printed next to the measurements as a cross-check.
Timing: median of ``--repeats`` interleaved rounds (every method once per round, so drifting load
from other processes hits all methods alike) after one warm-up each; for token_logprobs and
from_hidden all methods of a case are timed together in one fresh child process with the default
allocator. ``--threads`` sets torch's intra-op threads for baselines and ops alike. The default is
1: the GAE loop's per-step ops on [B] vectors are below torch's parallel grain size and run on one
thread anyway, so one thread is the like-for-like comparison, and single-threaded numbers do not
depend on what else runs on the machine. With several threads on cores other processes keep busy,
every parallel op waits at an OpenMP barrier for a descheduled thread, which penalizes code made of
a few dozen large ops (ops) far more than a loop of tiny single-threaded ones. ``--threads 0`` uses
torch's default (all cores) for an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_machine import machine, machine_line  # noqa: E402

from ops import gae, token_logprobs, token_logprobs_from_hidden  # noqa: E402

MiB = 1 << 20


# --- baselines ---------------------------------------------------------------------------------------

def gae_loop_seeds(rewards, values, gamma=1.0, lam=0.95):
    """The reverse loop over time of the seeds (seed 000 ``compute_gae``) and classic verl / TRL."""
    _, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    last_gae = 0
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    return advantages, advantages + values


def gae_loop_verl_masked(rewards, values, mask, gamma=1.0, lam=0.95):
    """verl's current loop (multi-turn: skips values and TD-errors on masked tokens)."""
    _, T = rewards.shape
    nextvalues = torch.zeros_like(rewards[:, 0])
    lastgaelam = torch.zeros_like(rewards[:, 0])
    adv = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        adv.append(lastgaelam)
    advantages = torch.stack(adv[::-1], dim=1)
    return advantages, advantages + values


def logprobs_naive(logits, tokens):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def logprobs_selective(logits, index):
    """TRL ``trl/trainer/utils.py::selective_log_softmax`` (gather − per-row logsumexp)."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse
    out = []
    for row_logits, row_labels in zip(logits, index, strict=True):
        row = F.log_softmax(row_logits, dim=-1)
        out.append(row.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def logprobs_ops(logits, tokens):
    return token_logprobs(logits, tokens)


def hidden_naive(hidden, weight, tokens):
    logits = hidden @ weight.T  # [B, T, V]
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def hidden_logits_then_ops(hidden, weight, tokens):
    return token_logprobs(hidden @ weight.T, tokens)


def hidden_ops(hidden, weight, tokens):
    return token_logprobs_from_hidden(hidden, weight, tokens)


LOGPROB_METHODS = {"naive": logprobs_naive, "selective": logprobs_selective, "ops": logprobs_ops}
HIDDEN_METHODS = {"naive": hidden_naive, "logits+ops": hidden_logits_then_ops, "ops_from_hidden": hidden_ops}


# --- measurement -------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """Peak RSS above the RSS at entry, in bytes (kernel high-water mark, or sampling as a fallback)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "vmhwm"
        except OSError:
            self.method = "sampled"
        self.base = _status_kib("VmRSS") * 1024
        self.peak = self.base
        if self.method == "sampled":
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self.peak = max(self.peak, _status_kib("VmRSS") * 1024)
                    time.sleep(0.0005)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.method == "vmhwm":
            self.peak = max(self.peak, _status_kib("VmHWM") * 1024)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_kib("VmRSS") * 1024)
        self.extra = self.peak - self.base
        return False


def _time_interleaved(fns: dict, repeats: int) -> dict:
    """Median wall time of each function, run in interleaved rounds (A B C A B C ...) after one
    warm-up each, so drifting load from other processes hits every method alike. Functions faster
    than 20 ms get more rounds (about 0.3 s of the fastest one, at most 50)."""
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    fastest = min(first.values())
    if fastest < 0.02:
        repeats = max(repeats, min(50, int(0.3 / max(fastest, 1e-4))))
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _logprob_inputs(B, T, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g).mul_(3.0).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits, tokens


def _hidden_inputs(B, T, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    tokens = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, tokens


def _case(spec: dict):
    """Inputs and {method: callable} for a case; callables run forward (+ backward when asked)."""
    if spec["case"] == "logprobs":
        logits, tokens = _logprob_inputs(spec["B"], spec["T"], spec["V"], getattr(torch, spec["dtype"]))
        return {name: (lambda fn=fn: fn(logits, tokens)) for name, fn in LOGPROB_METHODS.items()}
    hidden, weight, tokens = _hidden_inputs(spec["B"], spec["T"], spec["H"], spec["V"])
    backward = spec.get("backward", False)
    if backward:
        hidden.requires_grad_(True)
        weight.requires_grad_(True)

    def make(fn):
        def run():
            out = fn(hidden, weight, tokens)
            if backward:
                out.sum().backward()
                hidden.grad = weight.grad = None
            return out

        return run

    return {name: make(fn) for name, fn in HIDDEN_METHODS.items()}


def child(spec: dict) -> dict:
    """Runs in a fresh process. ``measure == "memory"``: peak extra memory of the first call of one
    method. ``measure == "time"``: median times of all methods of the case, interleaved."""
    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    fns = _case(spec)
    if spec["measure"] == "time":
        return {"time_s": _time_interleaved(fns, spec["repeats"])}
    # Page in the code of every kernel the method uses (file-backed pages count in RSS) on a tiny
    # instance first, so the measurement sees the method's buffers, not libtorch's first-touch cost.
    _case({**spec, "B": 1, "T": 4, "V": 64, "H": 8})[spec["method"]]()
    run = fns[spec["method"]]
    if spec.get("backward"):  # the inputs' .grad buffers belong to any backward; allocate them first
        run()
    with PeakRSS() as mem:
        out = run()
    return {"peak_extra_bytes": mem.extra, "mem_method": mem.method, "checksum": float(out.detach().double().sum())}


def _spawn(spec: dict, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env, capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(spec: dict, methods) -> dict:
    """Memory: one fresh process per method (every large buffer its own mmap, see the module
    docstring). Time: one more process, default allocator settings, all methods interleaved."""
    mem_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = {name: _spawn({**spec, "method": name, "measure": "memory"}, mem_env) for name in methods}
    times = _spawn({**spec, "measure": "time"}, dict(os.environ))["time_s"]
    for name in methods:
        res[name]["time_s"] = times[name]
    return res


# --- benchmark sections ------------------------------------------------------------------------------

def bench_gae(B: int, T: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(B, T, generator=g) * 0.05  # per-token KL-penalty-like rewards
    rewards[:, -1] += torch.randn(B, generator=g)  # sequence score on the last token
    values = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    gamma, lam = 1.0, 0.95
    adv, ret = gae(rewards, values, mask, gamma, lam)
    adv_loop, ret_loop = gae_loop_seeds(rewards, values, gamma, lam)
    adv_verl, _ = gae_loop_verl_masked(rewards, values, mask, gamma, lam)
    adv64, _ = gae_loop_seeds(rewards.double(), values.double(), gamma, lam)
    max_diff = max((adv - adv_loop).abs().max().item(), (ret - ret_loop).abs().max().item())

    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    padded = (torch.arange(T) < lengths[:, None]).float()  # right padding, random lengths
    holes = padded.clone()
    holes[:, T // 3 : T // 3 + 8] = 0  # an interior observation span: takes the compaction path
    times = _time_interleaved(
        {
            "loop_seeds": lambda: gae_loop_seeds(rewards, values, gamma, lam),
            "loop_verl_masked": lambda: gae_loop_verl_masked(rewards, values, mask, gamma, lam),
            "ops_gae": lambda: gae(rewards, values, mask, gamma, lam),
            "ops_gae_right_padded": lambda: gae(rewards, values, padded, gamma, lam),
            "ops_gae_interior_holes": lambda: gae(rewards, values, holes, gamma, lam),
        },
        repeats,
    )
    t_loop, t_verl, t_ops = times["loop_seeds"], times["loop_verl_masked"], times["ops_gae"]
    return {
        "B": B, "T": T, "dtype": "float32", "gamma": gamma, "lam": lam,
        "time_s": times,
        "speedup_vs_loop_seeds": t_loop / t_ops,
        "speedup_vs_loop_verl_masked": t_verl / t_ops,
        "max_abs_diff_vs_loop": max_diff,
        "max_abs_diff_vs_loop_verl": (adv - adv_verl).abs().max().item(),
        "max_abs_err_vs_float64": (adv.double() - adv64).abs().max().item(),
        "max_abs_err_loop_vs_float64": (adv_loop.double() - adv64).abs().max().item(),
        "target_speedup": 3.0,
        "target_met": bool(t_loop / t_ops >= 3.0 and max_diff <= 1e-5),
    }


def bench_logprobs(B, T, V, dtype: str, repeats: int, threads: int) -> dict:
    small_logits, small_tokens = _logprob_inputs(2, 64, V, getattr(torch, dtype), seed=1)
    ref = logprobs_naive(small_logits.double(), small_tokens)
    agree = {name: (fn(small_logits, small_tokens).double() - ref).abs().max().item() for name, fn in LOGPROB_METHODS.items()}
    spec = {"case": "logprobs", "B": B, "T": T, "V": V, "dtype": dtype, "repeats": repeats, "threads": threads}
    res = run_case(spec, LOGPROB_METHODS)
    for name in LOGPROB_METHODS:
        res[name]["max_abs_err_vs_float64"] = agree[name]
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    chunk = max(1, (1 << 20) // V)
    out = {
        "B": B, "T": T, "V": V, "dtype": dtype, "logits_bytes": B * T * V * elem, "methods": res,
        "expected_dominant_temporaries_bytes": {
            "naive": B * T * V * 4 * (2 if elem < 4 else 1),  # fp32 copy (bf16 only) + log_softmax output
            "selective": T * V * 4,  # one [T, V] row at a time: logsumexp's exp(x − max) (fp32) or log_softmax (bf16)
            "ops": chunk * V * 4,  # one [chunk, V] fp32 buffer: log_softmax output, or the fp32 copy of bf16
        },
        "memory_ratio_ops_over_naive": res["ops"]["peak_extra_bytes"] / max(res["naive"]["peak_extra_bytes"], 1),
        "time_ratio_ops_over_selective": res["ops"]["time_s"] / res["selective"]["time_s"],
        "speedup_vs_naive": res["naive"]["time_s"] / res["ops"]["time_s"],
    }
    out["target_met"] = bool(out["memory_ratio_ops_over_naive"] <= 1 / 8 and out["time_ratio_ops_over_selective"] <= 1.0)
    return out


def bench_hidden(B, T, H, V, repeats: int, backward: bool, threads: int) -> dict:
    spec = {"case": "hidden", "B": B, "T": T, "H": H, "V": V, "repeats": repeats, "backward": backward, "threads": threads}
    res = run_case(spec, HIDDEN_METHODS)
    sums = [r["checksum"] for r in res.values()]
    return {
        "B": B, "T": T, "H": H, "V": V, "dtype": "float32", "backward": backward,
        "logits_bytes": B * T * V * 4, "methods": res,
        "checksums_agree": bool(max(sums) - min(sums) <= 1e-4 * max(1.0, abs(sums[0]))),
        "memory_ratio_ops_over_naive": res["ops_from_hidden"]["peak_extra_bytes"] / max(res["naive"]["peak_extra_bytes"], 1),
        "memory_ratio_ops_over_logits_then_ops": res["ops_from_hidden"]["peak_extra_bytes"]
        / max(res["logits+ops"]["peak_extra_bytes"], 1),
    }


def _fmt_mib(b: float) -> str:
    return f"{b / MiB:9.1f}"


def print_table(results: dict) -> None:
    g = results.get("gae")
    if g is not None:
        _print_gae(g)
    _print_rest(results)


def _print_gae(g: dict) -> None:
    print(f"\nGAE  B={g['B']} T={g['T']} fp32 (γ={g['gamma']}, λ={g['lam']})")
    print(f"  {'method':28s} {'time ms':>10s}")
    for k, v in g["time_s"].items():
        print(f"  {k:28s} {v * 1e3:10.2f}")
    print(
        f"  speedup vs seeds loop: {g['speedup_vs_loop_seeds']:.1f}x (target >= 3x), vs verl masked loop: "
        f"{g['speedup_vs_loop_verl_masked']:.1f}x; max |diff| vs loop {g['max_abs_diff_vs_loop']:.2e} (<= 1e-5); "
        f"err vs fp64: ops {g['max_abs_err_vs_float64']:.2e}, loop {g['max_abs_err_loop_vs_float64']:.2e} "
        f"-> {'MET' if g['target_met'] else 'NOT MET'}"
    )


def _print_rest(results: dict) -> None:
    for key in ("token_logprobs", "token_logprobs_bf16"):
        if key not in results:
            continue
        r = results[key]
        print(f"\ntoken_logprobs  B={r['B']} T={r['T']} V={r['V']} {r['dtype']} (logits {r['logits_bytes'] / MiB:.0f} MiB)")
        print(f"  {'method':14s} {'peak extra MiB':>15s} {'expected MiB':>13s} {'time ms':>10s} {'err vs fp64':>12s}")
        for name, m in r["methods"].items():
            print(
                f"  {name:14s} {_fmt_mib(m['peak_extra_bytes']):>15s} {_fmt_mib(r['expected_dominant_temporaries_bytes'][name]):>13s}"
                f" {m['time_s'] * 1e3:10.1f} {m['max_abs_err_vs_float64']:12.2e}"
            )
        print(
            f"  memory ops/naive = {r['memory_ratio_ops_over_naive']:.4f} (target <= 0.125), time ops/selective = "
            f"{r['time_ratio_ops_over_selective']:.2f} (target <= 1), speedup vs naive {r['speedup_vs_naive']:.1f}x"
            f" -> {'MET' if r['target_met'] else 'NOT MET'}"
        )
    for key in ("from_hidden_forward", "from_hidden_backward"):
        if key not in results:
            continue
        r = results[key]
        what = "forward+backward" if r["backward"] else "forward"
        print(f"\ntoken_logprobs_from_hidden {what}  B={r['B']} T={r['T']} H={r['H']} V={r['V']} fp32 "
              f"(logits would be {r['logits_bytes'] / MiB:.0f} MiB)")
        print(f"  {'method':16s} {'peak extra MiB':>15s} {'time ms':>10s}")
        for name, m in r["methods"].items():
            print(f"  {name:16s} {_fmt_mib(m['peak_extra_bytes']):>15s} {m['time_s'] * 1e3:10.1f}")
        print(
            f"  memory ops/naive = {r['memory_ratio_ops_over_naive']:.3f}, ops/(logits + token_logprobs) = "
            f"{r['memory_ratio_ops_over_logits_then_ops']:.3f}; results agree: {r['checksums_agree']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (seconds instead of minutes)")
    ap.add_argument("--out", default="bench_results/bench_ops.json", help="where to write the JSON results")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per method (median reported)")
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for every measurement, baselines and ops alike (default 1; 0 = torch's "
        "default). See the module docstring for why one thread is the default",
    )
    ap.add_argument(
        "--only", default="gae,logprobs,hidden",
        help="comma-separated sections to run: gae, logprobs, hidden (default: all)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    quick = args.quick
    repeats = args.repeats or (3 if quick else 5)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results: dict = {
        "config": {"quick": quick, "repeats": repeats, "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    only = {x.strip() for x in args.only.split(",")}
    if "gae" in only:
        gae_size = (64, 1024) if quick else (256, 4096)
        results["gae"] = bench_gae(*gae_size, repeats=repeats)
    if "logprobs" in only:
        lp_size = (2, 512, 32768) if quick else (8, 1024, 32768)
        results["token_logprobs"] = bench_logprobs(*lp_size, "float32", repeats=repeats, threads=args.threads)
        results["token_logprobs_bf16"] = bench_logprobs(*lp_size, "bfloat16", repeats=repeats, threads=args.threads)
    if "hidden" in only:
        hid_size = (1, 1024, 256, 32768) if quick else (4, 1024, 256, 32768)
        results["from_hidden_forward"] = bench_hidden(
            *hid_size, repeats=max(1, repeats - 2), backward=False, threads=args.threads
        )
        results["from_hidden_backward"] = bench_hidden(*hid_size, repeats=1, backward=True, threads=args.threads)
    results["config"]["wall_s"] = time.perf_counter() - t0
    results["machine"] = machine(threads=args.threads or None)

    print(machine_line(results["machine"]))
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out} ({results['config']['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
