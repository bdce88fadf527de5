"""The P7 sampler benchmark at a tiny shape: both routes run, the JSON line has the headline keys."""

import json

from experiments.bench import kernel_score


def test_bench_tiny_shape(capsys):
    out = kernel_score.main(
        ["--n", "40", "--dim", "6", "--samples", "8", "--steps", "3", "--chunk", "16", "--full"]
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out
    assert out["samples_per_s"] > 0 and out["peak_rss_mb"] > 0
    assert out["unchunked_samples_per_s"] > 0 and not out["extrapolated"]
    step = kernel_score.main(
        ["--n", "40", "--dim", "6", "--samples", "8", "--chunk", "16", "--max-unchunked-mb", "0"]
    )
    assert step["extrapolated"] and "skipped" in step["unchunked"]
