from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokentrace.agent import semconv
from tokentrace.agent.bootstrap import PINNED_EXPORTER_ENV, pin_exporter_environment
from tokentrace.agent.config import load_agent_config

TOKENTRACE = [sys.executable, "-m", "tokentrace.agent.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOKENTRACE, "run", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_run_injects_the_agent_into_the_command_and_its_children() -> None:
    probe = (
        "import sys, subprocess;"
        "print('here', 'tokentrace.agent.bootstrap' in sys.modules);"
        "child = subprocess.run([sys.executable, '-c', "
        '\'import sys; print("child", "tokentrace.agent.bootstrap" in sys.modules)\'],'
        " capture_output=True, text=True); print(child.stdout.strip())"
    )
    result = run("--service-name", "svc-x", "--", sys.executable, "-c", probe)
    assert result.returncode == 0, result.stderr
    assert "here True" in result.stdout and "child True" in result.stdout


def test_run_keeps_an_existing_sitecustomize_working(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.MARK = 'theirs'\n")
    import os

    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    probe = (
        "import builtins, sys;"
        "print(getattr(builtins, 'MARK', None), 'tokentrace.agent.bootstrap' in sys.modules)"
    )
    result = run("--", sys.executable, "-c", probe, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["theirs", "True"]


def test_run_sets_the_standard_variables() -> None:
    probe = (
        "import os;"
        "print(os.environ['OTEL_SERVICE_NAME'], os.environ['OTEL_EXPORTER_OTLP_ENDPOINT'])"
    )
    result = run(
        "--service-name",
        "svc",
        "--endpoint",
        "http://127.0.0.1:9",
        "--",
        sys.executable,
        "-c",
        probe,
    )
    assert result.stdout.split() == ["svc", "http://127.0.0.1:9"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [((), 2, "nothing to run"), (("--", "no-such-cmd-xyz"), 127, "command not found")],
)
def test_run_errors_are_clear(args: tuple[str, ...], code: int, message: str) -> None:
    result = run(*args)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr


def test_agent_config_defaults_to_the_node_local_collector() -> None:
    config = load_agent_config({})
    assert config.enabled
    assert config.exporter.endpoint == "http://localhost:4317"
    assert config.exporter.protocol == "grpc"
    assert config.resource()[semconv.SERVICE_NAME] == "vllm"


def test_agent_config_reads_the_otel_variables() -> None:
    config = load_agent_config(
        {
            "OTEL_SERVICE_NAME": "chat",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p%201,deployment.environment=prod",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://node:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "TOKENTRACE_MAX_TOKEN_OFFSETS": "64",
            "TOKENTRACE_MAX_REQUEST_AGE": "30",
        }
    )
    assert config.max_request_age_s == 30
    assert config.resource()[semconv.SERVICE_NAME] == "chat"
    assert config.resource()[semconv.K8S_POD_NAME] == "p 1"
    assert config.exporter.endpoint == "http://node:4318"
    assert config.exporter.protocol == "http/protobuf"
    assert config.max_token_offsets == 64


def test_agent_config_is_disabled_by_either_switch() -> None:
    assert not load_agent_config({"OTEL_SDK_DISABLED": "true"}).enabled
    assert not load_agent_config({"TOKENTRACE_ENABLED": "false"}).enabled


@pytest.mark.parametrize(
    ("value", "reads"), [(None, True), ("false", False), ("0", False), ("sure", True)]
)
def test_the_http_receive_wait_is_read_unless_turned_off_and_reaches_the_http_tracer(
    value: str | None, reads: bool
) -> None:
    from tokentrace.agent.frameworks.patching import EngineInstrumentor
    from tokentrace.agent.runtime import AgentRuntime

    environment = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    if value is not None:
        environment["TOKENTRACE_HTTP_RECEIVE_WAIT"] = value
    config = load_agent_config(environment)
    assert config.http_receive_wait is reads
    runtime = AgentRuntime(config)
    try:
        assert EngineInstrumentor._runtime_http_tracer(runtime).receive_wait is reads
    finally:
        runtime.shutdown(1.0)


def test_bad_agent_values_fall_back_to_defaults_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = load_agent_config(
            {
                "TOKENTRACE_MAX_QUEUE": "lots",
                "TOKENTRACE_ENABLED": "maybe",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon",
            }
        )
    assert config.enabled and config.max_queue == 8192
    assert config.exporter.endpoint == "http://localhost:4317"
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "TOKENTRACE_MAX_QUEUE" in messages and "TOKENTRACE_ENABLED" in messages


def test_engine_step_settings_are_read_and_bad_ones_fall_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = load_agent_config(
        {
            "TOKENTRACE_ENGINE_STEPS": "128",
            "TOKENTRACE_STEP_SAMPLE_RATE": "0.5",
            "TOKENTRACE_ITL_OUTLIER_RATIO": "4",
        }
    )
    assert (config.engine_steps, config.step_sample_rate, config.itl_outlier_ratio) == (128, 0.5, 4)
    with caplog.at_level(logging.WARNING):
        config = load_agent_config(
            {"TOKENTRACE_STEP_SAMPLE_RATE": "1.5", "TOKENTRACE_ITL_OUTLIER_RATIO": "nan"}
        )
    assert (config.step_sample_rate, config.itl_outlier_ratio) == (0.01, 3.0)
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "between 0 and 1" in messages and "TOKENTRACE_ITL_OUTLIER_RATIO" in messages


def test_the_batch_delay_is_the_sdks_variable_in_ms_and_bad_values_fall_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tokentrace.agent.runtime import AgentRuntime

    assert load_agent_config({}).batch_delay_s == 0.2
    config = load_agent_config(
        {"OTEL_BSP_SCHEDULE_DELAY": "1000", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    )
    assert config.batch_delay_s == 1.0
    runtime = AgentRuntime(config)
    try:
        assert runtime.emitter._interval_s == 1.0
    finally:
        runtime.shutdown(1.0)
    for bad in ("0", "soon", "3600000"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert load_agent_config({"OTEL_BSP_SCHEDULE_DELAY": bad}).batch_delay_s == 0.2
        assert "OTEL_BSP_SCHEDULE_DELAY" in caplog.text


@pytest.mark.parametrize(
    ("environ", "warned"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4317"}, True),  # http/protobuf default
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4317",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            False,
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "agent:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            True,
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4318"}, False),
        ({}, False),  # the default: gRPC to localhost:4317
    ],
)
def test_an_endpoint_on_the_other_protocols_port_is_warned_about(
    environ: dict[str, str], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        load_agent_config(environ)
    assert any("OTEL_EXPORTER_OTLP_PROTOCOL=" in r.getMessage() for r in caplog.records) is warned


def test_runtime_shares_one_monotonic_to_unix_mapping_and_checks_sender_room() -> None:
    from tokentrace.agent.runtime import AgentRuntime

    config = load_agent_config({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    runtime = AgentRuntime(config)
    try:
        assert runtime.emitter._clock is runtime.clock
        assert runtime.emitter._has_room == runtime.sender.has_room
        stats = runtime.stats()
        assert stats["expired_requests"] == stats["untraced_requests"] == 0
        assert stats["emitter.handed_to_sender_requests"] == 0
    finally:
        runtime.shutdown(1.0)


# --- the exporter variables the first process saw --------------------------------------------
_CHILD_READS_ITS_ENDPOINT = (
    "from tokentrace.agent.config import load_agent_config; "
    "print(load_agent_config().exporter.endpoint_for('traces'))"
)
_PARENT_PINS_THEN_THE_ENGINE_REWRITES = (
    "import os, subprocess, sys\n"
    "from tokentrace.agent.bootstrap import pin_exporter_environment\n"
    "pin_exporter_environment(os.environ)\n"
    # what vLLM does for --otlp-traces-endpoint, in the API server, before spawning EngineCore
    "os.environ['OTEL_EXPORTER_OTLP_TRACES_ENDPOINT'] = 'grpc://vllm-tracing:4317'\n"
    "subprocess.run([sys.executable, '-c', sys.argv[1]], check=True)\n"
)


def test_child_processes_export_where_the_first_process_was_told_to() -> None:
    """An engine that sets OTEL_EXPORTER_OTLP_TRACES_ENDPOINT for its own tracing once running
    does not redirect tokentrace's spans in the processes it starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENTRACE_"))}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://node-agent:4317"
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    child = subprocess.run(
        [sys.executable, "-c", _PARENT_PINS_THEN_THE_ENGINE_REWRITES, _CHILD_READS_ITS_ENDPOINT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "http://node-agent:4317"
    # Without the pin, the child would follow the engine's variable.
    unpinned = load_agent_config(
        {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "grpc://vllm-tracing:4317"}
    )
    assert unpinned.exporter.endpoint_for("traces") == "http://vllm-tracing:4317"


def test_a_pin_is_kept_by_the_process_that_inherits_it() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://first:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "x",
    }
    pin_exporter_environment(environ)
    pinned = environ[PINNED_EXPORTER_ENV]
    environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://second:4318"
    pin_exporter_environment(environ)
    assert environ[PINNED_EXPORTER_ENV] == pinned
    assert json.loads(pinned) == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://first:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    config = load_agent_config(
        {
            **environ,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20later",
        }
    )
    # Every exporter variable comes from the pin: changed or added later, none is read.
    assert config.exporter.endpoint == "http://first:4317"
    assert (config.exporter.protocol, dict(config.exporter.headers)) == ("grpc", {})


@pytest.mark.parametrize(
    "bad", ["{not json", '["a"]', '{"PATH": "/bin"}', '{"OTEL_EXPORTER_OTLP_X": 1}']
)
def test_a_bad_pin_is_ignored_with_a_warning(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = load_agent_config(
            {PINNED_EXPORTER_ENV: bad, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://live:4317"}
        )
    assert config.exporter.endpoint == "http://live:4317"
    assert PINNED_EXPORTER_ENV in caplog.text
