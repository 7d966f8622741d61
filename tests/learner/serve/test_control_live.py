"""ctl against a real learner (real control socket, real trainer, an honest server): step settings
reach the trainer between steps, pause holds training and dispatch, resume goes on."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from config_kit import rollout_config
from learner_testkit import HonestServer, ctl, learner_config, metric, running_learner, wait_until

from learner.config import LIVE_KEYS, get_path, resolve_key

pytestmark = pytest.mark.slow


async def test_live_settings_and_pause(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path, max_staleness=0), tiny_model_dir) as svc:
        assert svc.trainer.cfg is not svc.cfg                    # the trainer has its own copy
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(1)
            for key, value in (("optimizer.lr", 0.001), ("algorithm.is_mode", "mis"), ("is_cap", 4.0),
                               ("target_kl", 0.5)):
                reply = await ctl(svc.endpoints["control"], "set", key=key, value=value)
                assert reply.ok, reply.error
                path = resolve_key(key)               # a leaf only one section has stands for its path
                assert reply.result[path] == value and get_path(svc.cfg, path) == value
            v = svc.version
            await good.wait_version(v + 2)
            assert (svc.trainer.cfg.optimizer.lr, svc.trainer.cfg.algorithm.is_mode, svc.trainer.cfg.algorithm.is_cap,
                    svc.trainer.cfg.algorithm.target_kl) == (0.001, "mis", 4.0, 0.5)
            assert metric(svc, "slipstream_setting", key="optimizer.lr") == 0.001
            bad = await ctl(svc.endpoints["control"], "set", key="kl.coef", value=0.1)
            assert not bad.ok and "no reference policy" in bad.error and svc.cfg.kl.coef == 0
            # Pause: the version stops moving while the server stays connected and asking.
            reply = await ctl(svc.endpoints["control"], "pause")
            assert reply.ok and reply.result["paused"]
            # Quiescent: what was issued before the pause has come back (the server keeps asking).
            # and the step that was running when the pause came has finished.
            await wait_until(lambda: svc.buffer.inflight_samples == 0 and not svc.loop.busy, 60,
                             "in-flight work back, no step running")
            assert (await ctl(svc.endpoints["control"], "status")).result["training"] is False
            held, issued = svc.version, svc.buffer.counters["issued"]
            # Proving that nothing happens needs a window: unpaused, this run makes a step every
            # few tens of milliseconds.
            await asyncio.sleep(0.5)
            assert svc.version == held and svc.buffer.counters["issued"] == issued
            assert svc.admission.paused
            assert metric(svc, "slipstream_paused") == 1
            reply = await ctl(svc.endpoints["control"], "resume")
            assert reply.ok and not reply.result["paused"]
            await good.wait_version(svc.version + 2)
            assert metric(svc, "slipstream_paused") == 0


async def test_the_ctl_command_line(tmp_path, tiny_model_dir, capsys):
    """``slipstream ctl`` itself (deploy.cli.main in a thread) against the live learner."""
    import json

    from deploy.cli import main
    from deploy.ctl import human, parse_value

    assert (parse_value("1"), parse_value("0.5"), parse_value("null"), parse_value("tis")) == (1, 0.5, None, "tis")
    assert human({"b": 1, "a": {"x": "y"}}) == "a:\n  x  y\nb  1"
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        base = ["ctl", "--endpoint", svc.endpoints["control"]]

        def own(text: str) -> str:      # the learner's event lines share this process's stdout
            return "".join(line for line in text.splitlines(keepends=True)
                           if not line.startswith('{"proc": "learner"'))

        capsys.readouterr()

        async def cli(*args) -> tuple[int, str, str]:
            code = await asyncio.to_thread(main, [*base, *args])
            out = capsys.readouterr()
            return code, own(out.out), own(out.err)
        assert await cli("get", "max_staleness") == (0, "1\n", "")
        code, out, _ = await cli("--json", "set", "target_kl", "0.2")
        assert code == 0 and json.loads(out)["algorithm.target_kl"] == 0.2
        code, out, _ = await cli("set", "target_kl", "null")
        # set prints what it changed, one line, not the whole status
        assert code == 0 and svc.cfg.algorithm.target_kl is None
        assert out == "algorithm.target_kl: 0.2 -> null (from the next step)\n", out
        code, out, _ = await cli("set", "max_staleness", "2")
        assert (code, out) == (0, "staleness.max_staleness: 1 -> 2 (now)\n")
        # each change is a metrics.jsonl row too: the report draws a marker at its step
        rows = [json.loads(x) for x in (svc.run_dir / "metrics.jsonl").read_text().splitlines()]
        changes = [(r["key"], r["previous"], r["value"]) for r in rows if r.get("kind") == "control"]
        assert changes[-2:] == [("algorithm.target_kl", 0.2, None), ("staleness.max_staleness", 1, 2)]
        # what status shows, get shows too
        code, out, _ = await cli("get", "version")
        assert code == 0 and int(out) == svc.version
        code, _, err = await cli("get", "verison")
        assert code == 2 and "did you mean" in err
        code, out, err = await cli("set", "is_mode", "sometimes")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "one of none, tis" in err
        # ctl stacks: the learner's threads and asyncio tasks, written to RUN_DIR/stacks (issue 38.3)
        code, out, _ = await cli("stacks")
        path = Path(re.search(r"^path +(\S+)$", out, re.M).group(1))
        assert code == 0 and path.parent == svc.run_dir / "stacks"
        text = path.read_text()
        assert "## task train" in text and "## thread MainThread" in text and "# learner pid" in text
        code, out, _ = await cli("pause")
        assert code == 0 and svc.control.paused and re.search(r"^paused +true$", out, re.M)
        assert (await cli("resume"))[0] == 0 and not svc.control.paused
        code, _, err = await cli("pause", "now")
        assert code == 2 and "takes no arguments" in err


async def test_ctl_stop_checkpoints_and_tells_the_servers(tmp_path, tiny_model_dir):
    """`ctl stop` ends the run as SIGTERM does: a final checkpoint, the servers told (they drop
    queued work and stay up for a resumed learner), the learner out with 0."""
    from learner.serve.service import LearnerService
    from rollout_server.service import RolloutService

    svc = LearnerService(learner_config(tmp_path, save_every=0), tiny_model_dir, run_id="test")
    learner = asyncio.create_task(svc.run())
    await wait_until(lambda: svc.ready.is_set() or learner.done(), 120, "learner ready")
    server = RolloutService(rollout_config(learner=svc.endpoints["rollout"], server_id="real",
                                          metrics_port=0, threads=1, max_concurrency=4), tiny_model_dir)
    events: list[str] = []
    log = server.log
    server.log = lambda event, **fields: (events.append(event), log(event, **fields))
    task = asyncio.create_task(server.run())
    try:
        await wait_until(lambda: svc.version >= 2 or task.done() or learner.done(), 240, "two steps")
        reply = await ctl(svc.endpoints["control"], "stop")
        assert reply.ok and reply.result == {"stopping": True}
        assert await asyncio.wait_for(learner, 120) == 0
        checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
        assert checkpoints and (checkpoints[-1] / "COMPLETE").exists(), checkpoints
        await wait_until(lambda: "learner_stopping" in events or task.done(), 30, "the server told")
        assert not task.done()                      # it stays up, for a resumed learner
    finally:
        server.stopping.set()
        server.abort.set()
        assert await asyncio.wait_for(task, 60) == 0
        if not learner.done():
            svc.stopping.set()
            await asyncio.wait_for(learner, 60)


async def test_temperature_changes_live_and_samples_are_recomputed_at_theirs(tmp_path, tiny_model_dir):
    """``ctl set temperature`` with a real HF server: the assignments issued afterwards carry the
    new temperature, the server samples at it, and the learner recomputes those samples at it
    (mismatch KL stays at the engines' numerical noise; recomputed at the old 1.0 it is not)."""
    import json

    from learner_testkit import real_server

    cfg = learner_config(tmp_path, max_staleness=0, batch_prompts=2, max_new_tokens=6)
    async with running_learner(cfg, tiny_model_dir) as svc:
        async with real_server(svc, tiny_model_dir) as (_, task):
            await wait_until(lambda: svc.version >= 2 or task.done(), 240, "two steps")
            bad = await ctl(svc.endpoints["control"], "set", key="sampling.temperature", value=0)
            assert not bad.ok and "temperature" in bad.error and svc.cfg.sampling.temperature == 1.0
            reply = await ctl(svc.endpoints["control"], "set", key="sampling.temperature", value=0.3)
            assert reply.ok, reply.error
            changed_at = svc.version
            assert svc.sampling().temperature == 0.3 and svc.trainer.cfg.sampling.temperature == 1.0
            await wait_until(lambda: svc.version >= changed_at + 4 or task.done(), 240, "four more steps")
            assert not task.done()
            assert metric(svc, "slipstream_setting", key="sampling.temperature") == 0.3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if r.get("kind", "step") == "step" and "mismatch_kl" in r}
    after = [steps[v] for v in steps if v > changed_at + 1]     # batches issued after the change
    assert len(after) >= 2
    assert all(abs(r["mismatch_kl"]) < 1e-4 for r in steps.values()), [r["mismatch_kl"] for r in steps.values()]


