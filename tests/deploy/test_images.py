"""tokentrace's images (deploy/images/): the Dockerfile's stages, and what its install step builds.

No container engine runs here: the Dockerfile is checked as text (its targets, one pinned base,
numeric users, no build tools in what ships), and its install step, deploy/images/install.sh,
runs into a temporary prefix (the injection tree is cached, tests/deploy/injection.py). The tree
is then tried the way a pod uses it: a plain Python with nothing but the PYTHONPATH that the
OpenTelemetry Operator or our Kustomize component sets, in an environment that has the engine's
own protobuf, grpcio and opentelemetry (`engine_environment`): the agent must activate, come from
the tree, and leave every package the environment has to the environment.
The real vLLM under the same injection is tests/vllm/test_injection.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.injection import (
    AUTO_INSTRUMENTED,
    BOOTSTRAP_DIR,
    DOCKERFILE,
    OPERATOR_DIR,
    PACKAGES_DIR,
    REPOSITORY,
    engine_environment,
    engine_site_packages,
    images_python,
    injection_tree,
    kustomize_pythonpath,
    operator_pythonpath,
    run_install,
)

TARGETS = ("collector", "node-agent", "autoinstrumentation")
IMAGE_USER = "10001:10001"
_BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|cc|clang|make|cmake|build-essential|apt-get|apt|pip install|python3?-dev)\b"
)
_PROBE_TIMEOUT_S = 60.0
_HOST_MODULES = (
    "google.protobuf",
    "grpc",
    "opentelemetry.trace",
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)
"""Modules the engine's environment has: they must come from there, injected or not."""
_FILLED_MODULES = (
    "tokentrace.agent.bootstrap",
    "wrapt",
    "opentelemetry.instrumentation.instrumentor",
)
"""Modules only the tree has."""
_PROBE = """
import importlib, json, sys
files = {}
for name in sys.argv[1:]:
    try:
        files[name] = importlib.import_module(name).__file__
    except ImportError:
        files[name] = None
bootstrap = sys.modules.get("tokentrace.agent.bootstrap")
print(json.dumps({
    "files": files,
    "registered": None if bootstrap is None else bootstrap.registered,
    "last_path": sys.path[-1],
}))
"""


# ---------------------------------------------------------------- the Dockerfile, as text


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_stages(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARGs, stages by name) of a Dockerfile: continuation lines joined, comments out."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    arguments: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in joined.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = Stage(match[2], match[1])
            assert current.name not in stages, f"stage {current.name} twice"
            stages[current.name] = current
        elif current is None:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, value = rest.partition("=")
            arguments[name] = value
        else:
            current.instructions.append((keyword, rest))
    return arguments, stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    stage = stages[name]
    return [*(chain(stages, stage.base) if stage.base in stages else []), stage]


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return dockerfile_stages(DOCKERFILE.read_text(encoding="utf-8"))


def test_the_dockerfile_has_the_three_targets_on_one_base_pinned_by_digest(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    arguments, stages = dockerfile
    assert set(TARGETS) <= set(stages)
    assert re.fullmatch(
        r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", arguments["PYTHON_BASE"]
    ), arguments
    # The digest lives in one place: every stage starts from that ARG or from another stage.
    for stage in stages.values():
        assert stage.base == "${PYTHON_BASE}" or stage.base in stages, stage
    assert DOCKERFILE.read_text(encoding="utf-8").count("@sha256:") == 1


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_runs_as_a_numeric_user_without_build_tools(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str
) -> None:
    _, stages = dockerfile
    shipped = chain(stages, target)
    instructions = [item for stage in shipped for item in stage.instructions]
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] == IMAGE_USER
    assert re.fullmatch(r"\d+:\d+", users[-1])
    for keyword, rest in instructions:
        if keyword == "RUN":
            assert not _BUILD_TOOLS.search(rest.replace("pip uninstall", "")), rest
        if keyword in ("COPY", "ADD"):
            # Only what a build stage made, never the sources.
            match = re.match(r"--from=(\S+) ", rest)
            assert match and match[1] in stages, rest
            builder = chain(stages, match[1])
            runs = [r for stage in builder for k, r in stage.instructions if k == "RUN"]
            assert any(f"install.sh /src {target} " in run for run in runs), runs
    entrypoint = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    if target == "autoinstrumentation":
        # An init container copies the tree (the Operator names this command itself).
        assert not entrypoint
        command = [rest for keyword, rest in instructions if keyword == "CMD"][-1]
        assert json.loads(command) == [
            "cp",
            "-r",
            "/autoinstrumentation/.",
            "/otel-auto-instrumentation-python",
        ]
    else:
        assert entrypoint and json.loads(entrypoint[-1]) == ["tokentrace"]
    assert not any(keyword == "USER" for keyword, _ in stages["runtime"].instructions)


