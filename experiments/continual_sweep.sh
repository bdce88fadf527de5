#!/usr/bin/env bash
# The full continual-learning table: every benchmark x all eight methods x 3 seeds, each method's
# head (masked or aligned) and, with SEARCH > 0, its hyper-parameters chosen on seed 0's
# validation split (experiments/common/continual_search.py), then 3 seeds trained with the chosen values.
# Each benchmark writes runs/continual_sweep/<benchmark>_s<SEARCH>/results.md (mean ± sd over
# seeds, the chosen values, the validation accuracy per head). Rerunning resumes.
# Run one benchmark at a time: two runs in parallel on a 2-core CPU take about twice as long in
# total as the same runs one after the other.
# Cost per run of one method (one seed) on a 2-core CPU, measured: digits_cil ~20 s, split_mnist
# ~50 s, shakespeare_plays ~1.5-2 min, mnist_cil ~2 min, long_stream 3.5-7 min (the aligned
# head samples all 100 classes every alignment step); a benchmark costs
# 8 methods x (2 x max(SEARCH, 1) + 3) runs (digits_cil with SEARCH=3: 23 min; split_mnist: 38).
#   experiments/continual_sweep.sh shakespeare_plays            # heads only
#   SEARCH=3 experiments/continual_sweep.sh digits_cil          # 3 trials x 2 heads
#   HEADS=0 experiments/continual_sweep.sh split_digits         # the benchmark's default head
# mnist_cil (MNIST 5 x 2 classes on a Fashion-MNIST-pretrained ViT) is not in the default list.
set -euo pipefail
search="${SEARCH:-0}"
heads=",compare_heads"
suffix="_s${search}"
if [ "${HEADS:-1}" = "0" ]; then
  heads=""
  suffix="${suffix}_default_head"
fi
benchmarks=("$@")
if [ ${#benchmarks[@]} -eq 0 ]; then
  benchmarks=(shakespeare_plays split_mnist long_stream split_digits digits_cil)
fi
for benchmark in "${benchmarks[@]}"; do
  python -m experiments.train \
    --config="configs/saber.py:benchmark=${benchmark},method=every,seeds=3,search=${search}${heads}" \
    --workdir="runs/continual_sweep/${benchmark}${suffix}" --config.log.progress=False
done
