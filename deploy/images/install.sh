#!/bin/sh
# What each of tokentrace's images installs, in one place: the Dockerfile's build stages run it,
# and tests/deploy/test_images.py runs it into a temporary prefix (no container engine needed).
#
#   install.sh SOURCE TARGET PREFIX
#
# SOURCE is the repository (pyproject.toml, constraints.txt and the four package folders).
# TARGET:
#   collector           a virtual environment at PREFIX with tokentrace[collector,postgresql]
#   node-agent          a virtual environment at PREFIX with tokentrace[node]
#   autoinstrumentation the injection tree at PREFIX (the OpenTelemetry Operator's Python
#                       convention; the init container copies it into the pod's emptyDir):
#     tokentrace-packages/     pip install --target of tokentrace[agent]
#     bootstrap/sitecustomize.py                                    PYTHONPATH of our Kustomize component
#     opentelemetry/instrumentation/auto_instrumentation/sitecustomize.py   the Operator's PYTHONPATH
#   Both sitecustomize.py are the installed tokentrace/agent/inject/sitecustomize.py, and the
#   folders on the way hold nothing else (no __init__.py): they never shadow the host's packages.
#   That sitecustomize appends tokentrace-packages at the END of sys.path, so the host's own
#   protobuf, grpcio and opentelemetry win and the tree only fills in what the host lacks.
#
# PYTHON (default python3) runs pip: its version and platform decide the wheels, so it must be
# the images' Python (3.11). Versions come from constraints.txt (what CI tests). The package is
# built from a scratch copy of SOURCE, so the checkout gets no build/ or egg-info. pip's cache is
# left on: in an image it stays in the discarded build stage, on a machine it speeds up rebuilds.
set -eu

if [ "$#" -ne 3 ]; then
    echo "usage: install.sh SOURCE collector|node-agent|autoinstrumentation PREFIX" >&2
    exit 2
fi
source_dir=$1
target=$2
prefix=$3
python=${PYTHON:-python3}

case "$target" in
    collector) extra=collector,postgresql ;;
    node-agent) extra=node ;;
    autoinstrumentation) extra=agent ;;
    *)
        echo "install.sh: unknown target '$target' (collector, node-agent or autoinstrumentation)" >&2
        exit 2
        ;;
esac

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/src"
for entry in pyproject.toml README.md agent collector processors loadgen; do
    cp -R "$source_dir/$entry" "$scratch/src/"
done
find "$scratch/src" -name __pycache__ -type d -prune -exec rm -rf {} +

if [ "$target" = autoinstrumentation ]; then
    mkdir -p "$prefix"
    packages="$prefix/tokentrace-packages"
    # pip from a scratch virtual environment: the base's Python need not have one (Debian's
    # has none), and the tree gets the wheels of that Python's version and platform.
    "$python" -m venv "$scratch/pip-env"
    "$scratch/pip-env/bin/python" -m pip install --quiet \
        --disable-pip-version-check --constraint "$source_dir/constraints.txt" \
        --target "$packages" "$scratch/src[agent]"
    # Console scripts are of no use in a tree that only PYTHONPATH reaches.
    rm -rf "$packages/bin"
    injector="$packages/tokentrace/agent/inject/sitecustomize.py"
    for folder in bootstrap opentelemetry/instrumentation/auto_instrumentation; do
        mkdir -p "$prefix/$folder"
        cp "$injector" "$prefix/$folder/sitecustomize.py"
    done
    # Readable by any user id the pod runs as (the Operator's image does the same).
    chmod -R go+rX "$prefix"
else
    "$python" -m venv "$prefix"
    "$prefix/bin/python" -m pip install --quiet --disable-pip-version-check \
        --constraint "$source_dir/constraints.txt" "$scratch/src[$extra]"
    # The final image runs the command, it installs nothing: no installer left in it.
    "$prefix/bin/python" -m pip uninstall --quiet --yes pip setuptools wheel >/dev/null 2>&1 || true
fi
