#!/usr/bin/env bash
# The full continual-learning table: every benchmark x all eight methods x 3 seeds.
# Each benchmark writes runs/continual_sweep/<benchmark>/results.md (mean ± sd over seeds).
# Rerunning resumes (per-task checkpoints). About 1 h on a 2-core CPU.
set -euo pipefail
for benchmark in split_digits digits_cil long_stream; do
  python -m experiments.train \
    --config="configs/saber.py:benchmark=${benchmark},method=every,seeds=3" \
    --workdir="runs/continual_sweep/${benchmark}"
done
