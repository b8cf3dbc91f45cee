"""Put on PYTHONPATH by ``tokentrace run``: instruments frameworks as they are imported, in this
process and in every Python process it starts (they inherit PYTHONPATH). Then hands over to any
other ``sitecustomize`` the environment has, which this module would otherwise shadow."""

import importlib.util
import os
import sys

try:
    from tokentrace.agent.bootstrap import autoinstrument

    autoinstrument()
except Exception as error:  # never stop the host from starting
    print(f"tokentrace: automatic instrumentation is off: {error}", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
