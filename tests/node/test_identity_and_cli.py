"""Identity (downward API, visible GPUs) and the ``tokentrace node-agent`` command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.node.node_agent_process import start_node_agent
from tests.node.nvml_stand_in import NvmlStandIn, library_env
from tests.node.test_node_agent import _attributes, _request, _span, relayed
from tokentrace.agent import semconv
from tokentrace.agent.config import load_agent_config
from tokentrace.agent.identity import kubernetes_resource, visible_gpu_uuids
from tokentrace.agent.otlp_config import OtlpExporterConfig
from tokentrace.agent.otlp_export import OtlpSender

UUID_A = "GPU-0c0ffee0-0000-0000-0000-00000000000a"
UUID_B = "GPU-0c0ffee0-0000-0000-0000-00000000000b"


class RecordingNvml:
    def __init__(self) -> None:
        self.asked: list[list[int] | None] = []

    def __call__(self, indices: list[int] | None) -> list[str]:
        self.asked.append(indices)
        every = [UUID_A, UUID_B]
        return every if indices is None else [every[i] for i in indices]


@pytest.mark.parametrize(
    ("environ", "expected", "asked"),
    [
        ({"TOKENTRACE_GPU_UUIDS": f"{UUID_B}, {UUID_A}"}, [UUID_B, UUID_A], []),
        ({"TOKENTRACE_GPU_UUIDS": ""}, [], []),
        ({"CUDA_VISIBLE_DEVICES": UUID_A}, [UUID_A], []),
        ({"CUDA_VISIBLE_DEVICES": "1"}, [UUID_B], [[1]]),
        ({"CUDA_VISIBLE_DEVICES": ""}, [], []),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, [], []),
        # Device-plugin containers: UUIDs, or the host's indices of what NVML here sees.
        ({"NVIDIA_VISIBLE_DEVICES": f"{UUID_A},{UUID_B}"}, [UUID_A, UUID_B], []),
        ({"NVIDIA_VISIBLE_DEVICES": "3"}, [UUID_A, UUID_B], [None]),
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, [], []),
        ({}, [UUID_A, UUID_B], [None]),
        ({"CUDA_VISIBLE_DEVICES": "0,GPU-x"}, [], []),
    ],
)
def test_visible_gpu_uuids(
    environ: dict[str, str], expected: list[str], asked: list[list[int] | None]
) -> None:
    nvml = RecordingNvml()
    assert visible_gpu_uuids(environ, nvml_uuids=nvml) == expected
    assert nvml.asked == asked


def test_kubernetes_identity_from_the_downward_api() -> None:
    environ = {"POD_NAME": "vllm-0", "K8S_NAMESPACE_NAME": "llm", "NODE_NAME": "n1"}
    assert kubernetes_resource(environ) == {
        semconv.K8S_POD_NAME: "vllm-0",
        semconv.K8S_NAMESPACE_NAME: "llm",
        semconv.K8S_NODE_NAME: "n1",
    }
    assert kubernetes_resource({}) == {}
    config = load_agent_config(
        {**environ, "CUDA_VISIBLE_DEVICES": UUID_A, "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=x"}
    )
    resource = config.resource()
    assert resource[semconv.K8S_POD_NAME] == "x"  # OTEL_RESOURCE_ATTRIBUTES wins
    assert resource[semconv.K8S_NODE_NAME] == "n1"
    assert resource[semconv.GPU_UUIDS] == (UUID_A,)


@pytest.mark.slow
@pytest.mark.parametrize("with_nvml", [True, False])
def test_the_node_agent_command_relays_with_and_without_nvml(
    with_nvml: bool, nvml_library_dir: Path, tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("LD_LIBRARY_PATH", None)
    if with_nvml:  # the library path the binding loads from
        env["LD_LIBRARY_PATH"] = library_env(nvml_library_dir)["LD_LIBRARY_PATH"]
    process, port, startup = start_node_agent(
        "--upstream",
        upstream.grpc_endpoint,
        "--max-hold",
        "0.2",
        env=env,
        cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        sender = OtlpSender(
            OtlpExporterConfig(endpoint=f"http://127.0.0.1:{port}", protocol="grpc"),
            signal="traces",
        )
        time.sleep(0.5)  # a few samples
        now = time.time_ns()
        uuid = "GPU-00000000-0000-0000-0000-000000000000"  # the stand-in's first GPU
        request = _request(
            [_span(semconv.SPAN_REQUEST, now - 300_000_000, now)],
            resource={semconv.GPU_UUIDS: [uuid], semconv.PROCESS_PID: 1},
        )
        assert sender.submit(request.SerializeToString(), 1)
        assert sender.force_flush(5.0)
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 1)
        sender.shutdown(1.0)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
    output = startup + output
    assert process.returncode == 0, output
    _, span = relayed(upstream)[0]
    attributes = _attributes(span.attributes)
    if with_nvml:
        assert attributes[semconv.GPU_SAMPLES] >= 1
        assert attributes[semconv.GPU_UTILIZATION_MEAN] == pytest.approx(0.5)
    else:
        assert semconv.GPU_SAMPLES not in attributes
        assert "NVML is not available" in output


def test_the_node_agent_command_takes_finished_requests_on_its_local_socket(
    tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    """``--local-socket``: an agent's batch becomes spans upstream; the socket file goes away
    with the process."""
    from tests.agent.test_local_relay import plain_timer
    from tokentrace.agent.local_relay import LocalRelayClient, hello

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("LD_LIBRARY_PATH", None)  # no NVML: relayed as built
    path = tmp_path / "run" / "node.sock"
    process, _, startup = start_node_agent(
        "--upstream", upstream.grpc_endpoint, "--local-socket", str(path), env=env, cwd=tmp_path
    )
    try:
        assert f"LocalSocket {path}" in startup
        client = LocalRelayClient(
            str(path),
            hello_message=hello(
                resource={semconv.SERVICE_NAME: "vllm-test"},
                scope_name="t",
                scope_version="",
                max_token_offsets=8,
            ),
        )
        client.send([plain_timer(1)], [], time.time_ns() - time.monotonic_ns())
        client.close()
        assert upstream.wait_for(lambda: len(relayed(upstream)) >= 1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say where it stopped, and leave nothing running
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"the node agent did not stop within 30 s of SIGTERM:\n{startup}{output}")
    assert process.returncode == 0, startup + output
    names = [span.name for _, span in relayed(upstream)]
    assert semconv.SPAN_REQUEST in names
    assert not path.exists()


def test_bad_configuration_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", "node-agent", "--sample-interval", "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert result.returncode == 2
    assert "configuration error: sample_interval_s: must be > 0" in result.stderr
    assert "Traceback" not in result.stderr


_DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "base" / "node-agent"


def _expand(value: str, environ: dict[str, str]) -> str:
    """``$(NAME)`` replaced as Kubernetes does in env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: environ[m.group(1)], value)