# ---------------------------------------------------------------- the injection tree


@pytest.fixture(scope="module")
def tree() -> Path:
    tree = injection_tree()
    print(f"\ninjection tree {tree} (cold build took {(tree / 'build_s').read_text().strip()} s)")
    return tree


@pytest.fixture(scope="module")
def engine_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine_environment(tmp_path_factory.mktemp("engine") / "env")


def test_the_tree_has_the_operators_layout_and_nothing_that_shadows(tree: Path) -> None:
    injector = (REPOSITORY / "agent" / "inject" / "sitecustomize.py").read_bytes()
    for folder in (BOOTSTRAP_DIR, OPERATOR_DIR):
        assert [p.name for p in (tree / folder).iterdir()] == ["sitecustomize.py"], folder
        assert (tree / folder / "sitecustomize.py").read_bytes() == injector
    # Outside the package tree there is no package at all: only folders that lead to the two
    # sitecustomize files, no __init__.py on the way (at most namespace portions, which lose
    # to any regular package of the host's).
    outside = [
        p.relative_to(tree)
        for p in tree.rglob("*")
        if p.relative_to(tree).parts[0] not in (PACKAGES_DIR, "build_s", ".ready")
    ]
    assert sorted(map(str, outside)) == sorted(
        [
            BOOTSTRAP_DIR,
            f"{BOOTSTRAP_DIR}/sitecustomize.py",
            "opentelemetry",
            "opentelemetry/instrumentation",
            OPERATOR_DIR,
            f"{OPERATOR_DIR}/sitecustomize.py",
        ]
    )
    packages = tree / PACKAGES_DIR
    for expected in ("tokentrace/agent/bootstrap.py", "wrapt", "opentelemetry/instrumentation"):
        assert (packages / expected).exists(), expected
    assert not (packages / "bin").exists()


