"""The ``slipstream`` command: learner, rollout, run, ctl, config, keys, report, replay.

Config and startup errors (:class:`protocol.StartupError`, which :class:`deploy.config_file.ConfigError`
is one of) print one line saying what to fix on stderr and exit with code 2, no traceback. They
are found before the model loads where they can be: the dataset, the learner endpoint, the run
directory, the model directory's ``config.json``. Anything else is a bug or a runtime failure and
keeps its traceback (exit 1).

Imports are lazy: ``slipstream ctl`` needs only ``protocol`` and pyzmq, never torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from protocol.errors import StartupError

EXIT_CONFIG = 2


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--config", required=required, metavar="FILE",
                   help="YAML config file" + ("" if required else " (default: the built-in demo)"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set learner.optimizer.lr=1e-4 (repeatable)")


def _add_resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="resume the run from a checkpoint: the latest complete one under the "
                        "checkpoint directory, or the checkpoint directory PATH")


def _add_log_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=["auto", "text", "json"], default="auto",
                   help="events on stdout: readable lines like `slipstream run` (text) or one JSON "
                        "object per line (json); auto: text on a terminal, json when piped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("learner", help="run the learner process")
    _add_config_args(p, required=True)
    _add_resume_arg(p)
    _add_log_format_arg(p)
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="start N learner ranks on this machine through torchrun (needs a "
                        "learner.deepspeed section; rank 0 serves, the others train their share)")
    p = sub.add_parser("rollout", help="run one rollout server process")
    _add_config_args(p, required=True)
    p.add_argument("--learner", metavar="tcp://HOST:PORT", help="the learner's rollout endpoint")
    p.add_argument("--engine", choices=["hf", "vllm"], help="generation engine (rollout.engine)")
    _add_log_format_arg(p)
    p = sub.add_parser("run", help="start a learner and N rollout servers, supervise them")
    _add_config_args(p, required=False)
    _add_resume_arg(p)
    p = sub.add_parser("ctl", help="talk to a live learner: status, get KEY, set KEY VALUE, pause, "
                                   "resume, checkpoint, stacks, stop")
    p.add_argument("--endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="the learner's control endpoint (default: read RUN_DIR/learner.json)")
    p.add_argument("--run-dir", default="runs/default", help="run directory of the learner")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--secret-key", default=None, metavar="FILE",
                   help="this operator's CURVE secret key file, when the learner uses CURVE "
                        "(default: $SLIPSTREAM_CTL_SECRET_KEY)")
    p.add_argument("--learner-key", default=None, metavar="FILE",
                   help="the learner's CURVE public key file (default: $SLIPSTREAM_CTL_LEARNER_KEY, "
                        "else the key in RUN_DIR/learner.json)")
    p.add_argument("--json", action="store_true", help="print the reply as JSON (for scripts)")
    p.add_argument("action", choices=["status", "get", "set", "pause", "resume", "checkpoint", "stacks", "stop"])
    p.add_argument("key", nargs="?")
    p.add_argument("value", nargs="?", help="a JSON value (1, 0.5, null, true) or a bare string")
    p = sub.add_parser("config", help="print the fully resolved config (every default, every "
                                      "section) as YAML, or every key with --keys")
    _add_config_args(p, required=False)
    p.add_argument("--keys", action="store_true", help="list every key: what it takes, its default, "
                                                      "whether ctl can set it live, what it does")
    p.add_argument("--from-trl", metavar="FILE", help="translate a TRL GRPO config (YAML/JSON) or a `trl grpo` "
                                                      "command line into a slipstream config (docs/migrating.md)")
    p.add_argument("--from-verl", metavar="FILE", help="translate a verl PPO/GRPO YAML or a command line of its "
                                                       "Hydra overrides into a slipstream config")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="with --from-trl: the processes TRL ran on (its batch sizes are per process)")
    p = sub.add_parser("keys", help="generate CURVE key pairs and allow-lists for a run")
    p.add_argument("dir", help="directory to write the keys into")
    p.add_argument("--client", action="append", default=None, metavar="NAME",
                   help="a rollout server's key pair, allowed on the rollout and weights sockets "
                        "(repeatable; default: rollout)")
    p.add_argument("--operator", action="append", default=None, metavar="NAME",
                   help="an operator's key pair, allowed on the control socket (repeatable; "
                        "default: operator)")
    p = sub.add_parser("report", help="plots and a summary of a run's metrics.jsonl (deploy/report.py)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the learner's run directory")
    p.add_argument("--run-id", default=None, help="which run of the file (default: the last one)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: RUN_DIR/report)")
    p = sub.add_parser("replay", help="statistics of a rollout log, and offline training from it "
                                      "(deploy/replay.py)")
    p.add_argument("log_dir", metavar="LOG_DIR", help="learner.rollout_log.path (default RUN_DIR/rollout_log)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="re-train with the learner's Trainer on "
                                                          "batches of logged groups (no servers)")
    mode.add_argument("--dpo", action="store_true", help="DPO on each group's best vs worst completion")
    _add_config_args(p, required=False)
    p.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the config's)")
    p.add_argument("--steps", type=int, default=10, help="offline steps (default 10)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    p.add_argument("--lr", type=float, default=1e-4, help="DPO learning rate (default 1e-4)")
    p.add_argument("--out", default=None, metavar="DIR", help="save the offline-trained policy here")
    return parser


def _fail(message: str) -> int:
    print(f"slipstream: {message}", file=sys.stderr)
    return EXIT_CONFIG


def _resolve_model(name: str) -> str:
    from deploy.model_source import resolve_model
    from learner.models import check_model_dir

    path = resolve_model(name, log=lambda m: print(json.dumps({"proc": "setup", "event": m}), flush=True))
    check_model_dir(path)
    return path


def check_writable_dir(path: str, key: str) -> None:
    """Refuse, as one line, a directory setting that cannot be created or written into. Tried
    for real (the missing directories made, a file created in it and removed), since permission
    bits do not tell: root passes them, a read-only mount or a pseudo file system (/proc) does
    not. What the probe made is removed again, so a later config error leaves nothing behind; a
    directory that turns unwritable after this check is a runtime failure, not this line."""
    target = Path(path)
    missing, probe = [], target
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    created: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
        fd, name = tempfile.mkstemp(dir=target, prefix=".slipstream-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        if probe.exists() and not probe.is_dir():
            reason = f"{'it' if probe == target else probe} is not a directory"
        else:
            shown = e.filename and Path(e.filename) in missing[1:]        # a parent, not the probe
            reason = f"{e.strerror or e}" + (f": {e.filename}" if shown else "")
        raise StartupError(f"{key} {path!r} cannot be created or written ({reason}); "
                           f"point {key} at a writable directory") from None
    finally:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()


def _log_format(args) -> None:
    from deploy.logfmt import apply

    apply(getattr(args, "log_format", "auto"))


def _check_learner_dirs(lc, resume: str | None) -> None:
    """The learner's directories: the run directory (free for a new run: learner.state.run_dir),
    and the checkpoint and rollout-log directories where they are set apart from it."""
    from learner.state.run_dir import check_free

    if resume is None:
        check_free(lc.run_dir, lc.checkpoint.dir)
    check_writable_dir(lc.run_dir, "learner.run_dir")
    if lc.checkpoint.dir:
        check_writable_dir(lc.checkpoint.dir, "learner.checkpoint.dir")
    if lc.rollout_log is not None and lc.rollout_log.path:
        check_writable_dir(lc.rollout_log.path, "learner.rollout_log.path")


def _ctl(args) -> int:
    from deploy.ctl import ctl

    return ctl(args)


def _keys(args) -> int:
    from deploy.curve_keys import keys

    args.client = args.client if args.client is not None else ["rollout"]
    args.operator = args.operator if args.operator is not None else ["operator"]
    return keys(args)


def _config(args) -> int:
    from deploy.config_file import keys_markdown, load_config, resolved_yaml

    if args.keys:
        print(keys_markdown(), end="")
    elif args.from_trl or args.from_verl:
        print(_translate(args), end="")
    else:
        print(resolved_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _translate(args) -> str:
    """``config --from-trl`` / ``--from-verl``: the translation, checked by loading it."""
    from deploy.config_file import load_config
    from deploy.translate import from_trl, from_verl, read_trl, read_verl, render

    if args.from_trl and args.from_verl:
        raise StartupError("give --from-trl or --from-verl, not both")
    if args.config or args.overrides:
        raise StartupError("--from-trl / --from-verl translate a file of their own: drop --config and --set "
                           "(apply them to the translation with slipstream run --config OUT --set ...)")
    if args.from_trl:
        settings, source = read_trl(args.from_trl)
        if args.world_size is not None:
            settings["num_processes"] = args.world_size
        text = render(from_trl(settings, source))
    else:
        if args.world_size is not None:
            raise StartupError("--world-size is for --from-trl (verl's batch sizes are global)")
        settings, source = read_verl(args.from_verl)
        text = render(from_verl(settings, source))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        try:
            load_config(f.name)
        except StartupError as e:
            raise StartupError(f"the translation of {source} is not a valid slipstream config "
                               f"(a bug: please report it with the file): {e}") from None
    return text


def _report(args) -> int:
    from deploy.report import write_report

    print(write_report(args.run_dir, args.run_id, args.out))
    return 0


def _replay(args) -> int:
    from deploy.replay import replay

    return replay(args)


def _run(args) -> int:
    from deploy.config_file import load_config
    from deploy.launcher import launch

    cfg = load_config(args.config, args.overrides)
    _check_learner_dirs(cfg.learner, args.resume)
    return launch(cfg, args.config, args.overrides, resume=args.resume)


def _learner(args) -> int:
    from deploy.config_file import load_config
    from learner.data.prompts import check_dataset

    cfg = load_config(args.config, args.overrides)
    lc = cfg.learner                        # the datasets (and their keys) are checked before the model
    check_dataset(lc.data, lc.evaluation.data, seed=lc.seed, batch_prompts=lc.batch.batch_prompts)
    _check_learner_dirs(lc, args.resume)
    model_path = _resolve_model(cfg.model)
    _log_format(args)
    if args.nproc > 1:
        from learner.train.distributed import launch_ranks

        return launch_ranks(args.nproc, cfg.learner, args.config, args.overrides, args.resume)
    from learner.serve.service import serve

    return serve(cfg.learner, model_path, resume=args.resume)


def _rollout(args) -> int:
    from deploy.config_file import load_config
    from protocol.plumbing.sockets import check_endpoint

    cfg = load_config(args.config, args.overrides)
    rollout = cfg.rollout
    if args.learner:
        rollout = rollout.model_copy(update={"learner": args.learner})
    if args.engine:
        rollout = rollout.model_copy(update={"engine": args.engine})
    check_endpoint(rollout.learner, "--learner" if args.learner else "rollout.learner")
    model_path = _resolve_model(cfg.model)
    _log_format(args)
    from rollout_server.service import serve

    return serve(rollout, model_path)


COMMANDS = {"ctl": _ctl, "config": _config, "run": _run, "learner": _learner, "rollout": _rollout, "keys": _keys,
            "report": _report, "replay": _replay}


def _quiet_deepspeed() -> None:
    """Without a GPU, DeepSpeed (imported by transformers and peft once it is installed) warns
    "Setting accelerator to CPU" in every process; saying so up front (``DS_ACCELERATOR``, which
    the children of ``slipstream run`` inherit) is the same choice without the warning."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("learner", "rollout", "run"):
        _quiet_deepspeed()
    try:
        return COMMANDS[args.command](args)
    except StartupError as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
