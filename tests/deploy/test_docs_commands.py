"""Every command in the README and docs/ is one that works today: each `slipstream ...` command
(in a shell block or inline) parses against the real CLI, each benchmark command names a script
that exists and flags that script has, every file a command names exists, and the README's test
command is what .ci/run runs. (The commands themselves run in their own tests: the demo in
tests/integration/test_demo.py, ctl in tests/learner/serve/test_control_live.py, the benchmark
scripts by hand, as docs/benchmarks.md says.)"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\[|\||\.\.\.|…|\b[A-Z][A-Z_]{2,}\b|<[^>]+>|\$")


def shell_lines() -> list[tuple[str, str]]:
    """(doc, command) of every command line of every shell code block, comments cut, `&&` split."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                for part in (p.strip() for p in line.split("&&")):
                    if part and not part.startswith("#"):
                        out.append((doc.name, part))
    return out


def inline_slipstream() -> list[tuple[str, str]]:
    """(doc, span) of the inline `slipstream ...` spans of the prose (commands and synopses)."""
    return [(doc.name, " ".join(span.split())) for doc in DOCS
            for span in re.findall(r"`(slipstream [^`]+)`", doc.read_text())]


SLIPSTREAM = [c for c in shell_lines() if c[1].startswith("slipstream ")]
INLINE = inline_slipstream()
BENCH = [c for c in shell_lines() if re.match(r"python3? tests/bench/", c[1])]


def test_the_docs_have_commands_to_check():
    assert len(SLIPSTREAM) >= 1 and len(INLINE) >= 20 and len(BENCH) >= 10, (len(SLIPSTREAM), len(INLINE), len(BENCH))


@pytest.mark.parametrize("doc, command", SLIPSTREAM, ids=[c for _, c in SLIPSTREAM])
def test_a_documented_slipstream_command_parses(doc, command):
    words = shlex.split(command)[1:]
    if ">" in words:                          # the shell's redirection is not the command's
        words = words[:words.index(">")]
    try:
        build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"{doc}: `{command}` does not parse (exit {e.code})")


def subcommands() -> dict:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    return sub.choices


@pytest.mark.parametrize("doc, span", INLINE, ids=[c for _, c in INLINE])
def test_a_slipstream_command_named_in_the_prose_exists_with_its_flags(doc, span):
    """An inline `slipstream ...` is a whole command (it parses) or a synopsis: its subcommand and
    every flag it names exist."""
    words = span.split()
    commands = subcommands()
    assert words[1] in commands, f"{doc}: `{span}`: no subcommand {words[1]!r}"
    if not PLACEHOLDER.search(" ".join(words[2:])):
        try:
            build_parser().parse_args(words[1:])
            return
        except SystemExit:
            pass                              # a synopsis without its arguments: check the flags
    known = set(commands[words[1]]._option_string_actions)
    flags = {w.split("=")[0].strip("[]") for w in words[2:] if w.lstrip("[").startswith("--")}
    assert flags <= known, f"{doc}: `{span}`: slipstream {words[1]} has no {sorted(flags - known)}"


@functools.cache
def script_help(script: str) -> str:
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, f"{script} --help: {r.stderr[-2000:]}"
    return r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("doc, command", BENCH, ids=[c for _, c in BENCH])
def test_a_documented_benchmark_names_a_script_and_flags_it_has(doc, command):
    words = shlex.split(command)
    script = words[1]
    assert (REPO / script).is_file(), f"{doc}: {script} does not exist"
    flags = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
    missing = [f for f in flags if not re.search(rf"(^|[\s,\[]){re.escape(f)}\b", script_help(script), re.M)]
    assert not missing, f"{doc}: `{command}`: {script} has no {missing}"


def test_the_files_a_command_names_exist():
    for doc, command in shell_lines():
        for word in shlex.split(command, comments=True):
            word = word.split("=", 1)[-1]
            if re.match(r"(deploy|tests|docs)/[\w./-]+\.\w+$", word):
                assert (REPO / word).exists(), f"{doc}: `{command}` names {word}, which does not exist"


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    test_cmd = re.search(r"Run the test suite.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    assert test_cmd.endswith("python -m pytest -q"), test_cmd
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "python -m pytest -q" and 'pip install --quiet -e ".[dev]"' in ci
