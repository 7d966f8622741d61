"""Stacks on demand (issue 38 item 3) in a real process: SIGUSR1 writes every thread's and every
asyncio task's stack while the loop runs, and the threads' stacks even while a blocking call
holds the loop — the frame it is stuck in is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import asyncio, json, sys, threading, time
    from pathlib import Path
    from protocol.plumbing.stacks import install_stack_dump

    def log(event, **fields):
        print(json.dumps({"event": event, **fields}), flush=True)

    def worker_waits(stop):
        stop.wait()

    def blocked_in_sleep(seconds):
        time.sleep(seconds)

    async def idle_task_waits(forever):
        await forever.wait()

    async def main():
        remove = install_stack_dump("probe", Path(sys.argv[1]), log)
        stop = threading.Event()
        threading.Thread(target=worker_waits, args=(stop,), name="worker", daemon=True).start()
        forever = asyncio.Event()
        asyncio.create_task(idle_task_waits(forever), name="idler")
        log("ready")
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        log("blocking")
        blocked_in_sleep(float(line))          # the loop is stuck here
        await asyncio.sleep(0.5)               # the loop's handler runs now
        log("unblocked")
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        stop.set()
        remove()
        log("removed")

    asyncio.run(main())
''')


def _events(proc, until: str, timeout_s: float = 30) -> list[dict]:
    out, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:                # say how it ended: a signal (-10: SIGUSR1 not handled) or its error
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the probe exited ({proc.wait(timeout=10)}) waiting for {until!r} "
                                 f"after {out}: {err[-2000:]}")
        ev = json.loads(line)
        out.append(ev)
        if ev["event"] == until:
            return out
    raise AssertionError(f"no {until!r} in {out}")


def _wait_for(path: Path, text: str, timeout_s: float = 10) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and text in (content := path.read_text()):
            return content
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_sigusr1_writes_the_stacks_even_from_a_blocked_loop(tmp_path, process_groups):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = process_groups.popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _events(proc, "ready")
    threads_file = tmp_path / f"stacks-probe-{proc.pid}.threads.txt"
    assert threads_file.exists() and threads_file.stat().st_size == 0

    # The loop alive: the full file, threads by name and tasks with their coroutine stacks.
    os.kill(proc.pid, signal.SIGUSR1)
    (written,) = [e for e in _events(proc, "stacks_written")]
    text = Path(written["path"]).read_text()
    assert "## thread worker" in text and "worker_waits" in text
    assert "## task idler" in text and "idle_task_waits" in text
    assert "# probe pid" in text

    # The loop blocked in a call: faulthandler names the frame at once; the loop's own file
    # follows once the call returns.
    proc.stdin.write("4\n")
    proc.stdin.flush()
    _events(proc, "blocking")
    time.sleep(0.3)                                       # inside time.sleep now
    before = threads_file.stat().st_size
    os.kill(proc.pid, signal.SIGUSR1)
    content = _wait_for(threads_file, "blocked_in_sleep", timeout_s=3)  # while still blocked
    assert threads_file.stat().st_size > before and "Thread" in content
    later = _events(proc, "unblocked")
    assert [e["event"] for e in later].count("stacks_written") == 1

    # Removed at exit: the handlers go, and a used threads file stays.
    proc.stdin.write("\n")
    proc.stdin.flush()
    _events(proc, "removed")
    assert proc.wait(timeout=30) == 0
    assert threads_file.exists()


def test_an_unused_threads_file_is_removed_at_exit(tmp_path, process_groups):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = process_groups.popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _events(proc, "ready")
    proc.stdin.write("0\n\n")
    proc.stdin.flush()
    _events(proc, "removed")
    assert proc.wait(timeout=30) == 0
    assert list(tmp_path.iterdir()) == []


CHURN = textwrap.dedent('''
    import asyncio, sys, threading, time
    from pathlib import Path
    from protocol.plumbing.stacks import install_stack_dump

    async def main():
        remove = install_stack_dump("churn", Path(sys.argv[1]), lambda *a, **k: None)
        print("ready", flush=True)
        while sys.stdin.readable():
            threads = [threading.Thread(target=time.sleep, args=(0.001,)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            await asyncio.sleep(0)
            if Path(sys.argv[1], "stop").exists():
                break
        remove()
        print("removed", flush=True)

    asyncio.run(main())
''')


def test_signals_while_threads_start_and_end_do_not_kill_the_process(tmp_path, process_groups):
    """Threads that come and go (a metrics scrape's request thread) while SIGUSR1 arrives: the
    C-level faulthandler dump this replaced died of SIGSEGV within tens of signals here."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = process_groups.popen([sys.executable, "-c", CHURN, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"
    for _ in range(400):
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.002)
        assert proc.poll() is None, f"the process died ({proc.returncode}): {proc.stderr.read()[-2000:]}"
    (tmp_path / "stop").touch()
    assert proc.stdout.readline() == "removed\n"
    assert proc.wait(timeout=30) == 0
    threads = (tmp_path / f"stacks-churn-{proc.pid}.threads.txt").read_text()
    assert threads.count("Current thread") >= 100 and "in main" in threads
