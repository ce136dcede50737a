#!/usr/bin/env bash
# Install everything the tests need, start dockerd, lint, type-check and run the test suite.
# This is the README's test command and what CI runs (.ci/run calls it). Run as root on a
# fresh Debian machine: it installs docker.io + debootstrap and builds the test image once.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/_venv.sh
# the install compiles the scheduling core and the lodger loop: it needs a C compiler
# (tests/test_native.py fails, not skips, when the core fell back to the sources)
if ! command -v cc >/dev/null 2>&1; then
  step "installing a C compiler (apt-get)"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
fi
venv_up
# one install, every extra: the compiled core is built once (after scripts/demo.sh made the
# venv, only the missing requirements are installed)
install_tangram dev,plot,gpu,http,ray httpx sandbox-fusion==0.3.7 swe-rex==1.4.0 \
  skyrl-gym==0.4.0 omegaconf
# verl's own reward functions and tool registry are tested against the gateway; without
# verl/__init__ (torch, tensordict) they need only ray (the ray extra, pinned) and omegaconf
pip_once "verl 0.9.1 (without its dependencies)" --no-deps verl==0.9.1

step "preparing the Docker engine and the test image"
bash .ci/docker-setup.sh

step "ruff"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
step "mypy (strict: the library and the daemons)"
"$PY" -m mypy tangram tangramd

step "pytest -m \"not slow\" $*"
# the install compiled the scheduling core (tangram/_native.py): tests/test_native.py fails
# if it fell back to the sources, and compares the compiled pass with them
export TANGRAM_EXPECT_COMPILED=1
"$PY" -m pytest -m "not slow" -q -p no:cacheprovider "$@"
step "done"
