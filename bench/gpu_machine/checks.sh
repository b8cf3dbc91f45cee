#!/bin/bash
# The checks to run when a GPU machine is lent (one device call, ~2 minutes of its time; see
# docs/node-agent.md "On a real GPU" and docs/performance.md "On a machine with cores to spare"):
#   here:  bash bench/gpu_machine/wheels.sh
#   there: bash bench/gpu_machine/checks.sh          (device tool: carry [".whl"])
# 1. the node agent against the real driver (bench/nvml_real_gpu.py);
# 2. the collector's per-core throughput, pinned, on a quiet machine;
# 3. two collector replicas against one (SQLite: PostgreSQL's server binaries are not there).
# Everything lands in $OUT (the device tool's folder that comes back), the log included.
set -uo pipefail
out=${OUT:-/tmp/gpu_machine_out}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
cd "$(dirname "$0")/../.."
date; nproc; nvidia-smi -L; python3 --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# The C helpers built for this Python in the tree; tokentrace imported from the tree through a
# folder of links (the image's Python has no editable install of it).
PYTHONPATH=/tmp/site timeout 120 python3 -c "from setuptools import setup; setup()" \
  build_ext --inplace > "$out/build.txt" 2>&1 || echo "C helpers not built (pure Python): see build.txt"
mkdir -p /tmp/pkg/tokentrace
for d in agent collector processors loadgen; do ln -sfn "$PWD/$d" "/tmp/pkg/tokentrace/$d"; done
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
python3 -c "from tokentrace.processors import _native" && echo "C helpers: in use"
timeout 120 python3 bench/nvml_real_gpu.py --out "$out/nvml_real_gpu.json" > "$out/nvml.txt" 2>&1
echo "nvml_real_gpu rc=$?"; grep -E '^(FAIL|== done)' "$out/nvml.txt"
timeout 120 python3 bench/collector_throughput.py --requests 20000 --runs 3 --compression none \
  > "$out/one_core.txt" 2>&1
echo "collector one core rc=$?"; grep -A12 '^end to end' "$out/one_core.txt"
timeout 150 python3 bench/collector_throughput.py --requests 20000 --runs 3 --replicas 2 \
  --store sqlite --compression none > "$out/replicas.txt" 2>&1
echo "replicas rc=$?"; grep -E 'run [0-9]|median' "$out/replicas.txt"
date
