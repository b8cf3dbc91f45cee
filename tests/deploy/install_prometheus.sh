#!/bin/sh
# Install the Prometheus server the dashboard's tests start (tests/deploy/test_grafana_dashboard.py):
# Debian's package, a single static binary (/usr/bin/prometheus). Idempotent: does nothing when
# it is already there. The package's service is not started (the tests start their own, on
# 127.0.0.1 with a port of their own and a temporary storage directory).
set -eu

PROMETHEUS=/usr/bin/prometheus

if [ -x "$PROMETHEUS" ]; then
    echo "install_prometheus: $PROMETHEUS is already installed ($("$PROMETHEUS" --version 2>/dev/null | head -n 1 || echo 'version unknown'))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus: no apt-get here; install Prometheus with your package manager so that $PROMETHEUS exists" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install_prometheus: installing prometheus needs root: run 'apt-get install -y --no-install-recommends prometheus' as root (or allow sudo)" >&2
    exit 1
fi

echo "install_prometheus: installing prometheus (apt-get, no recommends)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends prometheus

if [ ! -x "$PROMETHEUS" ]; then
    echo "install_prometheus: apt-get finished but $PROMETHEUS is missing" >&2
    exit 1
fi
echo "install_prometheus: installed $("$PROMETHEUS" --version 2>/dev/null | head -n 1 || echo prometheus)"