def probe(python: Path | str, pythonpath: str | None, *modules: str) -> tuple[dict, str]:
    """Run `python` with only `pythonpath` (None: no PYTHONPATH) set by the injection: the
    files the given modules come from, the agent's registered targets and sys.path's last
    entry; and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("OTEL_")}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [str(python), "-c", _PROBE, *modules],
        env=env,
        capture_output=True,
        text=True,
        timeout=_PROBE_TIMEOUT_S,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("convention", ["operator", "kustomize"])
def test_injected_agent_activates_and_leaves_the_engines_packages_alone(
    tree: Path, engine_python: Path, convention: str
) -> None:
    pythonpath = (
        operator_pythonpath(tree) if convention == "operator" else kustomize_pythonpath(tree)
    )
    plain, _ = probe(engine_python, None, *_HOST_MODULES, *_FILLED_MODULES)
    injected, stderr = probe(engine_python, pythonpath, *_HOST_MODULES, *_FILLED_MODULES)
    assert "tokentrace" not in stderr, stderr
    site_packages = engine_site_packages(engine_python)
    for name in _HOST_MODULES:
        assert plain["files"][name] is not None, name
        assert injected["files"][name] == plain["files"][name], name
        assert Path(injected["files"][name]).is_relative_to(site_packages), name
    packages = tree / PACKAGES_DIR
    for name in _FILLED_MODULES:
        assert plain["files"][name] is None, f"the engine's environment has {name}"
        assert Path(injected["files"][name]).is_relative_to(packages), name
    assert injected["last_path"] == str(packages)
    # Each engine instrumentor waits for its engine's import.
    assert sorted(injected["registered"]) == AUTO_INSTRUMENTED


def test_a_python_without_any_of_the_packages_gets_them_all_from_the_tree(tree: Path) -> None:
    python = images_python()
    injected, stderr = probe(
        python, kustomize_pythonpath(tree), "opentelemetry.trace", "tokentrace.agent.bootstrap"
    )
    assert "tokentrace" not in stderr, stderr
    assert sorted(injected["registered"]) == AUTO_INSTRUMENTED
    for file in injected["files"].values():
        assert Path(file).is_relative_to(tree / PACKAGES_DIR)


def test_an_engine_package_too_old_for_the_agent_leaves_the_engine_untouched(
    tree: Path, engine_python: Path, tmp_path: Path
) -> None:
    """The engine's own (here: a stand-in's) opentelemetry-api is older than tokentrace needs:
    the agent must not run on it; one line says so and the program runs as without tokentrace."""
    old = tmp_path / "old" / "opentelemetry_api-1.20.0.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: opentelemetry-api\nVersion: 1.20.0\n", encoding="utf-8"
    )
    pythonpath = os.pathsep.join([kustomize_pythonpath(tree), str(old.parent)])
    injected, stderr = probe(engine_python, pythonpath, "grpc")
    assert injected["registered"] is None  # the agent was never imported
    lines = stderr.splitlines()
    assert lines == [
        "tokentrace: automatic instrumentation is off: this environment's opentelemetry-api "
        "1.20.0 does not meet tokentrace's requirement opentelemetry-api>=1.40"
    ], stderr


def test_both_folders_on_pythonpath_hand_over_to_the_hosts_sitecustomize_once(
    tree: Path, engine_python: Path, tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins\n"
        "builtins.HOST_SITECUSTOMIZE = getattr(builtins, 'HOST_SITECUSTOMIZE', 0) + 1\n",
        encoding="utf-8",
    )
    pythonpath = os.pathsep.join(
        [kustomize_pythonpath(tree), operator_pythonpath(tree), str(tmp_path)]
    )
    result = subprocess.run(
        [str(engine_python), "-c", "import builtins; print(builtins.HOST_SITECUSTOMIZE)"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=_PROBE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    assert "tokentrace" not in result.stderr, result.stderr


# ---------------------------------------------------------------- the other two images


_IMAGE_COMMANDS = {
    "collector": ("collector", ("tokentrace.collector.service", "tokentrace.collector.api.app")),
    "node-agent": (
        "node-agent",
        ("tokentrace.agent.node.service", "tokentrace.collector.receivers"),
    ),
}
"""Per image: its command, and the modules that command runs on (their imports must resolve)."""


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(_IMAGE_COMMANDS))
def test_the_collector_and_node_agent_installs_run_their_command(
    tmp_path: Path, target: str
) -> None:
    """What the collector and node-agent images hold: a virtual environment with the command
    and what it imports, and no installer."""
    command, modules = _IMAGE_COMMANDS[target]
    prefix = tmp_path / "opt-tokentrace"
    took_s = run_install(target, prefix)
    print(f"\ninstall.sh {target}: {took_s:.1f} s")
    assert not (prefix / "bin" / "pip").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    outputs = []
    for argv in (
        [str(prefix / "bin" / "tokentrace"), command, "--help"],
        [str(prefix / "bin" / "python"), "-c", "; ".join(f"import {m}" for m in modules)],
    ):
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, env=env, cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0].startswith(f"usage: tokentrace {command}")


@pytest.mark.slow
def test_an_install_builds_its_own_c_extensions_never_the_checkouts(tmp_path: Path) -> None:
    """A checkout's compiled extensions (``make install`` builds them in place, for that
    machine's Python) never reach an install: pip compiles them anew for the images' Python
    where a compiler is (the images' build stages install one), else the pure-Python twins run."""
    source = tmp_path / "checkout"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy(REPOSITORY / name, source / name)
    for folder in ("agent", "collector", "processors", "loadgen"):
        shutil.copytree(
            REPOSITORY / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
    for module in ("agent/_wire", "processors/_native"):
        (source / f"{module}{suffix}").write_bytes(b"built for another machine")
    prefix = tmp_path / "opt-tokentrace"
    run_install("node-agent", prefix, source=source)
    installed = [*prefix.rglob(f"_wire{suffix}"), *prefix.rglob(f"_native{suffix}")]
    assert all(path.read_bytes() != b"built for another machine" for path in installed)
    probe = (
        "from tokentrace.agent import span_encoding; from tokentrace.collector.receivers "
        "import wire; from tokentrace.processors import native; "
        "print(span_encoding.BUILT, wire.BUILT, native.BUILT)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TOKENTRACE_PURE_PYTHON")}
    result = subprocess.run(
        [str(prefix / "bin" / "python"), "-c", probe],
        capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    compiler = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
    assert result.stdout.split() == [str(compiler is not None)] * 3
