#!/usr/bin/env bash
# Prepare a local Docker engine for the docker-marked tests (idempotent, run as root).
#
# Network rule: the engine runs with --bridge=none --iptables=false, so containers only ever
# have their own loopback; tests create them with network_mode="none" and talk to them over a
# bind-mounted Unix socket. There is no registry here: the test image is built with
# debootstrap from the Debian mirror apt already uses and imported as tangram-test:bookworm.
set -euo pipefail

IMAGE="${TANGRAM_TEST_IMAGE:-tangram-test:bookworm}"
LOG="${DOCKERD_LOG:-/tmp/dockerd.log}"
SOCK=/var/run/docker.sock

mirror() {
    # First "URIs:" (deb822) or "deb URL bookworm" line of apt's own sources, else the default.
    local url
    url=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | awk '{print $2}' | grep -m1 '/debian$' || true)
    if [[ -z "$url" ]]; then
        url=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '$3 == "bookworm" {print $2; exit}' || true)
    fi
    echo "${url:-http://deb.debian.org/debian}"
}

engine_up() {
    [[ -S "$SOCK" ]] && docker version --format '{{.Server.Version}}' >/dev/null 2>&1
}

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap
fi

if ! engine_up; then
    echo "starting dockerd (log: $LOG)"
    setsid nohup dockerd --bridge=none --iptables=false >"$LOG" 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        engine_up && break
        sleep 0.5
    done
    engine_up || { echo "dockerd did not come up; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
fi

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    ROOTFS=$(mktemp -d /var/tmp/tangram-rootfs.XXXXXX)
    trap 'rm -rf "$ROOTFS"' EXIT
    echo "building $IMAGE with debootstrap into $ROOTFS"
    debootstrap --variant=minbase \
        --include=python3,python3-pytest,python3-pytest-xdist,procps \
        bookworm "$ROOTFS" "$(mirror)"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE"
fi
echo "docker ready: $(docker version --format '{{.Server.Version}}'), image $IMAGE"
