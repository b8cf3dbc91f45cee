"""The Kubernetes manifests under ``deploy/``: every overlay renders, every object is valid against
the Kubernetes schema, and every workload carries the security settings docs/deploy.md promises.

The manifests are rendered exactly as a user would (``kubectl kustomize``, which embeds kustomize;
``kustomize build`` where only that is installed), once per directory, and every check reads the
rendered objects, so an overlay's patch that undoes a base setting fails here. The schema check
is ``kubernetes-validate`` in strict mode (unknown fields are errors, which catches misspelt keys
that the API server would drop silently) against one Kubernetes version, ``_KUBERNETES_VERSION``.
Objects of custom resources (the OpenTelemetry Operator's ``Instrumentation``) have no schema
there; their shape is checked by hand.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

_REPO: Final = Path(__file__).resolve().parents[2]
_DEPLOY: Final = _REPO / "deploy"
_OVERLAYS: Final = (
    "single-node",
    "gpu",
    "otelcol-loadbalancing",
    "replicas-postgresql",
    "node-socket",
)
_EXAMPLES: Final = ("examples/inference",)
_RENDERED: Final = tuple(f"overlays/{name}" for name in _OVERLAYS) + _EXAMPLES
_KUBERNETES_VERSION: Final = "1.30.0"
"""The schema version every object is validated against: the oldest Kubernetes the manifests
support (internalTrafficPolicy, the StatefulSet's PVC retention policy and RuntimeDefault seccomp
all exist there) and the oldest kubernetes-validate release the dev extra allows ships it."""

_WORKLOAD_KINDS: Final = frozenset({"Deployment", "DaemonSet", "StatefulSet", "Job"})
_TALKS_TO_KUBERNETES_API: Final = frozenset[str]()
"""Workloads (``kind/name``) whose pods call the Kubernetes API and so keep a token: none."""
_INJECTION_IMAGE: Final = "ghcr.io/tokentrace/tokentrace-autoinstrumentation:0.1.0"
_INJECTION_MOUNT: Final = "/otel-auto-instrumentation-python"
_NODE_AGENT_OTLP: Final = "http://tokentrace-node-agent.tokentrace.svc"
_VARIABLE_REFERENCE: Final = re.compile(r"\$\((\w+)\)")
_CONFIG_VARIABLE: Final = re.compile(r"\$\{env:(\w+)\}")
_BASE_COLLECTOR_CONFIG: Final = _DEPLOY / "base" / "collector" / "collector.yaml"
_POSTGRESQL_SECRET: Final = "tokentrace-postgresql"
_POSTGRESQL_URL: Final = "postgresql://tokentrace@postgres.example.internal:5432/tokentrace"
"""What the test puts in the Secret's ``url`` key, as a user would (no password in it)."""


def _kustomize_command() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("neither kubectl nor kustomize is installed: the manifests cannot be rendered")


