"""The LESS-vs-GIST selection benchmark at a tiny shape: both run, the JSON line is consistent."""

import json

import pytest

from experiments.bench import selection as bench_selection


def test_bench_tiny_shape(capsys):
    argv = ["--pool", "24", "--val", "12", "--subtasks", "3", "--less-dim", "64", "--gist-k", "4"]
    out = bench_selection.main(argv + ["--seq-len", "16", "--width", "16", "--depth", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out
    # 16-wide, 1 block, rank 8 on q, k, v, out: 4 x (16 x 8 + 8 x 16) factor parameters
    assert out["factor_params"] == 4 * 2 * 16 * 8
    assert out["less_bytes_per_example"] == 4 * 64 * 4 and out["gist_bytes_per_example"] == 4 * 4
    assert out["gist_storage_ratio"] == pytest.approx(4 / (64 * 4))
    assert out["gist_time_ratio"] > 0 and out["less_examples_per_s"] > 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="--gist-k and --subtasks must be <= --val"):
        bench_selection.main(["--val", "5", "--gist-k", "9"])
    with pytest.raises(ValueError, match="positive"):
        bench_selection.main(["--pool", "0"])
