#!/usr/bin/env bash
# Reproduces the benchmarks that matter on an accelerator (adapter step, FP8 scales, KGE vs PyKEEN)
# and runs the test suite on whatever backend JAX finds (GPU, TPU or CPU), from the repository root:
#
#   experiments/bench/accelerator_check.sh           # full sizes, then the test suite
#   experiments/bench/accelerator_check.sh --smoke   # tiny sizes, no test suite (what CI runs)
#
# Each benchmark prints its table and, last, a JSON line; everything goes to
# runs/accelerator_check/<backend>/ as well. Install first: make install (or pip install -e ".[test,peers]"
# plus the matching accelerator jax, e.g. pip install "jax[cuda12]>=0.10.2,<0.11").
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
smoke=0
[ "${1:-}" = "--smoke" ] && smoke=1

backend=$($PYTHON -c "import jax; print(jax.default_backend())")
out=runs/accelerator_check/$backend
mkdir -p "$out"
$PYTHON -c "import jax; print('backend', jax.default_backend(), 'devices', jax.devices())" | tee "$out/devices.txt"

if [ $smoke = 1 ]; then
  # no memory curve in smoke form: its (depth, method) cells are one process each (tens of CPU-s of
  # imports); one cell is tested in-process (tests/experiments/test_bench_adapter_step.py)
  adapter=(--steps 1 --warmup 1 --batch 2 --seq 8 --d 64 --rank 4 --no-peft --depths "")
  fp8=(--layers 1 --d 256 --heads 4 --kv-heads 2 --head-dim 64 --iters 4 --explicit-heads 1)
  kge=(--quick)
else
  adapter=()
  fp8=()
  kge=()
fi

run() {  # name, module, args...
  local name=$1 module=$2
  shift 2
  echo "== $name: python -m $module $*"
  $PYTHON -m "$module" "$@" 2>&1 | tee "$out/$name.txt"
}
run adapter_step experiments.bench.adapter_step "${adapter[@]}"
run fp8_scales experiments.bench.fp8_scales "${fp8[@]}"
run kge_vs_pykeen experiments.bench.kge_vs_pykeen "${kge[@]}"

if [ $smoke = 0 ]; then
  echo "== test suite on $backend"
  $PYTHON -m pytest -q tests 2>&1 | tee "$out/tests.txt"
fi
echo "accelerator check done: $out"
