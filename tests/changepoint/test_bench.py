"""The changepoint benchmark runs on tiny settings and reports its JSON keys."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("changepoint_online") is None
    or importlib.util.find_spec("ruptures") is None,
    reason="peers extra not installed",
)
def test_bench_changepoint_tiny(capsys):
    from experiments.bench import changepoint

    out = changepoint.main(
        [
            "--ts",
            "96",
            "160",
            "--steps",
            "32",
            "--rounds",
            "1",
            "--window",
            "8",
            "--ruptures-steps",
            "1",
        ]
    )
    for key in ("per_step_growth", "speedup_vs_focus", "speedup_vs_ruptures"):
        assert out[key] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
