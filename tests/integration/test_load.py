"""R4 in CI: 8 protocol-level clients push results at full speed at a real learner for a few
seconds (tests/bench/bench_load.py runs 60 s and reports the figures). See load_kit.py."""

from __future__ import annotations

import pytest
from load_kit import check, run_load

pytestmark = pytest.mark.slow


def test_eight_clients_at_full_speed_lose_nothing_and_duplicate_nothing(
        tmp_path, tiny_model_dir, subprocess_env, process_groups):
    figures = run_load(tmp_path, tiny_model_dir, subprocess_env, process_groups.popen,
                       clients=8, duration_s=12.0)
    print({k: v for k, v in figures.items() if k != "rss_curve_mb"})
    check(figures)
