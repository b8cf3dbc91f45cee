"""``tokentrace load`` against ``vllm bench serve``: the same server, the same load, interleaved.

    python bench/load_vs_vllm_bench.py [--rounds 3] [--prompts 64] [--concurrency 16]

Starts the real vLLM (tiny random-weight model, CPU), then alternates the two tools
(vllm bench serve's random dataset vs tokentrace load with the same input/output lengths,
streaming completions, ignore_eos) for several rounds and prints each round's TTFT/TPOT/ITL/E2E
p50 and p99 side by side, and the ratio of the medians over the rounds. This machine is noisy:
compare the spread of the rounds, not one number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokentrace.loadgen.local_vllm import running_vllm_server
from tokentrace.loadgen.tiny_model import build_tiny_model

_METRICS = ("ttft", "tpot", "itl", "e2e")
_VLLM_NAMES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}
_BENCH = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


def vllm_bench(url: str, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable, "-c", _BENCH, "--backend", "vllm", "--base-url", url,
        "--model", "tiny-llama", "--tokenizer", str(model_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name, "--request-rate", "inf",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    result = json.loads(out.read_text())
    return {
        f"{metric}_{q}": float(result[f"p{q}_{_VLLM_NAMES[metric]}_ms"])
        for metric in _METRICS
        for q in (50, 99)
    }


def tokentrace_load(
    url: str, model_dir: Path, out: Path, args: argparse.Namespace, seed: int
) -> dict[str, float]:
    command = [
        sys.executable, "-m", "tokentrace.agent.cli", "load", url, "--api", "completions",
        "--concurrency", str(args.concurrency), "--requests", str(args.prompts),
        "--prompt-tokens", str(args.input_len), "--output-tokens", str(args.output_len),
        "--tokenizer", str(model_dir), "--seed", str(seed), "--percentiles", "50,99",
        "--out", str(out), "--quiet", "--json",
    ]  # fmt: skip
    summary = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
    return {
        f"{metric}_{q}": float(summary["metrics"][metric][f"p{q}"])
        for metric in _METRICS
        for q in (50, 99)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tokentrace-vs-vllm-bench-"))
    model_dir = build_tiny_model(workdir / "tiny-llama")
    rows: dict[str, list[dict[str, float]]] = {"vllm bench serve": [], "tokentrace load": []}
    with running_vllm_server(model_dir, log_path=workdir / "vllm.log") as server:
        for round_index in range(args.rounds):
            out = workdir / f"bench-{round_index}.json"
            rows["vllm bench serve"].append(vllm_bench(server.base_url, model_dir, out, args))
            out = workdir / f"load-{round_index}.json"
            rows["tokentrace load"].append(
                tokentrace_load(server.base_url, model_dir, out, args, round_index)
            )
    keys = [f"{metric}_{q}" for metric in _METRICS for q in (50, 99)]
    print(f"{args.prompts} prompts, concurrency {args.concurrency}, in {args.input_len} / out "
          f"{args.output_len} tokens, {args.rounds} interleaved rounds (ms)")  # fmt: skip
    print(f"{'tool':<18}{'round':>6}" + "".join(f"{key:>10}" for key in keys))
    for tool, results in rows.items():
        for index, values in enumerate(results):
            print(f"{tool:<18}{index:>6}" + "".join(f"{values[key]:>10.2f}" for key in keys))
    medians = {
        tool: {key: statistics.median(r[key] for r in results) for key in keys}
        for tool, results in rows.items()
    }
    ratio = "".join(
        f"{medians['tokentrace load'][k] / medians['vllm bench serve'][k]:>10.2f}" for k in keys
    )
    print(f"{'load / bench':<24}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
