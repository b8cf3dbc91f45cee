from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokentrace.collector.config import ConfigError, load_config, parse_config
from tokentrace.collector.service import describe_config


def parse(raw: object, **environ: str):  # type: ignore[no-untyped-def]
    return parse_config(raw, environ=environ)


def test_no_config_listens_on_standard_loopback_ports_and_stores_locally() -> None:
    config = load_config(None, environ={})
    assert config.grpc is not None and config.grpc.endpoint == "127.0.0.1:4317"
    assert config.http is not None and config.http.endpoint == "127.0.0.1:4318"
    assert config.store is not None and config.store.path == "./tokentrace.db"
    assert config.upstream == ()
    assert config.processor_ids == ("assembly", "slo", "diagnosis", "percentiles")


def test_upstream_export_only_when_the_environment_says_where() -> None:
    config = parse({}, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9999")
    assert [u.id for u in config.upstream] == ["otlp"]


def test_full_config_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(
        """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 500ms, max_traces: 10}
  slo:
    targets:
      - {name: chat-ttft, metric: ttft, percentile: 95, threshold: 500ms,
         selector: {operation: chat}}
  percentiles: {window: 2m, slices: 12}
exporters:
  store: {path: STORE, retention: 1d}
  otlp/tempo: {endpoint: "http://127.0.0.1:4317", metrics_interval: 5s}
service:
  pipelines:
    traces:
      receivers: [otlp]
      processors: [assembly, slo, percentiles]
      exporters: [store, otlp/tempo]
""".replace("STORE", str(tmp_path / "x.db")),
        encoding="utf-8",
    )
    config = load_config(path, environ={})
    assert config.http is None and config.grpc is not None
    assert config.assembly.quiet_period_s == pytest.approx(0.5)
    assert config.assembly.max_traces == 10
    assert config.diagnosis is None
    assert [t.name for t in config.slo_targets] == ["chat-ttft"]
    assert config.slo_targets[0].threshold_ns == 500_000_000
    assert config.percentiles is not None and config.percentiles.window_s == 120
    assert config.store is not None and config.store.retention_s == 86400
    (upstream,) = config.upstream
    assert upstream.id == "otlp/tempo" and upstream.config.metrics_interval_s == 5
    assert upstream.config.exporter.endpoint == "http://127.0.0.1:4317"
    assert upstream.config.exporter.protocol == "grpc"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"receivers": {"kafka": {}}}, "receivers.kafka: unknown component type"),
        (
            {"processors": {"assembly": {"quiet_period": "soon"}}},
            "processors.assembly.quiet_period",
        ),
        ({"processors": {"assembly": {"max_traces": 0}}}, "processors.assembly.max_traces"),
        (
            {"processors": {"assembly": {"max_trace": 5}}},
            "processors.assembly.max_trace: unknown key",
        ),
        (
            {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "localhost"}}}}},
            "receivers.otlp.protocols.grpc.endpoint: expected HOST:PORT",
        ),
        (
            {
                "processors": {
                    "slo": {
                        "targets": [
                            {"name": "a", "metric": "ttft", "percentile": 95, "threshold": "fast"}
                        ]
                    }
                }
            },
            "slo.targets[0].threshold",
        ),
        (
            {"service": {"pipelines": {"traces": {"processors": ["slo", "assembly"]}}}},
            "must run in the order",
        ),
        (
            {"service": {"pipelines": {"traces": {"processors": ["diagnosis"]}}}},
            "'assembly' is required",
        ),
        ({"exporters": {"otlp": {}}}, "exporters.otlp: needs an endpoint"),
        (
            {"exporters": {"otlp": {"endpoint": "http://127.0.0.1:4317", "bogus": 1}}},
            "exporters.otlp.bogus: unknown key",
        ),
        (
            {"exporters": {"otlp": {"endpoint": "http://127.0.0.1:4317", "protocol": "carrier"}}},
            "exporters.otlp.protocol",
        ),
        ({"receivers": []}, "receivers: expected a mapping"),
        (
            {"service": {"pipelines": {"traces": {"exporters": ["jaeger"]}}}},
            "service.pipelines.traces.exporters",
        ),
    ],
)
def test_bad_config_names_the_key(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as error:
        parse(raw)
    assert message in str(error.value)


def test_unreadable_and_invalid_yaml_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("receivers: [unclosed", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})


def test_named_components_are_used_by_kind() -> None:
    config = parse(
        {
            "receivers": {"otlp/local": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
            "processors": {"diagnosis/strict": {"long_prompt_tokens": 64}},
            "exporters": {"store/local": {"path": "x.db"}},
            "service": {
                "pipelines": {
                    "traces": {
                        "receivers": ["otlp/local"],
                        "processors": ["assembly", "diagnosis/strict"],
                        "exporters": ["store/local"],
                    }
                }
            },
        }
    )
    assert config.grpc is not None and config.grpc.endpoint == "127.0.0.1:0"
    assert config.diagnosis is not None and config.diagnosis.long_prompt_tokens == 64
    assert config.store is not None and config.store.path == "x.db"
    assert config.upstream == ()


def test_two_receivers_of_one_kind_are_refused() -> None:
    with pytest.raises(ConfigError, match="both 'otlp'"):
        parse(
            {
                "receivers": {"otlp/b": {}},
                "service": {"pipelines": {"traces": {"receivers": ["otlp", "otlp/b"]}}},
            }
        )


def test_an_empty_endpoint_variable_means_no_upstream() -> None:
    assert parse({}, OTEL_EXPORTER_OTLP_ENDPOINT="").upstream == ()


def test_env_references_are_substituted_and_missing_ones_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "receivers:\n  otlp:\n    protocols:\n      grpc:\n"
        "        endpoint: 127.0.0.1:4317\n        auth_token: ${env:TOKEN}\n",
        encoding="utf-8",
    )
    config = load_config(path, environ={"TOKEN": "s3cret: {not yaml}"})
    assert config.grpc is not None and config.grpc.auth_token == "s3cret: {not yaml}"
    with pytest.raises(ConfigError, match=r"receivers.otlp.protocols.grpc.auth_token: .*TOKEN"):
        load_config(path, environ={})