def test_the_shipped_daemonset_runs_a_valid_node_agent(tmp_path: Path) -> None:
    """The manifest's args and environment (downward API, secrets and the token's Secret mount
    filled in as Kubernetes would) make a valid node agent configuration with node identity,
    receivers on the pod IP that require the token, and refused without it."""
    import argparse

    import yaml

    from tokentrace.agent.identity import host_resource
    from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args

    documents = {
        doc["kind"]: doc for doc in yaml.safe_load_all((_DEPLOY / "daemonset.yaml").read_text())
    }
    pod = documents["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    filled = {
        "spec.nodeName": "gpu-node-1",
        "metadata.name": "na-1",
        "metadata.namespace": "tt",
        "status.podIP": "10.1.2.3",
    }
    environ: dict[str, str] = {}
    for variable in container["env"]:
        if "value" in variable:  # Kubernetes expands $(NAME) from earlier variables
            environ[variable["name"]] = _expand(variable["value"], environ)
        elif "fieldRef" in variable["valueFrom"]:
            environ[variable["name"]] = filled[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            environ[variable["name"]] = "secret-token"
    # The node agent's token: a file in the mounted Secret, here under tmp_path.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounted: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        if "secret" not in volumes[mount["name"]]:
            continue  # /tmp, an emptyDir
        secret = volumes[mount["name"]]["secret"]["secretName"]
        directory = tmp_path / secret
        directory.mkdir()
        (directory / "token").write_text("node-agent-token\n")
        mounted[mount["mountPath"].rstrip("/") + "/"] = str(directory) + "/"
    assert list(mounted) == ["/etc/tokentrace/node-agent-token/"]
    args = []
    for arg in container["args"][1:]:
        arg = _expand(arg, environ)  # Kubernetes expands $(NAME) in args too
        for mount_path, local in mounted.items():
            arg = arg.replace(mount_path, local)
        args.append(arg)
    parser = argparse.ArgumentParser()
    command = NodeAgentCommand()
    assert container["args"][0] == command.name
    command.add_arguments(parser)
    config = config_from_args(parser.parse_args(args), environ)
    assert config.grpc_endpoint == "10.1.2.3:4317"
    assert config.http_endpoint == "10.1.2.3:4318"
    assert config.auth_token == "node-agent-token"
    assert not config.allow_unauthenticated
    assert config.exporter.headers == {"authorization": "Bearer secret-token"}
    assert config.exporter.endpoint_for("traces").startswith("http://tokentrace-collector")
    assert config.admin_endpoint == "10.1.2.3:13133"
    assert host_resource(environ)[semconv.K8S_NODE_NAME] == "gpu-node-1"
    # Without its token the same configuration is refused: the pod IP is not loopback.
    without_token = [arg for arg in args if not arg.startswith("--auth-token-file")]
    with pytest.raises(ValueError, match="not a loopback address"):
        config_from_args(parser.parse_args(without_token), environ)
    ports = {p["containerPort"] for p in container["ports"]}
    service_ports = {p["port"] for p in documents["Service"]["spec"]["ports"]}
    # The admin port (probes, Prometheus) is scraped on the pod, not through the Service.
    assert ports == service_ports | {13133}
    assert service_ports == {4317, 4318}
    assert documents["Service"]["spec"]["internalTrafficPolicy"] == "Local"


def test_the_node_agent_kustomization_renders() -> None:
    """``kubectl kustomize`` (or ``kustomize build``) renders the directory offline, with the
    DaemonSet's pod-IP binding and token mount as written."""
    import yaml

    if shutil.which("kustomize"):
        command = ["kustomize", "build", str(_DEPLOY)]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(_DEPLOY)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    rendered = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(rendered.stdout)}
    assert set(documents) == {"DaemonSet", "Service", "ServiceAccount", "NetworkPolicy"}
    pod = documents["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--grpc-endpoint=$(POD_IP):4317" in container["args"]
    assert not any("0.0.0.0" in arg for arg in container["args"])
    assert {
        "name": "node-agent-token",
        "secret": {"secretName": "tokentrace-node-agent-token"},
    } in (pod["volumes"])


def test_gpu_metrics_go_only_to_their_own_endpoint_with_the_exporter_variables() -> None:
    import argparse

    from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args

    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer t",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
    }
    # The collector takes traces only: its endpoint alone does not turn metrics on.
    assert config_from_args(parser.parse_args([]), environ).metrics_exporter is None
    config = config_from_args(
        parser.parse_args(["--metrics-endpoint", "http://metrics:4318/v1/metrics"]), environ
    )
    metrics = config.metrics_exporter
    assert metrics is not None
    assert metrics.endpoint_for("metrics") == "http://metrics:4318/v1/metrics"
    assert metrics.endpoint_for("traces") is None
    assert metrics.protocol == "http/protobuf"
    assert metrics.headers == {"authorization": "Bearer t"}
    assert config.exporter.protocol == "grpc"


def test_gpu_indices_resolve_through_the_real_pynvml_only_where_a_driver_is(
    nvml: NvmlStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokentrace.agent import identity

    control_device = tmp_path / "nvidiactl"
    monkeypatch.setattr(identity, "_NVIDIA_CONTROL_DEVICE", str(control_device))
    # No driver device: NVML is not even initialised.
    assert visible_gpu_uuids({"CUDA_VISIBLE_DEVICES": "1"}) == []
    assert nvml.calls("nvmlInitWithFlags") == 0
    control_device.touch()
    assert visible_gpu_uuids({"CUDA_VISIBLE_DEVICES": "1"}) == [
        "GPU-00000000-0000-0000-0000-000000000001"
    ]
    assert len(visible_gpu_uuids({})) == 2