# What each live key's consumer reads: the value the run acts on, not the config object. A key
# registered in LIVE_KEYS without an observer here, or set without its consumer seeing the change,
# fails test_every_live_key_reaches_what_reads_it.
OBSERVERS = {
    "staleness.max_staleness": (lambda svc: svc.buffer.max_staleness, 3),
    "staleness.stale_policy": (lambda svc: svc.buffer.stale_policy, "correct"),
    "servers.max_inflight_per_server": (lambda svc: svc.admission.settings.max_inflight_per_server, 4),
    "sampling.temperature": (lambda svc: svc.sampling().temperature, 0.5),
    "algorithm.is_mode": (lambda svc: svc.trainer.cfg.algorithm.is_mode, "mis"),
    "algorithm.is_cap": (lambda svc: svc.trainer.cfg.algorithm.is_cap, 3.0),
    "algorithm.clip_anchor": (lambda svc: svc.trainer.cfg.algorithm.clip_anchor, "behavior"),
    "algorithm.target_kl": (lambda svc: svc.trainer.cfg.algorithm.target_kl, 0.25),
    "kl.coef": (lambda svc: svc.trainer.kl_controller.value, 0.02),
    "optimizer.lr": (lambda svc: svc.trainer.optimizer.param_groups[0]["lr"], 0.002),
    "watchdog.stall_s": (lambda svc: svc.watchdog.limit(), 42.0),
    "watchdog.dump_after_s": (lambda svc: svc.watchdog.dump_after_s(), 17.0),
    "watchdog.abort_after_s": (lambda svc: svc.watchdog.abort_after_s(), 900.0),
}


async def test_every_live_key_reaches_what_reads_it(tmp_path, tiny_model_dir):
    """Every key of the live registry, set through the real control socket, reaches the component
    that acts on it: at once for the "now" keys, after the next trained step for the "next step"
    ones (the trainer's own copy, its KL controller, its optimizer's learning rate)."""
    assert set(OBSERVERS) == set(LIVE_KEYS), "a live key needs an observer here (and a consumer)"
    cfg = learner_config(tmp_path, max_staleness=1, kl_coef=0.01, clip_anchor="proximal")
    async with running_learner(cfg, tiny_model_dir) as svc:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(1)
            for key in ("algorithm.target_kl", *[k for k in LIVE_KEYS if k != "algorithm.target_kl"]):
                if key == "algorithm.clip_anchor":        # refused beside target_kl: clear it first
                    assert (await ctl(svc.endpoints["control"], "set", key="algorithm.target_kl", value=None)).ok
                observe, value = OBSERVERS[key]
                assert observe(svc) != value, key
                reply = await ctl(svc.endpoints["control"], "set", key=key, value=value)
                assert reply.ok, (key, reply.error)
                if LIVE_KEYS[key].when == "next step":
                    await good.wait_version(svc.version + 2)
                assert observe(svc) == value, key
