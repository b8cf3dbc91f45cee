# The C object of _hooks.c (hooks.py holds its Python twin, HookGuard.run_python).
from collections.abc import Callable
from typing import Any

run: Callable[..., Any]
