"""The three images built for real, without a Docker daemon, and checked as a runtime would run
them: buildah (vfs storage, chroot isolation) on a Debian bookworm base made here with
debootstrap (``deploy/images/build-with-buildah.sh``, the Dockerfile's stages unchanged).

Cold (a machine that never built them) this takes about 3.5 minutes, mostly downloads and vfs
copies; the base image stays in buildah's storage, and images built from the same sources are
not built again (``_source_hash``), so a warm run only checks them."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from tests.deploy.injection import AUTO_INSTRUMENTED

pytestmark = pytest.mark.slow

_ROOT: Final = Path(__file__).resolve().parents[2]
_BUILD_SCRIPT: Final = _ROOT / "deploy" / "images" / "build-with-buildah.sh"
_IMAGES: Final = {
    target: f"ghcr.io/tokentrace/tokentrace-{target}:0.1.0"
    for target in ("collector", "node-agent", "autoinstrumentation")
}
_BUILDAH: Final = ("buildah", "--storage-driver", "vfs")
_SOURCES: Final = ("agent", "collector", "processors", "loadgen", "deploy/images")
_SOURCE_FILES: Final = ("pyproject.toml", "README.md", "constraints.txt")
_CACHE: Final = Path.home() / ".cache" / "tokentrace" / "images"
_BUILD_TIMEOUT_S: Final = 1200
_USER: Final = "10001:10001"


def _source_hash() -> str:
    """What the images are built from: the Dockerfile's COPY sources and the build script."""
    digest = hashlib.sha256()
    paths = [_ROOT / name for name in _SOURCE_FILES]
    for folder in _SOURCES:
        paths += sorted(p for p in (_ROOT / folder).rglob("*") if p.is_file())
    for path in paths:
        if "__pycache__" in path.parts or path.suffix == ".so":  # an install builds its own
            continue
        digest.update(str(path.relative_to(_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _buildah(
    *args: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_BUILDAH, *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def _image_id(reference: str) -> str | None:
    found = _buildah(
        "inspect", "--type", "image", "--format", "{{.FromImageID}}", reference, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else None


def _images_present() -> bool:
    return all(_image_id(image) is not None for image in _IMAGES.values())


@pytest.fixture(scope="module")
def images() -> dict[str, dict[str, Any]]:
    """Each image's OCI configuration, once they are built from the current sources."""
    if os.geteuid() != 0:
        pytest.skip("buildah's chroot isolation with vfs storage needs root")
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.fail(
                f"{tool} is missing: `make test` installs it (tests/deploy/install_debian_tools.sh)"
            )
    _CACHE.mkdir(parents=True, exist_ok=True)
    marker = _CACHE / f"built-{_source_hash()}"
    if not (marker.exists() and _images_present()):
        environment = dict(os.environ)
        # Where outgoing TLS is re-signed by a local CA (this project's machines), pip inside
        # the build steps must trust it too: the script mounts the bundle named here.
        bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
        if bundle and Path(bundle).is_file():
            environment["PIP_CA_BUNDLE"] = bundle
        replaced = {image: _image_id(image) for image in _IMAGES.values()}
        for image in _IMAGES.values():  # a killed run's containers would keep its images
            leftovers = _buildah("containers", "--quiet", "--filter", f"ancestor={image}")
            for container in leftovers.stdout.split():
                _buildah("rm", container, check=False)
        built = subprocess.run(
            ["sh", str(_BUILD_SCRIPT), str(_CACHE / "work")],
            cwd=_ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        # A rebuild removes the images it replaced (vfs storage keeps a full copy of each).
        for image, previous in replaced.items():
            if previous is not None and previous != _image_id(image):
                assert _image_id(previous) is None, f"{image}: {previous} was left behind"
        for stale in _CACHE.glob("built-*"):
            stale.unlink()
        marker.touch()
    configs = {}
    for target, image in _IMAGES.items():
        inspected = json.loads(_buildah("inspect", "--type", "image", image).stdout)
        configs[target] = inspected["OCIv1"]["config"]
    return configs


class Container:
    def __init__(self, image: str) -> None:
        self.id = _buildah("from", "--pull-never", image).stdout.strip()

    def run(
        self, *command: str, env: Sequence[str] = (), user: str = _USER
    ) -> subprocess.CompletedProcess[str]:
        options = ["--isolation", "chroot", "--user", user]
        for variable in env:
            options += ["--env", variable]
        return _buildah("run", *options, self.id, "--", *command, check=False, timeout=120)

    def remove(self) -> None:
        _buildah("rm", self.id, check=False)


@pytest.fixture(scope="module")
def containers(images: dict[str, dict[str, Any]]) -> Iterator[dict[str, Container]]:
    """One working container per image for the module (with vfs, each costs a full copy)."""
    made: dict[str, Container] = {}
    try:
        for target, image in _IMAGES.items():
            made[target] = Container(image)
        yield made
    finally:
        for container in made.values():
            container.remove()


@pytest.mark.parametrize("target", list(_IMAGES))
def test_every_image_runs_as_the_numeric_non_root_user(
    target: str, images: dict[str, dict[str, Any]]
) -> None:
    config = images[target]
    assert config["User"] == _USER
    if target == "autoinstrumentation":
        assert config.get("Cmd") == [
            "cp",
            "-r",
            "/autoinstrumentation/.",
            "/otel-auto-instrumentation-python",
        ]
    else:
        assert config["Entrypoint"] == ["tokentrace"]
        assert config["Cmd"] == [target]


_NO_BUILD_TOOLS: Final = (
    "for tool in gcc cc make pip pip3; do command -v $tool && exit 1; done; "
    "python3 -m pip --version && exit 1; exit 0"
)


@pytest.mark.parametrize(
    ("target", "command", "expected"),
    [
        ("collector", ("tokentrace", "collector", "--help"), "--config"),
        ("collector", ("tokentrace", "collector", "--check-config"), "OTLP/gRPC receiver on"),
        ("node-agent", ("tokentrace", "node-agent", "--help"), "--admin-endpoint"),
    ],
)
def test_the_collector_and_node_agent_images_run_their_command(
    containers: dict[str, Container], target: str, command: tuple[str, ...], expected: str
) -> None:
    container = containers[target]
    ran = container.run(*command)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert expected in ran.stdout + ran.stderr
    no_tools = container.run("sh", "-c", _NO_BUILD_TOOLS)
    assert no_tools.returncode == 0, f"a build tool in the final image: {no_tools.stdout}"
    writable = container.run("sh", "-c", "touch /var/lib/tokentrace/probe && touch /tmp/probe")
    assert writable.returncode == 0, writable.stderr


def test_the_images_run_the_c_extensions_their_build_stage_compiled(
    containers: dict[str, Container],
) -> None:
    # The build stages have a compiler (the final stages none: the test above); the collector's
    # per-trace work and the agent's span encoding then run in C.
    probe = "from tokentrace.agent import span_encoding; from tokentrace.processors import native"
    show = "; print(span_encoding.BUILT, native.BUILT)"
    receiver = "; from tokentrace.collector.receivers import wire; print(wire.BUILT)"
    collector = containers["collector"].run(
        "/opt/tokentrace/bin/python", "-c", probe + show + receiver
    )
    assert collector.stdout.split() == ["True", "True", "True"], collector.stderr[-2000:]
    tree = "import sys; sys.path.append('/autoinstrumentation/tokentrace-packages'); "
    agent = containers["autoinstrumentation"].run("python3", "-c", tree + probe + show)
    assert agent.stdout.split() == ["True", "True"], agent.stderr[-2000:]


def test_the_injection_image_holds_the_operator_layout_and_activates_the_agent(
    containers: dict[str, Container],
) -> None:
    container = containers["autoinstrumentation"]
    layout = container.run(
        "sh",
        "-c",
        "test -f /autoinstrumentation/bootstrap/sitecustomize.py && "
        "test -f /autoinstrumentation/opentelemetry/instrumentation/auto_instrumentation/"
        "sitecustomize.py && test -d /autoinstrumentation/tokentrace-packages/tokentrace && "
        "! test -e /autoinstrumentation/opentelemetry/__init__.py",
    )
    assert layout.returncode == 0, layout.stderr
    # The OpenTelemetry Operator's PYTHONPATH, on the image's own Python (no engine here: the
    # tree fills in everything).
    operator_path = ":".join(
        (
            "/autoinstrumentation/opentelemetry/instrumentation/auto_instrumentation",
            "/autoinstrumentation",
        )
    )
    activated = container.run(
        "python3",
        "-c",
        "from tokentrace.agent import bootstrap; print(bootstrap.registered)",
        env=[f"PYTHONPATH={operator_path}"],
    )
    assert activated.returncode == 0, activated.stderr
    assert sorted(ast.literal_eval(activated.stdout.strip())) == AUTO_INSTRUMENTED
