"""The experiments' PNG plots leave matplotlib's backend alone (a notebook's inline plots go on)."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from experiments.common import plots


@pytest.fixture
def svg_backend():
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # any backend but Agg: the old helpers switched it to Agg
    yield
    matplotlib.use(before)


def test_plots_write_pngs_without_switching_the_backend(svg_backend, tmp_path):
    curves = plots.plot_curves(
        tmp_path / "c.png", {"a": ([1, 2, 3], [3.0, 2.0, 1.0])}, title="t", logy=True
    )
    heat = plots.plot_heatmap(tmp_path / "h.png", np.eye(3), title="h")
    for path in (curves, heat):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.get_backend() == "svg"
