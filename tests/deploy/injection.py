"""The injection tree and an engine's environment without tokentrace, for the image tests.

`injection_tree` runs deploy/images/install.sh (the Dockerfile's own install step) into a cache
outside the clone, like the project's virtual environment: ``~/.cache/tokentrace/injection/``,
keyed on the hash of everything the tree is built from (the package sources, pyproject.toml,
constraints.txt, the script, the Python version), so a warm machine reuses it and any change to
the agent rebuilds it. CI machines keep nothing between runs: the cold build is measured and
written next to the tree (``build_s``) and printed by the tests.

`engine_environment` is what an inference server's image looks like before injection: the
project's environment (vLLM and its dependencies, protobuf, grpcio, opentelemetry included) minus
tokentrace and the packages only tokentrace needs (opentelemetry-instrumentation, wrapt). It is
a virtual environment of the same base interpreter whose site-packages mirror the project's
through symlinks, leaving out those distributions' files: nothing is copied or installed, and the
project's environment is not touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from importlib.metadata import distributions
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPOSITORY / "deploy" / "images" / "install.sh"
DOCKERFILE = REPOSITORY / "deploy" / "images" / "Dockerfile"
PACKAGES_DIR = "tokentrace-packages"
BOOTSTRAP_DIR = "bootstrap"
OPERATOR_DIR = "opentelemetry/instrumentation/auto_instrumentation"
"""Where the OpenTelemetry Operator's PYTHONPATH looks first (pkg/instrumentation/python.go)."""
AUTO_INSTRUMENTED = ["llama_cpp.server", "sglang", "transformers.cli.serving", "vllm"]
"""The modules whose import instruments them (``bootstrap.registered``, sorted): every
instrumentor but the opt-in in-process generate()."""
ENGINE_ONLY_WITHOUT = ("tokentrace", "opentelemetry-instrumentation", "wrapt")
"""Distributions in the project's environment that an engine's own install does not have."""

_CACHE_ROOT = Path.home() / ".cache" / "tokentrace" / "injection"
_SOURCES = ("agent", "collector", "processors", "loadgen")
_BUILD_TIMEOUT_S = 600.0
_UNUSED_FOR_S = 7 * 24 * 3600.0


def operator_pythonpath(mount: Path) -> str:
    """PYTHONPATH as the OpenTelemetry Operator sets it, the tree copied to `mount`."""
    return f"{mount / OPERATOR_DIR}{os.pathsep}{mount}"


def kustomize_pythonpath(mount: Path) -> str:
    """PYTHONPATH as tokentrace's own Kustomize component sets it."""
    return str(mount / BOOTSTRAP_DIR)


def images_python() -> str:
    """The interpreter under this environment (the images' Python, 3.11): pip run by it picks
    the wheels an image would, and it has none of the project's packages."""
    return str(getattr(sys, "_base_executable", sys.executable))


def _source_files() -> Iterable[Path]:
    yield from (REPOSITORY / name for name in ("pyproject.toml", "README.md", "constraints.txt"))
    yield INSTALL_SCRIPT
    for folder in _SOURCES:
        yield from sorted(
            path
            for path in (REPOSITORY / folder).rglob("*")
            # The checkout's compiled extensions: an install builds its own (test_images).
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so"
        )


def tree_key() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for path in _source_files():
        digest.update(str(path.relative_to(REPOSITORY)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def run_install(target: str, prefix: Path, *, source: Path = REPOSITORY) -> float:
    """Run the images' install step for `target` into `prefix` from `source` (a checkout);
    its duration in seconds."""
    started = time.monotonic()
    result = subprocess.run(
        ["sh", str(INSTALL_SCRIPT), str(source), target, str(prefix)],
        env={**os.environ, "PYTHON": images_python(), "PIP_NO_WARN_SCRIPT_LOCATION": "1"},
        capture_output=True,
        text=True,
        timeout=_BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, f"install.sh {target} failed:\n{result.stderr[-4000:]}"
    return time.monotonic() - started


def injection_tree() -> Path:
    """The injection tree of the current sources, built once per content (see the module)."""
    tree = _CACHE_ROOT / tree_key()
    if (tree / ".ready").exists():
        (tree / ".ready").touch()  # in use: not pruned
        return tree
    _CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    building = _CACHE_ROOT / f"{tree.name}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    build_s = run_install("autoinstrumentation", building)
    (building / "build_s").write_text(f"{build_s:.1f}\n", encoding="utf-8")
    (building / ".ready").touch()
    try:
        building.rename(tree)
    except OSError:  # another session built the same content meanwhile
        shutil.rmtree(building, ignore_errors=True)
    _prune(keep=tree)
    return tree


def _prune(*, keep: Path) -> None:
    """Remove the trees of other sources that no test has used for `_UNUSED_FOR_S` (every
    change to the agent builds a new one, ~40 MB)."""
    for other in _CACHE_ROOT.iterdir():
        ready = other / ".ready"
        if other != keep and ready.exists() and time.time() - ready.stat().st_mtime > _UNUSED_FOR_S:
            shutil.rmtree(other, ignore_errors=True)


def _hidden_files(names: Iterable[str]) -> tuple[Path, set[Path]]:
    """The project's site-packages and the files there of the distributions `names`.

    Looked up in site-packages alone: on sys.path a checkout's own ``tokentrace.egg-info`` (left
    by the editable install) can come first, and its root is the checkout, not site-packages."""
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    hidden: set[Path] = set()
    for name in names:
        (dist,) = distributions(name=name, path=[str(site_packages)])
        for file in dist.files or ():
            path = Path(os.path.normpath(site_packages / file))
            if path.is_relative_to(site_packages):
                hidden.add(path)
    return site_packages, hidden


def _mirror(source: Path, destination: Path, hidden: set[Path], hidden_dirs: set[Path]) -> bool:
    """Link `source`'s entries into `destination` but the hidden ones; whether any was."""
    destination.mkdir(exist_ok=True)
    linked = False
    for entry in source.iterdir():
        if entry in hidden:
            continue
        if entry.name == "__pycache__":  # compiled sources: used only beside their source
            (destination / entry.name).symlink_to(entry)
        elif entry in hidden_dirs and entry.is_dir() and not entry.is_symlink():
            linked = _mirror(entry, destination / entry.name, hidden, hidden_dirs) or linked
        else:
            (destination / entry.name).symlink_to(entry)
            linked = True
    if not linked:  # left empty, it would still import as a namespace package
        shutil.rmtree(destination)
    return linked


def engine_environment(directory: Path, *, without: Iterable[str] = ENGINE_ONLY_WITHOUT) -> Path:
    """A virtual environment in `directory` that is the project's minus `without` (see the
    module); its python."""
    subprocess.run(
        [images_python(), "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120
    )
    site_packages, hidden = _hidden_files(without)
    # Folders that hold a hidden file are mirrored entry by entry, everything else is one link.
    hidden_dirs = {parent for path in hidden for parent in path.parents}
    python = directory / "bin" / "python"
    _mirror(site_packages, engine_site_packages(python), hidden, hidden_dirs)
    return python


def engine_site_packages(python: Path) -> Path:
    """The site-packages of `engine_environment`'s python (a mirror of links)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return python.parent.parent / "lib" / version / "site-packages"
