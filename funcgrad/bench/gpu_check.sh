#!/usr/bin/env bash
# The CUDA rows of issue 28's GPU targets, in about 5 minutes on one GPU:
#   seed k=8 <= 1.3x one fwd+bwd; backward features k=8 <= 1.3x sum(losses) fwd+bwd;
#   backward params k=8 <= 1.0x TorchJD; 512 probes <= 1.05x raw vmap(vjp); every entry
#   point of the overhead case <= 1.2x its recipe with <= 1 host read; chunk_size="auto"
#   within 1.5x its budget + the answer by torch.cuda.max_memory_allocated.
# Usage, from anywhere: bash funcgrad/bench/gpu_check.sh OUT_DIR [PYTHON]
# Each case runs in its own process with its own time limit, so that one slow case leaves
# the others' reports: OUT_DIR/<case>/results.{md,json}, OUT_DIR/<case>.log, and
# OUT_DIR/summary.md (the environment, then every report). Needs torch with CUDA, optree,
# tqdm and, for the mtl-weighting rows, torchjd with quadprog + qpsolvers.
# DEVICE=cpu BENCH_ARGS=--quick runs the same on the CPU (a smoke test of the script).
set -u
out=${1:?usage: bash funcgrad/bench/gpu_check.sh OUT_DIR [PYTHON]}
py=${2:-python3}
device=${DEVICE:-cuda}
root=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  "$py" -c "import torch, funcgrad; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); print('funcgrad', funcgrad.__file__)"
  "$py" -c "import torchjd, qpsolvers, quadprog; print('torchjd', torchjd.__file__)" \
    || echo "WARNING: torchjd/quadprog/qpsolvers missing: no mtl-weighting rows"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# case, seconds allowed, options. Timing runs skip the peak-memory subprocesses (each would
# start CUDA again); chunk-memory measures them (max_memory_allocated, a process a method).
while read -r case limit options; do
  # shellcheck disable=SC2086
  timeout "$limit" "$py" -m funcgrad.bench --device "$device" --cases "$case" $options \
    ${BENCH_ARGS:-} --out "$out/$case" > "$out/$case.log" 2>&1
  echo "$case: exit $? (limit ${limit}s)" | tee -a "$out/env.txt"
done <<'CASES'
seed 70 --heads 8 --no-memory
mtl-weighting 100 --heads 8 --no-memory
probes 60 --no-memory
overhead 100 --no-memory
chunk-memory 100 --rounds 1
CASES
cat "$out/env.txt" "$out"/*/results.md > "$out/summary.md" 2>/dev/null
grep -h -A40 "^## Targets" "$out"/*/results.md
