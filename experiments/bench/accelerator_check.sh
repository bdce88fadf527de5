#!/usr/bin/env bash
# The one script to run on a fresh TPU or GPU VM: prints the backend and devices, reproduces the
# benchmarks that matter on an accelerator (adapter step, FP8 scales, KGE vs PyKEEN, the decoder
# LLM), trains each area's :smoke config on the real backend, runs the test suite on whatever
# backend JAX finds (GPU, TPU or CPU), and writes one JSON summary, from the repository root:
#
#   experiments/bench/accelerator_check.sh           # full sizes, then the test suite
#   experiments/bench/accelerator_check.sh --smoke   # tiny sizes, no test suite (what CI runs)
#
# Each benchmark prints its table and, last, a JSON line; everything goes to
# runs/accelerator_check/<backend>/ as well, and summary.json there collects the last lines.
# Install first: make install (or pip install -e ".[test,peers]" plus the matching accelerator jax, e.g. pip install "jax[cuda12]>=0.10.2,<0.11").
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
smoke=0
[ "${1:-}" = "--smoke" ] && smoke=1

backend=$($PYTHON -c "import jax; print(jax.default_backend())")
out=runs/accelerator_check/$backend
mkdir -p "$out"
rm -f "$out"/*.txt "$out/summary.json"  # this run's outputs only
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
  run llm_lora experiments.bench.llm_lora
  # Each area's :smoke config trained on the real backend (the tests only lower them for TPU/GPU):
  # adapters on MiniLM, continual learning, FP8 scales, the decoder LLM, KGE, generative models.
  for spec in lora_finetune.py:smoke saber.py:smoke fp8_attention.py:smoke llm_lora.py:smoke \
              kge.py:smoke tfft.py:smoke; do
    name=smoke_${spec%%.py*}
    echo "== $name: python -m experiments.train --config=configs/$spec"
    start=$(date +%s)
    rc=0
    $PYTHON -m experiments.train --config="configs/$spec" --workdir="$out/runs/$name" \
      --config.log.progress=False > "$out/$name.txt" 2>&1 || rc=$?
    echo "{\"rc\": $rc, \"wall_s\": $(( $(date +%s) - start ))}" >> "$out/$name.txt"
    tail -1 "$out/$name.txt"
  done
  # The first task of the pre-trained-ViT benchmark imagenet_r_10 (20 classes, InfLoRA's 50
  # epochs at batch 128) with SABER, where the checkpoint and the prepared data are on the VM:
  # VIT_CHECKPOINT=<save_pretrained dir of google/vit-base-patch16-224-in21k>,
  # TFDS_DATA_DIR=<tfds data_dir with imagenet_r prepared as array_record>.
  if [ -n "${VIT_CHECKPOINT:-}" ] && [ -n "${TFDS_DATA_DIR:-}" ]; then
    name=imagenet_r_10_first_task
    echo "== $name: python -m experiments.train --config=configs/saber.py:benchmark=imagenet_r_10,method=saber"
    start=$(date +%s)
    rc=0
    $PYTHON -m experiments.train --config=configs/saber.py:benchmark=imagenet_r_10,method=saber \
      --config.model.checkpoint="$VIT_CHECKPOINT" --config.data.data_dir="$TFDS_DATA_DIR" \
      --config.data.num_tasks=1 --config.data.classes_per_task=20 \
      --workdir="$out/runs/$name" --config.log.progress=False > "$out/$name.txt" 2>&1 || rc=$?
    echo "{\"rc\": $rc, \"wall_s\": $(( $(date +%s) - start ))}" >> "$out/$name.txt"
    tail -1 "$out/$name.txt"
  else
    echo "== imagenet_r_10 first task: skipped (set VIT_CHECKPOINT and TFDS_DATA_DIR to run it)"
  fi
  echo "== test suite on $backend"
  $PYTHON -m pytest -q tests 2>&1 | tee "$out/tests.txt"
fi

# One JSON summary: the backend, the devices and the last (JSON) line of every step above.
$PYTHON - "$out" <<'PY'
import json, pathlib, sys
import jax
out = pathlib.Path(sys.argv[1])
summary = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
for path in sorted(p for p in out.glob("*.txt") if p.stem != "devices"):
    lines = path.read_text().strip().splitlines()
    try:
        summary[path.stem] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        summary[path.stem] = {"last_line": lines[-1] if lines else ""}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
PY
echo "accelerator check done: $out (summary.json)"
