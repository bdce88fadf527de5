#!/usr/bin/env bash
# The full continual-learning table: every benchmark x all eight methods x 3 seeds.
# Each benchmark writes runs/continual_sweep/<benchmark>/results.md (mean ± sd over seeds).
# Rerunning resumes (per-task checkpoints). About 1 h on an idle 2-core CPU (shakespeare_plays
# 35 min, split_mnist 13 min, long_stream, split_digits and digits_cil a few minutes each).
# One benchmark: experiments/continual_sweep.sh shakespeare_plays
set -euo pipefail
benchmarks=("$@")
if [ ${#benchmarks[@]} -eq 0 ]; then
  benchmarks=(shakespeare_plays split_mnist long_stream split_digits digits_cil)
fi
for benchmark in "${benchmarks[@]}"; do
  python -m experiments.train \
    --config="configs/saber.py:benchmark=${benchmark},method=every,seeds=3" \
    --workdir="runs/continual_sweep/${benchmark}" --config.log.progress=False
done
