#!/bin/bash
# Downloads into .whl/ (run from the repository root, here, where pip reaches the registry) the
# cp312 wheels that the GPU machine's image lacks, at the versions constraints.txt pins, for
# bench/gpu_machine/checks.sh. The device tool carries .whl/ (`carry: [".whl"]`), which git
# must ignore: this script adds it to .git/info/exclude.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl  # two versions of one package stop the install there: start from none
# The collector's and node agent's dependencies (pyproject.toml) and theirs; the image has
# numpy, pyyaml, prometheus-client and zipp. Versions not in constraints.txt are pinned here.
pinned=(importlib-metadata==8.7.1 typing-inspection==0.4.5 annotated-types==0.8.0
  googleapis-common-protos==1.76.0 h11==0.16.0 anyio==4.16.0 typing-extensions==4.16.0
  starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 httptools==0.9.0)
from_constraints=()
for name in opentelemetry-api opentelemetry-sdk opentelemetry-proto \
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
  opentelemetry-exporter-otlp-proto-http opentelemetry-semantic-conventions \
  opentelemetry-instrumentation grpcio protobuf ddsketch msgspec nvidia-ml-py wrapt fastapi uvicorn; do
  line=$(grep -i "^${name}==" constraints.txt) || { echo "wheels.sh: $name is not pinned in constraints.txt" >&2; exit 2; }
  from_constraints+=("$line")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d .whl "${from_constraints[@]}" "${pinned[@]}"
du -sh .whl
