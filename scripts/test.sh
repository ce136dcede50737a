#!/usr/bin/env bash
# Install everything the tests need, start dockerd, lint, type-check and run the test suite.
# This is the README's test command and what CI runs (.ci/run calls it). Run as root on a
# fresh Debian machine: it installs docker.io + debootstrap and builds the test image once.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
# the install compiles the scheduling core and the lodger loop: it needs a C compiler
# (tests/test_native.py fails, not skips, when the core fell back to the sources)
if ! command -v cc >/dev/null 2>&1; then
  echo "== installing a C compiler"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
fi
echo "== installing arl-tangram with dev extras"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev,plot,gpu,http,ray]' \
  httpx sandbox-fusion==0.3.7 swe-rex==1.4.0 skyrl-gym==0.4.0
# verl's own reward functions and tool registry are tested against the gateway; without
# verl/__init__ (torch, tensordict) they need only ray (the ray extra, pinned) and omegaconf
"$PY" -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
"$PY" -m pip install -q --disable-pip-version-check omegaconf

echo "== preparing the Docker engine and the test image"
bash .ci/docker-setup.sh

echo "== ruff"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
echo "== mypy (strict: the library and the daemons)"
"$PY" -m mypy tangram tangramd

echo "== pytest"
# the install compiled the scheduling core (tangram/_native.py): tests/test_native.py fails
# if it fell back to the sources, and compares the compiled pass with them
export TANGRAM_EXPECT_COMPILED=1
"$PY" -m pytest -m "not slow" -q -p no:cacheprovider "$@"
