#!/usr/bin/env bash
# The main job: install, start `tangramd up` on the embedded default (process backend) and
# drive an example agentic rollout through it, printing a per-action-kind summary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev]'
exec "$PY" examples/rollout.py "$@"
