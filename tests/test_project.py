"""Project-level invariants: packaging, the telemetry contract's single home, import hygiene."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tokentrace.agent import semconv

ROOT = Path(__file__).resolve().parent.parent
CODE_FOLDERS = {
    "agent": "tokentrace/agent",
    "collector": "tokentrace/collector",
    "processors": "tokentrace/processors",
    "loadgen": "tokentrace/loadgen",
}


@pytest.mark.slow
def test_every_package_folder_is_in_the_wheel(tmp_path: Path) -> None:
    # Build from a copy: setuptools writes tokentrace.egg-info next to pyproject.toml, and a
    # stale one in the checkout would shadow the installed entry points.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *CODE_FOLDERS):
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("tokentrace-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, installed in CODE_FOLDERS.items():
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder).as_posix()
            assert f"{installed}/{relative}" in names, f"{source} is missing from the wheel"
    assert not any(
        name.startswith(tuple(f"{folder}/" for folder in CODE_FOLDERS)) for name in names
    )


def test_telemetry_doc_is_generated_from_the_contract() -> None:
    documented = (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8")
    assert documented == semconv.contract_markdown(), "run `make docs` to regenerate"


def _contract_strings() -> set[str]:
    """Contract values specific enough that seeing one quoted elsewhere means a re-spelling."""
    values = set()
    for name in dir(semconv):
        value = getattr(semconv, name)
        if name.isupper() and isinstance(value, str) and "." in value and len(value) > 8:
            values.add(value)
    for value in semconv.OTLP_METRIC_NAMES.values():
        values.add(value)
    return values


def test_no_module_but_semconv_spells_a_contract_name() -> None:
    contract = _contract_strings()
    offenders = []
    for folder in CODE_FOLDERS:
        for source in (ROOT / folder).rglob("*.py"):
            if source.name == "semconv.py":
                continue
            for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in contract:
                    offenders.append(f"{source.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, "use the semconv constants instead:\n" + "\n".join(offenders)


def _imported_names(source: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_nothing_in_the_package_imports_the_test_suite() -> None:
    offenders = [
        f"{source.relative_to(ROOT)}: {name}"
        for folder in CODE_FOLDERS
        for source in (ROOT / folder).rglob("*.py")
        for name in _imported_names(source)
        if name == "tests" or name.startswith("tests.")
    ]
    assert not offenders


def _modules_loaded_by(*modules: str) -> set[str]:
    """What importing ``modules`` loads, in a fresh interpreter."""
    code = (
        "import importlib, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


# What an inference server's process must never load because tokentrace is in it: the
# collector's side, client tools, the web and SQL stacks, the sketches, and (until the engine
# itself imports them) the engine and the gRPC stack.
_NOT_IN_AN_INFERENCE_SERVER = (
    "tokentrace.collector",
    "tokentrace.processors",
    "tokentrace.loadgen",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "sqlite3",
    "yaml",
    "ddsketch",
    "numpy",
    "grpc",
    "vllm",
    "torch",
)


def _loaded_from(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(
        name for name in loaded for package in packages
        if name == package or name.startswith(f"{package}.")
    )  # fmt: skip


def test_the_in_process_agent_loads_nothing_beyond_its_footprint() -> None:
    # The footprint rule is on what is loaded, not on folders: `tokentrace run`'s bootstrap, the
    # runtime (recorder, span building, export) and every framework patch.
    loaded = _modules_loaded_by(
        "tokentrace.agent.bootstrap",
        "tokentrace.agent.runtime",
        "tokentrace.agent.frameworks.vllm",
        "tokentrace.agent.frameworks.asgi",
    )
    assert "tokentrace.agent.spans" in loaded  # the probe did import the agent
    assert _loaded_from(loaded, _NOT_IN_AN_INFERENCE_SERVER) == []


def test_the_in_process_agent_imports_nothing_beyond_its_footprint_anywhere() -> None:
    # The probe above sees import-time loads; this sees the imports inside functions too. The
    # engine and gRPC are left out: the agent imports them when it patches and exports.
    lazy_allowed = ("grpc", "vllm", "torch")
    forbidden = tuple(name for name in _NOT_IN_AN_INFERENCE_SERVER if name not in lazy_allowed)
    node_agent = (ROOT / "agent" / "node", ROOT / "agent" / "node_cli.py")
    offenders = [
        f"{source.relative_to(ROOT)}: {name}"
        for source in (ROOT / "agent").rglob("*.py")
        if not any(source == part or part in source.parents for part in node_agent)
        for name in _imported_names(source)
        if _loaded_from({name}, forbidden)
    ]
    assert not offenders


def test_the_node_agent_loads_the_receivers_but_not_the_collector() -> None:
    # The receivers are imported when the node agent starts them: load them as it does.
    receivers = (
        "tokentrace.collector.receivers.otlp_grpc",
        "tokentrace.collector.receivers.otlp_http",
    )
    loaded = _modules_loaded_by(
        "tokentrace.agent.node.service", "tokentrace.agent.node_cli", *receivers
    )
    collector_side = set(_loaded_from(loaded, ("tokentrace.collector",)))
    allowed = ("tokentrace.collector.consumer", "tokentrace.collector.receivers")
    assert "tokentrace.collector.receivers.otlp_http" in collector_side  # the probe loaded them
    assert collector_side - {"tokentrace.collector"} == set(_loaded_from(loaded, allowed))
    # The OTLP/HTTP receiver is served by uvicorn (h11 protocol, raw ASGI app): no web framework.
    node_agent_allowed = ("tokentrace.collector", "grpc", "uvicorn")
    not_in_a_node_agent = tuple(
        name for name in _NOT_IN_AN_INFERENCE_SERVER if name not in node_agent_allowed
    )
    assert _loaded_from(loaded, not_in_a_node_agent) == []


def test_tokentrace_help_lists_commands_without_importing_heavy_modules() -> None:
    code = (
        "import sys\n"
        "from tokentrace.agent.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('fastapi', 'grpc', 'sqlite3', 'yaml', 'ddsketch')\n"
        "         if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "collector" in result.stdout and "explain" in result.stdout
    assert "HEAVY []" in result.stdout
