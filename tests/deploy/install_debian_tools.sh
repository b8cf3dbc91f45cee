#!/bin/sh
# Install the Debian tools the deploy tests drive, those missing only (idempotent):
#   prometheus   the Grafana dashboard's test starts a real Prometheus (tests/deploy/test_grafana_dashboard.py)
#   buildah      the images are built for real, without a Docker daemon (tests/deploy/test_image_build.py)
#   debootstrap  ... on a Debian base made here (no registry pulls)
# The prometheus package's service is not started: the tests start their own, on 127.0.0.1.
set -eu

missing=""
[ -x /usr/bin/prometheus ] || missing="$missing prometheus"
[ -x /usr/bin/buildah ] || missing="$missing buildah"
[ -x /usr/sbin/debootstrap ] || missing="$missing debootstrap"

if [ -z "$missing" ]; then
    echo "install_debian_tools: prometheus, buildah and debootstrap are installed"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_debian_tools: no apt-get here; install$missing with your package manager" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install_debian_tools: installing$missing needs root: run 'apt-get install -y --no-install-recommends$missing' as root (or allow sudo)" >&2
    exit 1
fi

echo "install_debian_tools: installing$missing (apt-get, no recommends)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2086 # one word per package
$SUDO apt-get install -y -q --no-install-recommends $missing
echo "install_debian_tools: done"
