"""`slipstream config` (the resolved config as YAML) and `slipstream config --keys` (every key),
and docs/configuration.md holding the current key reference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from deploy.config_file import SlipstreamConfig, keys_markdown, load_config
from learner.config import LIVE_KEYS, LearnerConfig, field_paths, model_of

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "deploy.cli"]
BEGIN, END = "<!-- BEGIN slipstream config --keys", "<!-- END slipstream config --keys -->"


def slipstream(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_config_prints_every_default_of_every_section_and_the_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  optimizer:\n    lr: 0.001\n")
    r = slipstream("config", "--config", str(f), "--set", "learner.staleness.max_staleness=3")
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["learner"]["optimizer"]["lr"] == 0.001 and data["learner"]["staleness"]["max_staleness"] == 3
    # Every section and every key is printed, defaults included, and it loads back as the same run.
    assert set(data) == set(SlipstreamConfig.model_fields)
    for section, info in LearnerConfig.model_fields.items():
        if model_of(info.annotation) is not None and data["learner"][section] is not None:
            assert set(data["learner"][section]) == set(model_of(info.annotation).model_fields), section
    again = tmp_path / "resolved.yaml"
    again.write_text(r.stdout)
    assert load_config(again) == load_config(f, ["learner.staleness.max_staleness=3"])


def test_config_with_a_flat_key_is_one_line_and_exit_2():
    r = slipstream("config", "--set", "learner.max_new_tokens=8")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0]
    assert "learner.max_new_tokens: moved to learner.sampling.max_new_tokens" in r.stderr


def test_keys_lists_every_key_once_with_its_type_default_and_liveness():
    r = slipstream("config", "--keys")
    assert r.returncode == 0 and r.stdout == keys_markdown()
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]*) \| `([^`]*)` \| ([^|]*) \|", r.stdout, re.M)
    listed = [key for key, *_ in rows]
    every = [p for p in field_paths(SlipstreamConfig)]
    assert sorted(listed) == sorted(every) and len(listed) == len(set(listed))
    by_key = {key: (takes, default, live.strip()) for key, takes, default, live in rows}
    assert by_key["learner.staleness.max_staleness"] == ("an integer >= 0", "1", "now")
    assert by_key["learner.optimizer.lr"][2] == "next step"
    assert by_key["learner.batch.group_size"][2] == "" and by_key["learner.batch.group_size"][1] == "8"
    assert {k.removeprefix("learner.") for k, (_, _, live) in by_key.items() if live} == set(LIVE_KEYS)


def test_the_docs_hold_the_current_key_reference():
    """docs/configuration.md's reference is exactly what `slipstream config --keys` prints now: a
    key added, removed or redocumented without regenerating it fails here. Regenerate:
    ``python tests/deploy/test_config_command.py``."""
    text = (REPO / "docs" / "configuration.md").read_text()
    assert BEGIN in text and END in text
    block = text[text.index(BEGIN):text.index(END)]
    block = block[block.index("\n") + 1:]
    assert block == keys_markdown(), "docs/configuration.md is stale: regenerate its key reference"


def regenerate() -> None:
    """Write the current `slipstream config --keys` between the markers of docs/configuration.md."""
    path = REPO / "docs" / "configuration.md"
    text = path.read_text()
    start = text.index("\n", text.index(BEGIN)) + 1
    path.write_text(text[:start] + keys_markdown() + text[text.index(END):])


if __name__ == "__main__":
    regenerate()
