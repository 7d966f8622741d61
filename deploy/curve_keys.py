"""``slipstream keys DIR``: CURVE key pairs for a run, laid out as the configs expect.

    DIR/learner.key, learner.key_secret      the learner (learner.security.secret_key_file)
    DIR/NAME.key, NAME.key_secret            each client: rollout servers, operators
    DIR/clients/NAME.key                     public keys of the rollout servers
                                             (learner.security.allowed_clients_dir)
    DIR/operators/NAME.key                   public keys of who may run `slipstream ctl`
                                             (learner.security.control_allowed_dir)

Secret files are written with mode 0600. Existing keys are never overwritten (a replaced key
locks out everyone who holds the old one): to add a client to a run, run it again with a new
name, or copy a client's ``.key`` into the allow-list directory (it is read again on change).
In Kubernetes, put each ``.key_secret`` in the Secret of the process that owns it and the
allow-list directories in the learner's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from protocol.errors import StartupError
from protocol.plumbing.curve import PUBLIC_SUFFIX, create_key_pair

LEARNER = "learner"


def generate(directory: str | Path, clients: list[str], operators: list[str]) -> dict[str, Path]:
    """Create the layout above; returns ``{name: secret key file}`` (the learner's included)."""
    d = Path(directory)
    names = [LEARNER, *clients, *operators]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise StartupError(f"slipstream keys: each name once, got {', '.join(dupes)} twice")
    for n in names:
        if not n or "/" in n or n.startswith("."):
            raise StartupError(f"slipstream keys: {n!r} is not a file name")
    secrets = {}
    for name in names:          # refuse before writing anything when one exists
        for p in (d / f"{name}.key", d / f"{name}.key_secret"):
            if p.exists():
                raise StartupError(f"{p} exists; remove it first (or choose another name): "
                                   "replacing a key locks out everyone who holds the old one")
    for name in names:
        public, secrets[name] = create_key_pair(d, name)
        for group, members in (("clients", clients), ("operators", operators)):
            if name in members:
                (d / group).mkdir(exist_ok=True)
                shutil.copyfile(public, d / group / f"{name}{PUBLIC_SUFFIX}")
    return secrets


def config_snippet(directory: str | Path, secrets: dict[str, Path], clients: list[str],
                   operators: list[str]) -> str:
    """The YAML to paste into a run's config, and the ctl flags (absolute paths throughout)."""
    d = Path(directory).resolve()
    secrets = {name: Path(p).resolve() for name, p in secrets.items()}
    lines = ["learner:", "  network:", "    bind_host: 0.0.0.0        # CURVE on: the sockets may leave loopback",
             "  security:", "    curve: true", f"    secret_key_file: {d / 'learner.key_secret'}",
             f"    allowed_clients_dir: {d / 'clients'}"]
    if operators:
        lines.append(f"    control_allowed_dir: {d / 'operators'}")
    if clients:
        lines += ["rollout:", "  security:", "    curve: true",
                  f"    secret_key_file: {secrets[clients[0]]}",
                  f"    learner_public_key_file: {d / 'learner.key'}"]
    if operators:
        lines += ["", f"# slipstream ctl --secret-key {secrets[operators[0]]} --learner-key "
                      f"{d / 'learner.key'} status"]
    return "\n".join(lines)


def keys(args) -> int:
    # Every path printed is absolute: the snippet is pasted into configs read from other
    # directories (and by processes started elsewhere), where a relative path means another file.
    directory = Path(args.dir).resolve()
    secrets = generate(directory, args.client, args.operator)
    for path in secrets.values():
        print(f"wrote {path} (secret) and {path.with_suffix('.key')}")
    print(config_snippet(directory, secrets, args.client, args.operator))
    return 0


RUN_KEYS = "keys"
"""``slipstream run`` (launcher.secure): the run's keys, in RUN_DIR/keys."""
RUN_SERVER, RUN_OPERATOR = "rollout", "operator"


def run_keys(run_dir: str | Path) -> tuple[dict, dict]:
    """``(learner.security, rollout.security)`` for a run whose keys are in ``RUN_DIR/keys``,
    generated there (owner-only) when missing; a resumed run finds and reuses them."""
    d = Path(run_dir).resolve() / RUN_KEYS
    names = (LEARNER, RUN_SERVER, RUN_OPERATOR)
    have = [n for n in names if (d / f"{n}.key_secret").exists()]
    if len(have) != len(names):
        if have:
            raise StartupError(f"{d} holds only some of the run's keys ({', '.join(have)}); remove "
                               "the directory to have new ones made, or set launcher.secure: false")
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        generate(d, [RUN_SERVER], [RUN_OPERATOR])
    learner = {"curve": True, "secret_key_file": str(d / f"{LEARNER}.key_secret"),
               "allowed_clients_dir": str(d / "clients"), "control_allowed_dir": str(d / "operators")}
    rollout = {"curve": True, "secret_key_file": str(d / f"{RUN_SERVER}.key_secret"),
               "learner_public_key_file": str(d / f"{LEARNER}{PUBLIC_SUFFIX}")}
    return learner, rollout


def run_operator_key(run_dir: str | Path) -> Path | None:
    """The operator's secret key ``slipstream run`` made for this run, if there is one."""
    p = Path(run_dir) / RUN_KEYS / f"{RUN_OPERATOR}.key_secret"
    return p if p.exists() else None
