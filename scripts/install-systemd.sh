#!/usr/bin/env bash
# Install the systemd units of systemd/ for the tangramd this machine has, wherever it is
# (a venv such as /opt/arl-tangram or .venv, pip's /usr/local/bin, ...), with the shipped
# configs and the docs the units' Documentation= names. Checks the units with
# `systemd-analyze verify` where it exists. Enables nothing: it prints the commands that do.
#
#   bash scripts/install-systemd.sh [--bin PATH] [--root DIR]
#
#   --bin PATH   the tangramd to run (default: `command -v tangramd`, made absolute)
#   --root DIR   install under DIR instead of / (packaging, tests); no daemon-reload then
set -euo pipefail
cd "$(dirname "$0")/.."

bin=""
root="/"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="${2:?--bin needs a PATH}"; shift 2 ;;
    --root) root="${2:?--root needs a DIR}"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-systemd: unknown option $1 (want --bin PATH, --root DIR)" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  bin="$(command -v tangramd || true)"
  if [ -z "$bin" ]; then
    echo "install-systemd: no tangramd on PATH: install arl-tangram first, or pass --bin PATH" >&2
    exit 2
  fi
fi
case "$bin" in
  */shims/*)  # a pyenv shim needs pyenv's environment, which a unit does not have
    bin="$(pyenv which tangramd)" ;;
esac
bin="$(realpath -m "$bin")"
if [ ! -x "$bin" ]; then
  echo "install-systemd: --bin $bin is not an executable file" >&2
  exit 2
fi

units="$root/etc/systemd/system"
configs="$root/etc/tangram"
docs="$root/usr/share/doc/arl-tangram"
mkdir -p "$units" "$configs" "$docs"

for unit in systemd/*.service; do
  out="$units/$(basename "$unit")"
  sed "s#/usr/local/bin/tangramd#$bin#g" "$unit" > "$out"
  case "$bin" in
    /root/*|/home/*)
      # ProtectHome=yes would hide a tangramd installed under a home directory
      sed -i 's/^ProtectHome=yes$/ProtectHome=read-only/' "$out" ;;
  esac
  chmod 0644 "$out"
  echo "installed $out (ExecStart: $bin)"
done
for config in tangram node coordinator; do
  if [ -e "$configs/$config.toml" ]; then
    echo "kept $configs/$config.toml (it exists; the shipped one is config/$config.toml)"
  else
    install -m 0644 "config/$config.toml" "$configs/$config.toml"
    echo "installed $configs/$config.toml"
  fi
done
install -m 0644 README.md "$docs/README.md"
cp -r docs/. "$docs/"
echo "installed the docs in $docs"

if command -v systemd-analyze >/dev/null 2>&1; then
  systemd-analyze verify "$units"/tangramd*.service
  echo "systemd-analyze verify: the units are valid"
else
  echo "systemd-analyze not found: the units were not verified"
fi
if [ "$root" = "/" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "next: systemctl enable --now tangramd   (or tangramd-coordinator / tangramd-node)"
fi
