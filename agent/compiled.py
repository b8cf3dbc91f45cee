"""tokentrace's optional C extensions: which of them run here.

Each is built with the package where a C compiler is at hand (``pyproject.toml``'s
``ext-modules``, all ``optional``) and every function in them has a pure-Python twin that gives
the same answers. ``TOKENTRACE_PURE_PYTHON=1`` turns all of them off (to compare, or to rule
them out). Standard library only: the agent imports this inside the host's server.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Final

PURE_PYTHON_ENV: Final = "TOKENTRACE_PURE_PYTHON"


def load(module_name: str) -> ModuleType | None:
    """The extension module ``module_name``, or None when it is not built here or the C
    functions are turned off (``PURE_PYTHON_ENV``)."""
    if os.environ.get(PURE_PYTHON_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        return importlib.import_module(module_name)
    except ImportError:  # built without a C compiler: the twins answer
        return None
