#!/usr/bin/env bash
# What playing deploy/kubernetes with podman needs on a Debian host (tests/e2e/
# test_kubernetes.py runs it): podman, runc, aardvark-dns (names on podman networks),
# catatonit (the pause process of a pod: `kube play` builds its pause image from it, and
# podman only recommends it), mmdebstrap (the base image, from Debian packages). Quick when
# they are there already.
set -euo pipefail
need=()
for tool in podman:podman runc:runc mmdebstrap:mmdebstrap /usr/lib/podman/aardvark-dns:aardvark-dns \
    catatonit:catatonit; do
    command -v "${tool%%:*}" >/dev/null || need+=("${tool##*:}")
done
[ ${#need[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
    apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
