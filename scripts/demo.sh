#!/usr/bin/env bash
# The main job: install, start `tangramd up` on the embedded default (process backend) and
# drive an example agentic rollout through it: a crowded phase (cores scarce, reward runs
# on one core each) and a tail phase (stragglers alone, where the elastic reward run gets a
# second core if the profile says it pays on this host). Prints a per-phase, per-kind
# summary, and where the daemon's log and the demo's files are (/tmp/tangram-demo-*).
#
# Everything runs in the project venv .venv (made with $PYTHON, else the system python3, on
# the first run; scripts/_venv.sh). A re-run installs nothing unless the tree changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
venv_up
install_tangram dev
step "running examples/rollout.py $*"
exec "$PY" examples/rollout.py "$@"
