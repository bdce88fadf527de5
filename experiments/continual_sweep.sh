#!/usr/bin/env bash
# The full continual-learning table: every benchmark x all eight methods x 3 seeds.
# Each benchmark writes runs/continual_sweep/<benchmark>/results.md (mean ± sd over seeds).
# Rerunning resumes (per-task checkpoints). About 1 h on an idle 2-core CPU (shakespeare_plays
# 35 min, split_mnist 13 min, long_stream, split_digits and digits_cil a few minutes each;
# mnist_cil, MNIST 5 x 2 classes on a Fashion-MNIST-pretrained ViT, is not in the default list).
# One benchmark: experiments/continual_sweep.sh shakespeare_plays
# With the validation search (SEARCH random-search trials per method, chosen on a validation
# split of the training tasks, then 3 seeds with the chosen values; about SEARCH + 1 times the
# cost): SEARCH=6 experiments/continual_sweep.sh split_digits
set -euo pipefail
search="${SEARCH:-0}"
benchmarks=("$@")
if [ ${#benchmarks[@]} -eq 0 ]; then
  benchmarks=(shakespeare_plays split_mnist long_stream split_digits digits_cil)
fi
suffix=""
if [ "${search}" != "0" ]; then
  suffix="_search${search}"
fi
for benchmark in "${benchmarks[@]}"; do
  python -m experiments.train \
    --config="configs/saber.py:benchmark=${benchmark},method=every,seeds=3,search=${search}" \
    --workdir="runs/continual_sweep/${benchmark}${suffix}" --config.log.progress=False
done
