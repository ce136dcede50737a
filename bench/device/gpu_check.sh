#!/usr/bin/env bash
# One prepared check of the GPU service runtime on a machine with an NVIDIA GPU.
#
#   OUT=/some/dir bash bench/device/gpu_check.sh
#
# Writes into $OUT (a temp dir if unset); each step is bounded by `timeout` and the limits add
# up to 540 s (+ a few seconds of env probing), so the whole script ends in < 10 minutes:
#   env.txt              nvidia-smi, python, torch/transformers/vllm versions
#   inventory.json       NVML discovery through tangramd.services.discover
#   torch_runtime.json   torch runtime on CUDA: restore, evict (GPU memory freed), kill/restart
#   gpu_restore.json     restore bandwidth vs a bare pinned H2D copy, 64 MB .. 8 GB
#   gpu_restore_28g.json the 28 GB set (goal: restored in <= 1 s on an H100/H200)
#   vllm.json            http runtime against a real `vllm serve --enable-sleep-mode`
#   elastic.json         a 2-GPU torch replica (two workers, one per device: the 1-GPU answer)
#                        and two 1-GPU replicas each running a batch of 4 (needs 2 GPUs for
#                        the 2-GPU parts; with one they are recorded as skipped)
#   pytest.txt           the service tests (simulated inventory) on this machine, the elastic
#                        ones (k-worker replicas, service profile, --tensor-parallel-size) too
#   summary.json         exit status and seconds of every step
# Nothing is downloaded: a missing torch or vllm is recorded, and the other steps still run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=()

step() {  # step NAME SECONDS CMD... : run with a time limit, record status and duration
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=3 "$limit" "$@"
  local rc=$?
  STEPS+=("\"$name\": {\"rc\": $rc, \"s\": $((SECONDS - start))}")
  echo "== $name: rc=$rc in $((SECONDS - start))s"
}

{
  date -u
  nvidia-smi || echo "nvidia-smi: not available"
  nvidia-smi topo -m 2>/dev/null || true
  "$PY" --version
  for mod in torch transformers vllm pynvml; do
    "$PY" -c "import $mod; print('$mod', getattr($mod, '__version__', '?'))" 2>&1 | tail -1
  done
  "$PY" -c "import torch; print('cuda', torch.cuda.is_available(), torch.version.cuda)" 2>&1 | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step inventory 20 "$PY" -c "
import json; from tangramd.services import discover
inv = discover(); print(json.dumps(inv.to_json(), indent=1))
open('$OUT/inventory.json', 'w').write(json.dumps(inv.to_json(), indent=1))"

if "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  step torch_runtime 80 "$PY" bench/device/cuda_check.py torch "$OUT/torch_runtime.json"
  step gpu_restore 80 sh -c "'$PY' bench/gpu_restore.py --sizes 64,256,1024,2048,8192 --json \
    >'$OUT/gpu_restore.json'"
  step gpu_restore_28g 90 sh -c "'$PY' bench/gpu_restore.py --sizes 28672 --repeat 2 --json \
    >'$OUT/gpu_restore_28g.json'"
  step vllm 120 "$PY" bench/device/cuda_check.py vllm "$OUT/vllm.json"
  step elastic 60 "$PY" bench/device/cuda_check.py elastic "$OUT/elastic.json"
else
  echo "torch with CUDA is not installed here: torch runtime, bandwidth and vllm steps skipped" \
    | tee "$OUT/skipped.txt"
fi

if "$PY" -c "import torch, pytest" 2>/dev/null; then
  step pytest 90 sh -c "'$PY' -m pytest -q -p no:cacheprovider tests/test_services_spec.py \
    tests/test_services_torch.py tests/test_services_http.py tests/test_services_elastic.py \
    tests/test_services_elastic_replicas.py >'$OUT/pytest.txt' 2>&1"
  tail -3 "$OUT/pytest.txt"
fi

(IFS=,; echo "{${STEPS[*]}}") >"$OUT/summary.json"
cat "$OUT/summary.json"
