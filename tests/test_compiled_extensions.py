"""The optional C extensions are built wherever a C compiler is (agent/compiled.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tokentrace.agent import compiled, span_encoding
from tokentrace.agent.frameworks import vllm_engine
from tokentrace.processors import native

_EXTENSIONS = [
    ("tokentrace.processors._native", "processors/_native.c", native.BUILT),
    ("tokentrace.agent._wire", "agent/_wire.c", span_encoding.BUILT),
    ("tokentrace.agent._steps", "agent/_steps.c", vllm_engine.BUILT),
]


@pytest.mark.parametrize(("module", "source", "built"), _EXTENSIONS)
def test_each_extension_is_built_where_a_compiler_is(module: str, source: str, built: bool) -> None:
    # The extensions are optional so that a machine without a compiler still installs; where one
    # is (this project's dev and CI machines), a failed build must not pass silently.
    if os.environ.get(compiled.PURE_PYTHON_ENV):
        pytest.skip(f"{compiled.PURE_PYTHON_ENV} is set")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    assert built, f"{source} was not built: see the install's output"
    assert compiled.load(module) is not None


def test_the_environment_turns_every_extension_off() -> None:
    code = (
        "from tokentrace.agent import span_encoding\n"
        "from tokentrace.agent.frameworks import vllm_engine\n"
        "from tokentrace.processors import native\n"
        "print(span_encoding.BUILT, native.BUILT, vllm_engine.BUILT,"
        " span_encoding.length_delimited.__name__)\n"
    )
    environment = {**os.environ, compiled.PURE_PYTHON_ENV: "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment
    )
    assert done.stdout.split() == ["False", "False", "False", "length_delimited_python"]
