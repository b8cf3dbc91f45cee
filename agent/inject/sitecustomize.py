"""The agent's way into a Python process: Python imports ``sitecustomize`` at start-up from
PYTHONPATH. One file, two ways in:

- ``tokentrace run`` puts this folder (inside the installed package) on PYTHONPATH;
- the injection image (deploy/images/) copies this same file to ``bootstrap/`` and to
  ``opentelemetry/instrumentation/auto_instrumentation/`` of its tree, beside
  ``tokentrace-packages/`` (``pip install --target`` of ``tokentrace[agent]``). PYTHONPATH names
  only those folders, which hold nothing but this file and no ``__init__.py`` on the way: a
  folder named ``opentelemetry`` there is at most a namespace portion, and the host's regular
  packages always win over it. Finding ``tokentrace-packages`` a few levels up, this file appends
  it at the END of sys.path, so the host's own protobuf, grpcio and opentelemetry win and the tree
  only fills in what the host lacks (tokentrace itself, wrapt, ...).

Then `tokentrace.agent.bootstrap.autoinstrument` instruments frameworks as they are imported, in
this process and in every Python process it starts (they inherit PYTHONPATH). Injected, the agent
runs on the host's copies of protobuf, grpcio and opentelemetry, so this first checks them
against tokentrace's own requirements: when one falls short, the host starts uninstrumented.
Last, this module hands over to any other ``sitecustomize`` the environment has, which it would
otherwise shadow. Only the standard library is imported before the package tree is on sys.path,
and nothing raises into the host: a problem is one line on stderr and the host starts
uninstrumented.
"""

import importlib.machinery
import importlib.util
import os
import sys

_PACKAGES_DIR = "tokentrace-packages"
_MAX_LEVELS_UP = 3  # bootstrap/ is 1 below the tree's root, .../auto_instrumentation/ 3


def _injected_packages(here: str) -> "str | None":
    folder = here
    for _ in range(_MAX_LEVELS_UP):
        folder = os.path.dirname(folder)
        candidate = os.path.join(folder, _PACKAGES_DIR)
        if os.path.isdir(candidate):
            return candidate
    return None


def _host_version_problem() -> "str | None":
    """The first requirement of ``tokentrace[agent]`` that the distribution this process sees
    first (the host's, where it has one) does not meet, as one sentence; None when all do."""
    from importlib.metadata import PackageNotFoundError, requires, version

    # packaging comes with opentelemetry-instrumentation (the host's or the tree's).
    from packaging.requirements import Requirement

    for line in requires("tokentrace") or ():
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": "agent"}):
            continue
        try:
            found = version(requirement.name)
        except PackageNotFoundError:
            return f"{requirement.name} is missing (tokentrace needs {requirement})"
        if not requirement.specifier.contains(found, prereleases=True):
            return (
                f"this environment's {requirement.name} {found} does not meet tokentrace's "
                f"requirement {requirement.name}{requirement.specifier}"
            )
    return None


_here = os.path.dirname(os.path.abspath(__file__))
try:
    _packages = _injected_packages(_here)
    if _packages is not None and _packages not in sys.path:
        sys.path.append(_packages)
    # Injected, the agent runs on the host's copies of its dependencies: check them first.
    _problem = None if _packages is None else _host_version_problem()
    if _problem is not None:
        print(f"tokentrace: automatic instrumentation is off: {_problem}", file=sys.stderr)
    else:
        from tokentrace.agent.bootstrap import autoinstrument

        autoinstrument()
except Exception as error:  # never stop the host from starting
    print(f"tokentrace: automatic instrumentation is off: {error}", file=sys.stderr)


def _next_sitecustomize() -> "importlib.machinery.ModuleSpec | None":
    """The next ``sitecustomize`` on sys.path that is not a copy of this one (both of the
    tree's folders may be on PYTHONPATH: handing over to a copy would loop)."""
    with open(__file__, "rb") as source:
        ours = source.read()
    skipped = {_here}
    while True:
        rest = [p for p in sys.path if os.path.abspath(p or ".") not in skipped]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.origin is None:
            return spec
        try:
            with open(spec.origin, "rb") as source:
                if source.read() != ours:
                    return spec
        except OSError:
            return spec
        skipped.add(os.path.dirname(os.path.abspath(spec.origin)))


try:
    _spec = _next_sitecustomize()
except Exception as error:
    _spec = None
    print(f"tokentrace: cannot look for another sitecustomize: {error}", file=sys.stderr)
# The other module's own errors reach Python's start-up as they would without tokentrace.
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