@functools.cache
def _render_cached(directory: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [*_kustomize_command(), str(_DEPLOY / directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kustomize cannot render deploy/{directory}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _render(directory: str) -> list[dict[str, Any]]:
    """The objects of one rendered directory (a deep copy: tests may change theirs)."""
    return copy.deepcopy(list(_render_cached(directory)))


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] in _WORKLOAD_KINDS]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    """A workload's pod template (every workload kind keeps it at spec.template)."""
    template: dict[str, Any] = workload["spec"]["template"]
    return template


def _containers(pod_spec: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every container of a pod, with whether it is an init container."""
    for container in pod_spec.get("initContainers", []):
        yield container, True
    for container in pod_spec["containers"]:
        yield container, False


def _config_map_file(objects: list[dict[str, Any]], prefix: str, key: str) -> dict[str, Any]:
    """A file of a generated ConfigMap (its name carries a content hash after ``prefix``)."""
    (config_map,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(prefix)
    ]
    loaded: dict[str, Any] = yaml.safe_load(config_map["data"][key])
    return loaded


def test_every_overlay_directory_is_tested() -> None:
    on_disk = sorted(p.name for p in (_DEPLOY / "overlays").iterdir() if p.is_dir())
    assert on_disk == sorted(_OVERLAYS)


@pytest.mark.parametrize("directory", _RENDERED)
def test_every_object_is_valid_for_kubernetes(directory: str) -> None:
    import kubernetes_validate

    objects = _render(directory)
    assert _workloads(objects), directory
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, _KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"deploy/{directory}: {_name(obj)}: {error.message} at {error.path}")


def test_the_validator_catches_a_misspelt_field() -> None:
    """Strict mode is what makes the check worth having: a typo the API server would drop."""
    import kubernetes_validate

    (daemonset,) = [o for o in _render("overlays/gpu") if o["kind"] == "DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["securityContxt"] = container.pop("securityContext")
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContxt"):
        kubernetes_validate.validate(daemonset, _KUBERNETES_VERSION, strict=True)


def _security_problems(workload: dict[str, Any]) -> list[str]:
    """What is missing from one workload's pods and containers (empty: nothing)."""
    problems: list[str] = []
    pod_spec = _pod(workload)["spec"]
    pod_security = pod_spec.get("securityContext", {})
    if _name(workload) not in _TALKS_TO_KUBERNETES_API and (
        pod_spec.get("automountServiceAccountToken") is not False
    ):
        problems.append("pod: automountServiceAccountToken must be false")
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            problems.append(f"pod: {flag}")
    for container, is_init in _containers(pod_spec):
        where = f"container {container['name']}"
        # The container's settings override the pod's: what counts is the effective value.
        security = {**pod_security, **container.get("securityContext", {})}
        if security.get("runAsNonRoot") is not True:
            problems.append(f"{where}: runAsNonRoot")
        if not isinstance(security.get("runAsUser"), int) or security["runAsUser"] == 0:
            problems.append(f"{where}: numeric non-root runAsUser")
        if security.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem")
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation false")
        if security.get("privileged"):
            problems.append(f"{where}: privileged")
        capabilities = security.get("capabilities", {})
        if capabilities.get("drop") != ["ALL"] or capabilities.get("add"):
            problems.append(f"{where}: capabilities drop [ALL], add none")
        if security.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: seccompProfile RuntimeDefault")
        resources = container.get("resources", {})
        for bound in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resources.get(bound, {}))
            if missing:
                problems.append(f"{where}: resources.{bound} {sorted(missing)}")
        if not is_init:
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in container:
                    problems.append(f"{where}: {probe}")
        image: str = container["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        if "@sha256:" not in image and tag in ("", "latest"):
            problems.append(f"{where}: image {image} is not pinned")
    return problems


_ROOT_INIT_CONTAINERS: Final = {
    ("overlays/node-socket", "DaemonSet/tokentrace-node-agent"): "node-socket-directory",
}
"""The one init container that runs as root: it hands the node agent's hostPath socket directory
(the kubelet creates it owned by root) to the node agent's user, with CAP_CHOWN and nothing else
(deploy/components/node-socket)."""


@pytest.mark.parametrize("directory", _RENDERED)
def test_every_workload_is_locked_down(directory: str) -> None:
    for workload in _workloads(_render(directory)):
        exempt = _ROOT_INIT_CONTAINERS.get((directory, _name(workload)))
        if exempt is not None:
            pod_spec = _pod(workload)["spec"]
            (container,) = [c for c in pod_spec["initContainers"] if c["name"] == exempt]
            pod_spec["initContainers"].remove(container)
            security = {**pod_spec["securityContext"], **container["securityContext"]}
            assert security["runAsUser"] == 0
            assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["seccompProfile"] == {"type": "RuntimeDefault"}
            assert container["command"][:2] == ["python", "-c"]
        assert _security_problems(workload) == [], f"deploy/{directory}: {_name(workload)}"


def test_the_security_check_sees_a_setting_taken_away() -> None:
    (collector,) = [o for o in _render("overlays/single-node") if o["kind"] == "StatefulSet"]
    assert _security_problems(collector) == []
    pod_spec = collector["spec"]["template"]["spec"]
    del pod_spec["securityContext"]["seccompProfile"]
    pod_spec["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_ADMIN"]}
    del pod_spec["containers"][0]["readinessProbe"]
    pod_spec["automountServiceAccountToken"] = True
    pod_spec["containers"][0]["image"] = "ghcr.io/tokentrace/tokentrace-collector"
    problems = "\n".join(_security_problems(collector))
    for expected in (
        "seccompProfile",
        "capabilities",
        "readinessProbe",
        "automountServiceAccountToken",
        "not pinned",
    ):
        assert expected in problems


@pytest.mark.parametrize("directory", _RENDERED)
def test_service_accounts_carry_no_token(directory: str) -> None:
    for account in (o for o in _render(directory) if o["kind"] == "ServiceAccount"):
        assert account.get("automountServiceAccountToken") is False, _name(account)


@pytest.mark.parametrize("directory", _RENDERED)
def test_variables_are_defined_before_kubernetes_expands_them(directory: str) -> None:
    """``$(NAME)`` in an env value expands only from variables listed before it (else it stays
    literal, e.g. a header ``Bearer $(TOKEN)``); in args, from any of the container's variables.
    A strategic merge patch may reorder a list, so this reads the rendered objects."""
    for workload in _workloads(_render(directory)):
        for container, _ in _containers(_pod(workload)["spec"]):
            defined: list[str] = []
            for variable in container.get("env", []):
                for name in _VARIABLE_REFERENCE.findall(variable.get("value", "")):
                    assert name in defined, f"{_name(workload)} {variable['name']}: $({name})"
                defined.append(variable["name"])
            for arg in [*container.get("command", []), *container.get("args", [])]:
                for name in _VARIABLE_REFERENCE.findall(arg):
                    assert name in defined, f"{_name(workload)} {container['name']}: {arg}"


def _namespaced(objects: list[dict[str, Any]], kind: str, namespace: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and o["metadata"].get("namespace") == namespace]


def _namespaced_all(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"].get("namespace") == namespace]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions are not used here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("directory", [f"overlays/{name}" for name in _OVERLAYS])
def test_each_namespace_denies_by_default_and_allows_only_named_peers(directory: str) -> None:
    objects = _render(directory)
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert namespaces == ["tokentrace"]
    for namespace in namespaces:
        policies = _namespaced(objects, "NetworkPolicy", namespace)
        default_deny = [
            p
            for p in policies
            if p["spec"]["podSelector"] == {}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
        ]
        assert default_deny, f"{namespace}: no default-deny NetworkPolicy"
        for policy in policies:
            # An allow rule names its peers and ports: a rule without them allows everything.
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from") and rule.get("ports"), _name(policy)
            for rule in policy["spec"].get("egress", []):
                assert rule.get("to") and rule.get("ports"), _name(policy)
        for workload in _workloads(_namespaced_all(objects, namespace)):
            labels = _pod(workload)["metadata"]["labels"]
            selecting = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
            assert any(p["spec"].get("ingress") for p in selecting), _name(workload)
            assert any(p["spec"].get("egress") for p in selecting), _name(workload)


def _allowed_ingress_ports(policies: list[dict[str, Any]], labels: dict[str, str]) -> set[int]:
    return {
        port["port"]
        for policy in policies
        if _selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("ingress", [])
        for port in rule["ports"]
    }


@pytest.mark.parametrize("directory", [f"overlays/{name}" for name in _OVERLAYS])
def test_services_reach_their_pods_through_the_network_policies(directory: str) -> None:
    """Every Service selects a workload, names a port its pods declare, and is let through; none
    is exposed outside the cluster."""
    objects = _render(directory)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for service in (o for o in objects if o["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", _name(service)
        assert not service["spec"].get("externalIPs"), _name(service)
        pods = [
            _pod(w)
            for w in _workloads(objects)
            if _selects({"matchLabels": service["spec"]["selector"]}, _pod(w)["metadata"]["labels"])
        ]
        assert pods, f"{_name(service)} selects no pod"
        for pod in pods:
            declared = {
                port["name"]: port["containerPort"]
                for container in pod["spec"]["containers"]
                for port in container.get("ports", [])
            }
            allowed = _allowed_ingress_ports(policies, pod["metadata"]["labels"])
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in declared, f"{_name(service)}: {port}"
                assert declared[port["targetPort"]] in allowed, f"{_name(service)}: {port}"


def test_no_manifest_binds_every_address_without_saying_why() -> None:
    """A line of deploy/ that names 0.0.0.0 or [::] carries a comment (on it or just above)."""
    for path in sorted(_DEPLOY.rglob("*.yaml")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if "0.0.0.0" in line or "[::]" in line:
                commented = "#" in line or (
                    number > 0 and lines[number - 1].lstrip().startswith("#")
                )
                assert commented, f"{path.relative_to(_REPO)}:{number + 1}: {line.strip()}"


@pytest.mark.parametrize("directory", [f"overlays/{name}" for name in _OVERLAYS])
def test_every_listener_is_on_the_pod_ip(directory: str) -> None:
    objects = _render(directory)
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    (node_agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    endpoints = [a for a in node_agent["args"] if a.startswith("--") and "-endpoint=" in a]
    assert {e.split("=", 1)[0] for e in endpoints} == {
        "--grpc-endpoint",
        "--http-endpoint",
        "--admin-endpoint",
    }
    assert all(e.split("=", 1)[1].startswith("$(POD_IP):") for e in endpoints), endpoints
    config = _config_map_file(objects, "tokentrace-collector-config", "collector.yaml")
    listeners = [p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()]
    listeners += [e["endpoint"] for e in config["extensions"].values()]
    assert len(listeners) == 4
    assert all(e.startswith("${env:POD_IP}:") for e in listeners), listeners


def _collector_environment(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The collector container's variables, with made-up values where Kubernetes fills them in."""
    (statefulset,) = [o for o in objects if o["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    filled = {"status.podIP": "10.1.2.3"}
    environ: dict[str, str] = {}
    for variable in container["env"]:
        source = variable.get("valueFrom", {})
        if "fieldRef" in source:
            environ[variable["name"]] = filled.get(source["fieldRef"]["fieldPath"], "x")
        elif "secretKeyRef" in source:
            environ[variable["name"]] = _secret_value(source["secretKeyRef"])
        else:
            environ[variable["name"]] = variable["value"]
    assert container["args"] == ["collector", "--config", "/etc/tokentrace/collector.yaml"]
    return environ


def _secret_value(reference: dict[str, str]) -> str:
    """What a user would put in the key of a Secret: the PostgreSQL URL, else a token."""
    if reference == {"name": _POSTGRESQL_SECRET, "key": "url"}:
        return _POSTGRESQL_URL
    return f"{reference['key']}-of-{reference['name']}"


def _check_config(config: dict[str, Any], environ: dict[str, str], tmp_path: Path) -> str:
    """``tokentrace collector --check-config`` on a configuration; its error output ('' if OK)."""
    path = tmp_path / "collector.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    command = ["collector", "--config", str(path), "--check-config"]
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **environ},
        cwd=tmp_path,
        check=False,
    )
    if result.returncode == 0:
        return ""
    assert "Traceback" not in result.stderr
    return result.stderr.strip()


@pytest.mark.parametrize("overlay", _OVERLAYS)
def test_the_collector_configuration_in_the_config_map_is_valid(
    overlay: str, tmp_path: Path
) -> None:
    """The ConfigMap's collector.yaml passes ``tokentrace collector --check-config`` with the
    environment the StatefulSet gives it, and uses no variable the StatefulSet does not set."""
    objects = _render(f"overlays/{overlay}")
    config = _config_map_file(objects, "tokentrace-collector-config", "collector.yaml")
    environ = _collector_environment(objects)
    referenced = set(_CONFIG_VARIABLE.findall(yaml.safe_dump(config)))
    assert referenced <= set(environ), referenced - set(environ)
    assert _check_config(config, environ, tmp_path) == ""
    # The probes and the scrape annotations need the admin extension on port 13133.
    assert "admin" in config["service"]["extensions"]
    assert config["extensions"]["admin"]["endpoint"].endswith(":13133")


_EXPECTED_UPSTREAM: Final = {
    "single-node": "http://tokentrace-collector.tokentrace.svc:4317",
    "gpu": "http://tokentrace-collector.tokentrace.svc:4317",
    "otelcol-loadbalancing": "http://tokentrace-otelcol.tokentrace.svc:4317",
    # Routed by trace ID over the headless Service; this endpoint until its first answer.
    "replicas-postgresql": "http://tokentrace-collector.tokentrace.svc:4317",
    "node-socket": "http://tokentrace-collector.tokentrace.svc:4317",
}
_EXPECTED_ROUTE_DNS: Final = {
    "single-node": None,
    "gpu": None,
    "otelcol-loadbalancing": None,  # the OpenTelemetry Collector routes
    "replicas-postgresql": "dns:///tokentrace-collector-headless.tokentrace.svc:4317",
    "node-socket": None,
}
_NODE_SOCKET: Final = "/var/run/tokentrace/node.sock"
"""Where deploy/components/node-socket puts the node agent's local socket."""


@pytest.mark.parametrize("overlay", _OVERLAYS)
def test_the_node_agent_of_every_overlay_is_a_valid_node_agent(
    overlay: str, tmp_path: Path
) -> None:
    """The rendered DaemonSet's args and environment, filled in as Kubernetes would (pod IP,
    Secrets, the token's mount), make a valid node agent configuration: receivers and admin port
    on the pod IP, the token required, the collector's token upstream, to the overlay's upstream
    (routed by trace ID over the overlay's DNS name, if any)."""
    import argparse

    from tokentrace.agent.node.routing import address_endpoint, parse_dns_target
    from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args

    (daemonset,) = [o for o in _render(f"overlays/{overlay}") if o["kind"] == "DaemonSet"]
    pod_spec = daemonset["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    environ: dict[str, str] = {}
    for variable in container["env"]:
        source = variable.get("valueFrom", {})
        if "fieldRef" in source:
            environ[variable["name"]] = {"status.podIP": "10.1.2.3"}.get(
                source["fieldRef"]["fieldPath"], "x"
            )
        elif "secretKeyRef" in source:
            environ[variable["name"]] = "collector-token"
        else:
            environ[variable["name"]] = _VARIABLE_REFERENCE.sub(
                lambda m: environ[m.group(1)], variable["value"]
            )
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    mounts = {
        m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
        for m in container["volumeMounts"]
        if "secret" in volumes[m["name"]]
    }
    args = []
    for arg in container["args"][1:]:
        arg = _VARIABLE_REFERENCE.sub(lambda m: environ[m.group(1)], arg)
        for mount_path, secret in mounts.items():
            if mount_path in arg:
                (tmp_path / secret).mkdir(exist_ok=True)
                (tmp_path / secret / "token").write_text("node-agent-token\n", encoding="utf-8")
                arg = arg.replace(mount_path, str(tmp_path / secret))
        args.append(arg)
    command = NodeAgentCommand()
    assert container["args"][0] == command.name
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    config = config_from_args(parser.parse_args(args), environ)
    assert config.grpc_endpoint == "10.1.2.3:4317"
    assert config.http_endpoint == "10.1.2.3:4318"
    assert config.admin_endpoint == "10.1.2.3:13133"
    assert config.auth_token == "node-agent-token"
    assert not config.allow_unauthenticated
    assert config.exporter.headers == {"authorization": "Bearer collector-token"}
    assert config.exporter.endpoint_for("traces") == _EXPECTED_UPSTREAM[overlay]
    assert config.upstream_dns == _EXPECTED_ROUTE_DNS[overlay]
    assert config.upstream_endpoints == ()
    if overlay == "node-socket":  # in the hostPath directory the inference pods mount
        assert config.local_socket == _NODE_SOCKET
        (directory,) = [m for m in container["volumeMounts"] if m["name"] == "node-socket"]
        assert directory["mountPath"] == str(Path(_NODE_SOCKET).parent)
        assert volumes["node-socket"]["hostPath"]["path"] == directory["mountPath"]
    else:
        assert config.local_socket is None
    if config.upstream_dns is not None:
        # Each resolved replica is sent to in the upstream's scheme: plaintext, like deploy/'s
        # receivers.
        _, port = parse_dns_target(config.upstream_dns)
        assert address_endpoint(config.exporter, "10.1.2.4", port) == f"http://10.1.2.4:{port}"


_COLLECTOR_CONFIG_CHANGES: Final[dict[str, tuple[str, ...]]] = {
    "single-node": (),
    "gpu": (),
    "otelcol-loadbalancing": (),
    # Its own copy of collector.yaml (kustomize cannot patch inside a generated file): the
    # store's location (its retention stays the base's) and the spool.
    "replicas-postgresql": ("exporters.store.path", "service.durability"),
    "node-socket": (),
}
"""The keys of base/collector/collector.yaml that each overlay's ConfigMap changes (dotted
paths): every other key stays the base's, so a change to the base reaches every overlay or fails
here."""


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted path of ``config``; None where a part is missing."""
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _without(config: dict[str, Any], dotted_paths: tuple[str, ...]) -> dict[str, Any]:
    trimmed = copy.deepcopy(config)
    for dotted in dotted_paths:
        *parents, key = dotted.split(".")
        parent = _lookup(trimmed, ".".join(parents)) if parents else trimmed
        if isinstance(parent, dict):
            parent.pop(key, None)
    return trimmed


@pytest.mark.parametrize("overlay", _OVERLAYS)
def test_every_overlay_runs_the_base_collector_configuration_but_what_it_changes(
    overlay: str,
) -> None:
    base = yaml.safe_load(_BASE_COLLECTOR_CONFIG.read_text(encoding="utf-8"))
    config = _config_map_file(
        _render(f"overlays/{overlay}"), "tokentrace-collector-config", "collector.yaml"
    )
    changes = _COLLECTOR_CONFIG_CHANGES[overlay]
    assert _without(config, changes) == _without(base, changes)
    # Each listed key does differ: a stale entry would hide a copy that fell back to the base.
    for dotted in changes:
        assert _lookup(config, dotted) != _lookup(base, dotted), dotted


def test_the_configuration_comparison_sees_a_change_next_to_a_changed_key() -> None:
    base = {"exporters": {"store": {"path": "a.db", "retention": "3d"}}, "service": {}}
    copied = {"exporters": {"store": {"path": "postgresql://h/db", "retention": "4d"}}}
    copied["service"] = {"durability": {"directory": "/spool"}}
    changes = ("exporters.store.path", "service.durability")
    assert _without(copied, changes) != _without(base, changes)
    copied["exporters"]["store"]["retention"] = "3d"
    assert _without(copied, changes) == _without(base, changes)


_BASE_SECRETS: Final = frozenset(
    {"tokentrace-receiver-token", "tokentrace-node-agent-token", "tokentrace-ui-token"}
)
_EXPECTED_SECRETS: Final = {
    "single-node": _BASE_SECRETS,
    "gpu": _BASE_SECRETS,
    "otelcol-loadbalancing": _BASE_SECRETS,
    "replicas-postgresql": _BASE_SECRETS | {_POSTGRESQL_SECRET},
    "node-socket": _BASE_SECRETS,
}


def _guide_secret_keys(guide: str, secret: str) -> set[str]:
    """The keys the deploy guide's ``kubectl create secret generic SECRET`` commands give it
    (``--from-literal=KEY=...`` / ``--from-file=KEY=...``, over continued lines)."""
    keys: set[str] = set()
    for match in re.finditer(rf"create secret generic {re.escape(secret)}(?![\w-])", guide):
        command = guide[match.end() :]
        ends = re.search(r"(?<!\\)\n", command)  # the first line not continued by a backslash
        command = command[: ends.start() if ends else len(command)]
        keys |= set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", command))
    return keys


@pytest.mark.parametrize("overlay", _OVERLAYS)
def test_every_secret_referenced_is_made_in_the_deploy_guide(overlay: str) -> None:
    guide = (_REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    objects = _render(f"overlays/{overlay}")
    referenced: dict[str, set[str]] = {}
    for workload in _workloads(objects):
        pod_spec = _pod(workload)["spec"]
        for volume in pod_spec.get("volumes", []):
            if "secret" in volume:
                referenced.setdefault(volume["secret"]["secretName"], set())
        for container, _ in _containers(pod_spec):
            for variable in container.get("env", []):
                reference = variable.get("valueFrom", {}).get("secretKeyRef")
                if reference is not None:
                    referenced.setdefault(reference["name"], set()).add(reference["key"])
    assert set(referenced) == _EXPECTED_SECRETS[overlay]
    for secret, keys in referenced.items():
        assert f"create secret generic {secret}" in guide, secret
        assert keys <= _guide_secret_keys(guide, secret), secret


def test_the_guide_secret_keys_are_those_of_the_one_command() -> None:
    guide = (
        "kubectl create secret generic a \\\n    --from-literal=url='x' \\\n"
        "    --from-file=password=./pw\n--from-literal=later=1\n"
        "kubectl create secret generic a-b --from-literal=token=t\n"
    )
    assert _guide_secret_keys(guide, "a") == {"url", "password"}
    assert _guide_secret_keys(guide, "a-b") == {"token"}


def test_the_gpu_overlay_reads_every_gpu_without_taking_one() -> None:
    objects = _render("overlays/gpu")
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    pod_spec = daemonset["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert pod_spec["runtimeClassName"] == "nvidia"
    assert pod_spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert not any("nvidia.com/gpu" in bound for bound in container["resources"].values())
    # The other overlays run the node agent on every node, without the NVIDIA runtime.
    (plain,) = [o for o in _render("overlays/single-node") if o["kind"] == "DaemonSet"]
    assert "runtimeClassName" not in plain["spec"]["template"]["spec"]


def test_the_load_balancer_routes_whole_traces_to_the_collector_replicas() -> None:
    objects = _render("overlays/otelcol-loadbalancing")
    config = _config_map_file(objects, "tokentrace-otelcol-config", "otelcol.yaml")
    exporter = config["exporters"]["loadbalancing"]
    assert exporter["routing_key"] == "traceID"
    resolver = exporter["resolver"]["dns"]
    headless = _one(objects, "Service", "tokentrace-collector-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert resolver["hostname"].startswith("tokentrace-collector-headless.tokentrace.svc")
    assert resolver["port"] in {p["port"] for p in headless["spec"]["ports"]}
    statefulset = _one(objects, "StatefulSet", "tokentrace-collector")
    assert statefulset["spec"]["serviceName"] == "tokentrace-collector-headless"
    assert statefulset["spec"]["replicas"] > 1
    # The collector's token is checked on the way in and sent on the way out.
    receiver = config["receivers"]["otlp"]["protocols"]["grpc"]
    assert receiver["auth"]["authenticator"] == "bearertokenauth"
    assert receiver["endpoint"].startswith("${env:POD_IP}:")
    headers = exporter["protocol"]["otlp"]["headers"]
    assert headers["authorization"] == "Bearer ${env:TOKENTRACE_RECEIVER_TOKEN}"
    deployment = _one(objects, "Deployment", "tokentrace-otelcol")
    (otelcol,) = deployment["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"otel/opentelemetry-collector-contrib:\d+\.\d+\.\d+", otelcol["image"])
    assert {v["name"] for v in otelcol["env"]} >= set(_CONFIG_VARIABLE.findall(str(config)))
    # The node agents send to it, and may reach only it.
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    env = {
        v["name"]: v.get("value")
        for v in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://tokentrace-otelcol.tokentrace.svc:4317"
    upstream = _one(objects, "NetworkPolicy", "tokentrace-node-agent-upstream")
    peers = [peer for rule in upstream["spec"]["egress"] for peer in rule["to"]]
    assert peers == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tokentrace-otelcol"}}}
    ]
    collector_in = _one(objects, "NetworkPolicy", "tokentrace-collector-otlp")
    peers = [peer for rule in collector_in["spec"]["ingress"] for peer in rule["from"]]
    assert peers == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tokentrace-otelcol"}}}
    ]


def _egress_ports(
    policies: list[dict[str, Any]], labels: dict[str, str], peer_labels: dict[str, str]
) -> set[int]:
    """The ports pods with ``labels`` may reach on pods with ``peer_labels`` (same namespace)."""
    return {
        port["port"]
        for policy in policies
        if _selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("egress", [])
        if any(
            set(peer) == {"podSelector"} and _selects(peer["podSelector"], peer_labels)
            for peer in rule["to"]
        )
        for port in rule["ports"]
    }


def test_the_postgresql_replicas_share_one_store_with_a_spool_each(tmp_path: Path) -> None:
    from tokentrace.collector.config import load_config
    from tokentrace.collector.store import is_postgresql

    objects = _render("overlays/replicas-postgresql")
    statefulset = _one(objects, "StatefulSet", "tokentrace-collector")
    assert statefulset["spec"]["replicas"] == 2
    collector_pod = _pod(statefulset)
    (collector,) = collector_pod["spec"]["containers"]
    raw = _config_map_file(objects, "tokentrace-collector-config", "collector.yaml")
    # The store's URL is a variable set from the Secret's url; the password only in PGPASSWORD.
    url_reference = _CONFIG_VARIABLE.fullmatch(raw["exporters"]["store"]["path"])
    assert url_reference is not None, raw["exporters"]["store"]
    env = {v["name"]: v for v in collector["env"]}
    url_from = env[url_reference.group(1)]["valueFrom"]["secretKeyRef"]
    assert url_from == {"name": _POSTGRESQL_SECRET, "key": "url"}
    password_from = env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]
    assert password_from == {"name": _POSTGRESQL_SECRET, "key": "password"}
    # The collector's own parser, on the file as the pod has it, gives the shared store and the
    # spool directory of the configuration.
    config_file = tmp_path / "collector.yaml"
    config_file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    config = load_config(config_file, environ=_collector_environment(objects))
    assert config.store is not None
    assert is_postgresql(config.store.path)
    assert config.store.path == _POSTGRESQL_URL
    spool = Path(raw["service"]["durability"]["directory"])
    assert config.spool_directory == str(spool)
    # ...on a writable mount of the replica's own claim (volumeClaimTemplates), not shared.
    (spool_mount,) = [m for m in collector["volumeMounts"] if spool.is_relative_to(m["mountPath"])]
    assert not spool_mount.get("readOnly")
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    assert spool_mount["name"] in claims
    assert spool_mount["name"] not in {v["name"] for v in collector_pod["spec"]["volumes"]}
    # ...and the replicas may reach PostgreSQL.
    postgresql_ports = {
        (p.get("protocol", "TCP"), p["port"])
        for policy in _namespaced(objects, "NetworkPolicy", statefulset["metadata"]["namespace"])
        if _selects(policy["spec"]["podSelector"], collector_pod["metadata"]["labels"])
        for rule in policy["spec"].get("egress", [])
        for p in rule["ports"]
    }
    assert ("TCP", 5432) in postgresql_ports


def test_the_node_agents_route_each_trace_to_one_postgresql_replica() -> None:
    """They resolve the StatefulSet's headless Service and connect to each address at the
    name's port (not through the Service's port mapping): the collectors' gRPC receiver."""
    from tokentrace.agent.node.routing import parse_dns_target

    objects = _render("overlays/replicas-postgresql")
    statefulset = _one(objects, "StatefulSet", "tokentrace-collector")
    collector_pod = _pod(statefulset)
    (collector,) = collector_pod["spec"]["containers"]
    raw = _config_map_file(objects, "tokentrace-collector-config", "collector.yaml")
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    node_agent_pod = _pod(daemonset)
    (node_agent,) = node_agent_pod["spec"]["containers"]
    node_env = {v["name"]: v.get("value") for v in node_agent["env"]}
    host, port = parse_dns_target(node_env["TOKENTRACE_NODE_ROUTE_DNS"])
    namespace = statefulset["metadata"]["namespace"]
    service_name = statefulset["spec"]["serviceName"]
    assert host == f"{service_name}.{namespace}.svc"
    headless = _one(objects, "Service", service_name)
    assert headless["spec"]["clusterIP"] == "None"
    assert _selects(
        {"matchLabels": headless["spec"]["selector"]}, collector_pod["metadata"]["labels"]
    )
    (service_port,) = [p for p in headless["spec"]["ports"] if p["port"] == port]
    container_ports = {p["name"]: p["containerPort"] for p in collector["ports"]}
    assert container_ports[service_port["targetPort"]] == port
    grpc = raw["receivers"]["otlp"]["protocols"]["grpc"]
    assert grpc["endpoint"] == f"${{env:POD_IP}}:{port}"
    # Plaintext, as the node agents' upstream (http://) says for every resolved address.
    assert "tls" not in grpc

    # The network lets every node agent reach every replica there.
    policies = _namespaced(objects, "NetworkPolicy", namespace)
    collector_labels = collector_pod["metadata"]["labels"]
    node_agent_labels = node_agent_pod["metadata"]["labels"]
    assert port in _egress_ports(policies, node_agent_labels, collector_labels)
    assert port in {
        p["port"]
        for policy in policies
        if _selects(policy["spec"]["podSelector"], collector_labels)
        for rule in policy["spec"].get("ingress", [])
        if any(_selects(peer.get("podSelector", {}), node_agent_labels) for peer in rule["from"])
        for p in rule["ports"]
    }


def _injected(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod template, first container) of the one Deployment in ``objects``."""
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    return template, template["spec"]["containers"][0]


def test_the_injection_component_puts_the_agent_into_the_inference_pod() -> None:
    template, container = _injected(_render("examples/inference"))
    pod_spec = template["spec"]
    (init,) = pod_spec["initContainers"]
    assert init["image"] == _INJECTION_IMAGE
    assert init["command"] == ["cp", "-r", "/autoinstrumentation/.", f"{_INJECTION_MOUNT}/"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (init_mount,) = init["volumeMounts"]
    assert init_mount["mountPath"] == _INJECTION_MOUNT
    assert "emptyDir" in volumes[init_mount["name"]]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[_INJECTION_MOUNT]["name"] == init_mount["name"]
    assert mounts[_INJECTION_MOUNT]["readOnly"] is True
    env = {v["name"]: v for v in container["env"]}
    assert env["PYTHONPATH"]["value"] == f"{_INJECTION_MOUNT}/bootstrap"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"{_NODE_AGENT_OTLP}:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
    assert env["OTEL_EXPORTER_OTLP_COMPRESSION"]["value"] == "none"  # a node-local hop
    token = env["TOKENTRACE_NODE_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "tokentrace-node-agent-token", "key": "token"}
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["value"] == (
        "authorization=Bearer%20$(TOKENTRACE_NODE_AGENT_TOKEN)"
    )
    assert (
        "app.kubernetes.io/name" in env["OTEL_SERVICE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    assert "app.kubernetes.io/name" in template["metadata"]["labels"]
    fields = {
        name: env[name]["valueFrom"]["fieldRef"]["fieldPath"]
        for name in ("K8S_NODE_NAME", "K8S_POD_NAME", "K8S_NAMESPACE_NAME")
    }
    assert fields == {
        "K8S_NODE_NAME": "spec.nodeName",
        "K8S_POD_NAME": "metadata.name",
        "K8S_NAMESPACE_NAME": "metadata.namespace",
    }
    # The node agent's NetworkPolicy lets exactly these pods in.
    assert template["metadata"]["labels"]["tokentrace.io/instrumented"] == "true"
    policy = _one(_render("overlays/gpu"), "NetworkPolicy", "tokentrace-node-agent-otlp")
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert _selects(peer["podSelector"], template["metadata"]["labels"])
    # The example's GPU is the NVIDIA device plugin's resource.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def _kustomization(
    directory: Path,
    workloads: list[dict[str, Any]],
    *,
    components: tuple[str, ...] = ("injection",),
) -> Path:
    """A kustomization in ``directory`` with these objects and the injection component (or
    the ``components`` named)."""
    directory.mkdir()
    (directory / "workloads.yaml").write_text(yaml.safe_dump_all(workloads), encoding="utf-8")
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["workloads.yaml"],
                # kustomize takes relative paths only.
                "components": [
                    os.path.relpath(_DEPLOY / "components" / name, directory) for name in components
                ],
            }
        ),
        encoding="utf-8",
    )
    return directory


def _deployment(
    name: str, labels: dict[str, str], container: dict[str, Any], *, kind: str = "Deployment"
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "initContainers": [{"name": "own-init", "image": "busybox:1.36"}],
                    "containers": [container, {"name": "sidecar", "image": "envoy:1.30"}],
                    "volumes": [{"name": "models", "emptyDir": {}}],
                },
            },
        },
    }


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_the_injection_component_patches_only_labelled_workloads_and_keeps_theirs(
    kind: str, tmp_path: Path
) -> None:
    engine = {"name": "engine", "image": "vllm:1", "env": [{"name": "A", "value": "1"}]}
    engine["volumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    directory = _kustomization(
        tmp_path / "app",
        [
            _deployment(
                "traced", {"tokentrace.io/inject": "true"}, copy.deepcopy(engine), kind=kind
            ),
            _deployment("untraced", {}, copy.deepcopy(engine), kind=kind),
        ],
    )
    result = subprocess.run(
        [*_kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = {d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout)}
    untraced = _deployment("untraced", {}, copy.deepcopy(engine), kind=kind)
    assert rendered["untraced"]["spec"] == untraced["spec"]
    pod_spec = rendered["traced"]["spec"]["template"]["spec"]
    # The workload's own init container stays (either order works: ours only copies files).
    assert {c["name"] for c in pod_spec["initContainers"]} == {
        "own-init",
        "tokentrace-autoinstrumentation",
    }
    assert {v["name"] for v in pod_spec["volumes"]} == {"models", "tokentrace-autoinstrumentation"}
    engine_out, sidecar = pod_spec["containers"]
    assert [v["name"] for v in engine_out["env"]] == [
        "A",  # the engine's own variables stay, first
        "PYTHONPATH",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "TOKENTRACE_NODE_AGENT_TOKEN",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_SERVICE_NAME",
        "K8S_NODE_NAME",
        "K8S_POD_NAME",
        "K8S_NAMESPACE_NAME",
    ]
    assert [m["name"] for m in engine_out["volumeMounts"]] == [
        "models",
        "tokentrace-autoinstrumentation",
    ]
    assert sidecar == {"name": "sidecar", "image": "envoy:1.30"}


def test_the_injected_agent_reaches_the_node_agents_socket_read_only(tmp_path: Path) -> None:
    """deploy/components/injection-node-socket mounts the directory where the node-socket
    overlay's node agent listens, read-only, and points the agent at the socket in it."""
    import kubernetes_validate

    engine = {"name": "engine", "image": "vllm:1", "env": [], "volumeMounts": []}
    directory = _kustomization(
        tmp_path / "app",
        [_deployment("traced", {"tokentrace.io/inject": "true"}, engine)],
        components=("injection", "injection-node-socket"),
    )
    result = subprocess.run(
        [*_kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    (deployment,) = yaml.safe_load_all(result.stdout)
    kubernetes_validate.validate(deployment, _KUBERNETES_VERSION, strict=True)
    pod_spec = deployment["spec"]["template"]["spec"]
    engine_out = pod_spec["containers"][0]
    env = {v["name"]: v.get("value") for v in engine_out["env"]}
    assert env["TOKENTRACE_NODE_SOCKET"] == _NODE_SOCKET
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"{_NODE_AGENT_OTLP}:4317"  # the fallback
    (mount,) = [m for m in engine_out["volumeMounts"] if m["mountPath"] == "/var/run/tokentrace"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    (daemonset,) = [o for o in _render("overlays/node-socket") if o["kind"] == "DaemonSet"]
    (node_volume,) = [
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "node-socket"
    ]
    assert volume["hostPath"] == {"path": node_volume["hostPath"]["path"], "type": "Directory"}
    assert Path(_NODE_SOCKET).parent == Path(mount["mountPath"])


def test_the_injection_component_says_what_a_container_lacks(tmp_path: Path) -> None:
    """A first container without an env list cannot be appended to: kustomize stops, rather
    than the pod starting untraced."""
    bare = {"name": "engine", "image": "vllm:1"}
    directory = _kustomization(
        tmp_path / "app", [_deployment("traced", {"tokentrace.io/inject": "true"}, bare)]
    )
    result = subprocess.run(
        [*_kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "missing path" in result.stderr or "doc is missing" in result.stderr, result.stderr


def test_the_operator_instrumentation_uses_the_injection_image() -> None:
    """The OpenTelemetry Operator's CRD is not in kubernetes-validate's schemas: the standard
    parts of the object are checked there, the rest by hand."""
    import kubernetes_validate

    (instrumentation,) = list(
        yaml.safe_load_all((_DEPLOY / "examples" / "instrumentation.yaml").read_text("utf-8"))
    )
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(instrumentation, _KUBERNETES_VERSION, strict=True)
    assert instrumentation["apiVersion"] == "opentelemetry.io/v1alpha1"
    assert instrumentation["kind"] == "Instrumentation"
    assert set(instrumentation) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", instrumentation["metadata"]["name"])
    spec = instrumentation["spec"]
    assert set(spec) <= {"exporter", "propagators", "python", "sampler", "resource", "env"}
    assert spec["exporter"]["endpoint"].startswith(_NODE_AGENT_OTLP)
    python = spec["python"]
    assert set(python) <= {"image", "env", "resourceRequirements", "volumeLimitSize"}
    assert python["image"] == _INJECTION_IMAGE
    env = {v["name"]: v for v in python["env"]}
    assert "PYTHONPATH" not in env  # the operator's own finds the image's sitecustomize.py
    port = spec["exporter"]["endpoint"].rsplit(":", 1)[1]
    assert (port, env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"]) in {
        ("4317", "grpc"),
        ("4318", "http/protobuf"),
    }
    assert env["OTEL_EXPORTER_OTLP_COMPRESSION"]["value"] == "none"  # a node-local hop
    token = env["TOKENTRACE_NODE_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "tokentrace-node-agent-token", "key": "token"}
    names = [v["name"] for v in python["env"]]
    assert names.index("TOKENTRACE_NODE_AGENT_TOKEN") < names.index("OTEL_EXPORTER_OTLP_HEADERS")
    # Its env entries and resources are the core types: the schema checks those.
    for variable in python["env"]:
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "probe"},
                "spec": {"containers": [{"name": "c", "env": [variable]}]},
            },
            _KUBERNETES_VERSION,
            strict=True,
        )