def test_file_references_read_a_mounted_secret(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("s3cret-from-a-file\n", encoding="utf-8")
    path = tmp_path / "c.yaml"
    path.write_text(
        "receivers:\n  otlp:\n    protocols:\n      grpc:\n"
        "        endpoint: 127.0.0.1:4317\n        auth_token: ${file:secrets/token}\n"
        f"      http:\n        auth_token: ${{file:{tmp_path}/secrets/token}}\n",
        encoding="utf-8",
    )
    config = load_config(path, environ={})
    assert config.grpc is not None and config.grpc.auth_token == "s3cret-from-a-file"
    assert config.http is not None and config.http.auth_token == "s3cret-from-a-file"
    (tmp_path / "secrets" / "token").unlink()
    with pytest.raises(ConfigError, match=r"protocols.grpc.auth_token: cannot read .*token"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("${env:NOT A NAME}", r"\$\{env:NOT A NAME\} is not a variable name"),
        ("${file:big}", r"big is larger than 65536 bytes"),
        ("${file:binary}", r"binary is not UTF-8 text"),
    ],
)
def test_bad_references_are_named(tmp_path: Path, reference: str, message: str) -> None:
    (tmp_path / "big").write_bytes(b"x" * (64 * 1024 + 1))
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    path = tmp_path / "c.yaml"
    path.write_text(
        f"receivers:\n  otlp:\n    protocols:\n      grpc:\n        auth_token: '{reference}'\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=f"receivers.otlp.protocols.grpc.auth_token: .*{message}"):
        load_config(path, environ={})


def test_the_shipped_deploy_config_is_valid() -> None:
    """deploy/base/collector/collector.yaml (the Kubernetes ConfigMap's content) with the
    variables the StatefulSet sets; tests/deploy/test_kustomize.py checks the rendered one."""
    path = Path(__file__).resolve().parents[2] / "deploy" / "base" / "collector" / "collector.yaml"
    environ = {"POD_IP": "10.1.2.3", "TOKENTRACE_RECEIVER_TOKEN": "t", "TOKENTRACE_UI_TOKEN": "u"}
    config = load_config(path, environ=environ)
    assert config.grpc is not None and config.grpc.auth_token == "t"
    assert config.grpc.endpoint == "10.1.2.3:4317"


@pytest.mark.parametrize(
    "listed",
    [
        ["assembly", "slo", "diagnosis", "percentiles"],
        ["assembly", "diagnosis", "slo", "percentiles"],  # written before the verdict followed SLO
    ],
)
def test_slo_and_diagnosis_may_be_listed_in_either_order(listed: list[str]) -> None:
    config = parse({"service": {"pipelines": {"traces": {"processors": listed}}}})
    assert config.processor_ids == ("assembly", "slo", "diagnosis", "percentiles")  # run order
    assert config.diagnosis is not None and config.slo_targets == ()


def test_a_pipeline_listing_no_processor_still_assembles() -> None:
    config = parse({"service": {"pipelines": {"traces": {"processors": []}}}})
    assert config.processor_ids == ("assembly",)


def test_percentiles_before_the_verdict_is_still_refused() -> None:
    with pytest.raises(ConfigError, match="must run in the order assembly, slo, diagnosis"):
        parse(
            {
                "service": {
                    "pipelines": {"traces": {"processors": ["assembly", "percentiles", "slo"]}}
                }
            }
        )


@pytest.mark.parametrize(
    ("endpoint", "token", "said"),
    [
        ("127.0.0.1:4317", None, ""),
        ("localhost:4317", None, ""),
        ("10.0.0.7:4317", "s3cret", " (not loopback)"),
        ("0.0.0.0:4317", "s3cret", " (ALL interfaces)"),
        ("[::]:4317", None, " (ALL interfaces): NO bearer token, anyone who reaches it can send"),
        ("10.0.0.7:4317", None, " (not loopback): NO bearer token, anyone who reaches it can send"),
    ],
)
def test_a_receiver_beyond_loopback_is_said_so_where_the_collector_says_what_it_runs(
    endpoint: str, token: str | None, said: str
) -> None:
    grpc: dict[str, Any] = {"endpoint": endpoint}
    if token:
        grpc["auth_token"] = token
    config = parse_config({"receivers": {"otlp": {"protocols": {"grpc": grpc}}}}, environ={})
    (line,) = [line for line in describe_config(config) if line.startswith("OTLP/gRPC")]
    if said:
        assert said in line
    else:
        assert "loopback" not in line and "interfaces" not in line and "NO bearer" not in line
