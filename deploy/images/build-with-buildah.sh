#!/bin/sh
# Build the three images without a Docker daemon: buildah with the vfs storage driver and chroot
# isolation (works as root in an unprivileged container), on a Python 3.11 base made here with
# debootstrap (Debian bookworm's python3 is 3.11) instead of the pinned python:3.11-slim-bookworm,
# for machines that cannot pull from Docker Hub. Run as root from the repository root:
#
#   apt-get install buildah debootstrap
#   sh deploy/images/build-with-buildah.sh [WORKDIR]
#
# Measured on a CI-class machine (2 shared cores): debootstrap about 70 s, the base import about
# 13 s, then the three images about 130 s (vfs copies every layer); about 3.5 minutes cold,
# mostly downloads and copies. Where outgoing TLS is re-signed by a local CA, set PIP_CA_BUNDLE to
# that CA bundle: it is mounted into the build steps with a pip.conf naming it (the image's own
# CA bundle is not changed).
set -eu

workdir=${1:-/tmp/tokentrace-images}
base=localhost/tokentrace-build-base:3.11
buildah="buildah --storage-driver vfs"
mkdir -p "$workdir"

if ! $buildah inspect --type image "$base" >/dev/null 2>&1; then
    rm -rf "$workdir/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$workdir/rootfs" \
        http://deb.debian.org/debian >"$workdir/debootstrap.log"
    container=$($buildah from scratch)
    $buildah copy "$container" "$workdir/rootfs/" / >/dev/null
    $buildah config --env PATH=/usr/local/bin:/usr/bin:/bin "$container"
    $buildah commit --quiet "$container" "$base" >/dev/null
    $buildah rm "$container" >/dev/null
fi

set --
if [ -n "${PIP_CA_BUNDLE:-}" ]; then
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$workdir/pip.conf"
    set -- -v "$PIP_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" -v "$workdir/pip.conf:/etc/pip.conf:ro"
fi
for target in autoinstrumentation collector node-agent; do
    tag="ghcr.io/tokentrace/tokentrace-$target:0.1.0"
    previous=$($buildah inspect --type image --format '{{.FromImageID}}' "$tag" 2>/dev/null || true)
    $buildah bud --isolation chroot "$@" -f deploy/images/Dockerfile \
        --build-arg "PYTHON_BASE=$base" --target "$target" -t "$tag" .
    # The image this build replaced lost its tag: remove it, or every rebuild leaves a full
    # copy behind (vfs storage shares no layers).
    current=$($buildah inspect --type image --format '{{.FromImageID}}' "$tag")
    if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
        $buildah rmi "$previous" >/dev/null 2>&1 || true
    fi
done
