"""A real small filesystem for tests of a full disk (issue 31.5): a tmpfs mounted for the test
(CI runs as root; elsewhere the test is skipped), and a filler that takes every free byte."""

from __future__ import annotations

import contextlib
import errno
import subprocess
import tempfile
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(size: str = "1m"):
    """A real filesystem of ``size`` bytes (tmpfs): ENOSPC for real."""
    d = Path(tempfile.mkdtemp(prefix="full-disk-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk``; the filler's path (delete it to free the disk)."""
    filler = disk / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                if not f.write(block):
                    break
            except OSError as e:
                assert e.errno == errno.ENOSPC
                if len(block) == 1:
                    break
                block = block[:len(block) // 2]
    return filler
