"""bench/engine_step_instructions.py's children run the real patches (without valgrind here: the
counting is valgrind's; what must not rot is what it counts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_step_instructions.py"


@pytest.mark.parametrize(
    "child",
    [
        ["steps", "2", "traced", "50"],
        ["steps", "16", "bare", "50"],
        ["calls", "direct", "100"],
        ["calls", "wrapt", "100"],
        ["calls", "none", "100"],
    ],
)
def test_each_child_runs_its_loop(child: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(_BENCH), "--child", *child], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
