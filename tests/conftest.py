"""Shared fixtures: a tiny model directory built in code, free ports, process cleanup."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init tiny Llama + char tokenizer saved to disk (no warm-up: fast)."""
    from deploy.builtin import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    tok = build_tokenizer()
    model = build_model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def subprocess_env(tmp_path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLIPSTREAM_CACHE=str(tmp_path / "cache"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env
