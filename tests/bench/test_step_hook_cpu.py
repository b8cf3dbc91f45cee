"""bench/step_hook_cpu.py's probe: it fits the current ``agent/_steps.c``, compiles, and the
hooks it measures write what the bench reads (driven by the tests' stand-in vLLM scheduler)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.step_hook_cpu import PROBE_LOG_ENV, build_probe, probed_source, read_probe
from tokentrace.agent.frameworks import vllm_engine

_ROOT = Path(__file__).resolve().parents[2]
_STEPS = 1_200  # the probe writes every 500 steps: two lines

_CHILD = """
import importlib.util, sys
sys.path.insert(0, sys.argv[2])
spec = importlib.util.spec_from_file_location("tokentrace.agent._steps", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules["tokentrace.agent._steps"] = module  # the probe build, in place of the installed
from bench.engine_step_instructions import _child_steps
_child_steps(16, int(sys.argv[3]), True)
"""


def test_the_probe_fits_the_source_and_refuses_one_it_does_not_fit() -> None:
    source = (_ROOT / "agent/_steps.c").read_text()
    probed = probed_source(source)
    assert probed.count("probe_call_original(self->original") == 2
    # Only EngineCore's step hooks: the API server's output hook in the same file is not probed.
    calls = "PyObject_Vectorcall(self->original"
    assert probed.count(calls) == source.count(calls) - 2
    assert "step_hook_vectorcall_unprobed(callable" in probed
    with pytest.raises(ValueError, match="no longer fits"):
        probed_source(source.replace("PyObject_Vectorcall(self->original", "call(self->original"))


@pytest.mark.skipif(not vllm_engine.BUILT, reason="the C hooks are not built here")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
def test_the_probe_build_measures_the_hooks_of_each_step(tmp_path: Path) -> None:
    headers = {name: (_ROOT / "agent" / name).read_text() for name in ("_guard.h",)}
    built = build_probe((_ROOT / "agent/_steps.c").read_text(), tmp_path, headers)
    log = tmp_path / "probe.log"
    env = {**os.environ, PROBE_LOG_ENV: str(log)}
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(built), str(_ROOT), str(_STEPS)],
        env=env, check=True, timeout=120,
    )  # fmt: skip
    assert len(log.read_text().splitlines()) == _STEPS // 500
    measured = read_probe(log)
    assert measured is not None
    steps, per_step_ns, share = measured
    assert steps == 1_000
    # Some CPU in the hooks, less than the whole thread's (which also ran the scheduler).
    assert per_step_ns > 0 and 0 < share < 100
