#!/bin/sh
# Install the headless browser the UI's end-to-end tests drive (tests/ui/): Debian's chromium.
# Idempotent: does nothing when /usr/bin/chromium exists. The tests drive it with the Python
# package playwright (from the dev extra) and never download a browser of their own.
set -eu

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    echo "install_browser: $CHROMIUM is already installed ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install Chromium with your package manager so that $CHROMIUM exists" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install_browser: installing chromium needs root: run 'apt-get install -y --no-install-recommends chromium' as root (or allow sudo)" >&2
    exit 1
fi

echo "install_browser: installing chromium (apt-get, no recommends)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# fonts-liberation is only recommended by chromium, but screenshots need a real font.
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-liberation

if [ ! -x "$CHROMIUM" ]; then
    echo "install_browser: apt-get finished but $CHROMIUM is missing" >&2
    exit 1
fi
echo "install_browser: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium)"
