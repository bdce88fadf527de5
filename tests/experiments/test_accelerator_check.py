"""The accelerator script runs unchanged on CPU (smoke sizes) and ends each benchmark with JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.experiments.test_train_cli import REPO


def test_accelerator_check_runs_on_cpu_in_smoke_form(tmp_path):
    # The script calls $PYTHON (default: `python` on PATH), which is not this interpreter when the
    # tests run from a virtualenv that is not activated: pass ours.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "experiments/bench/accelerator_check.sh", "--smoke"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "accelerator check done: runs/accelerator_check/cpu" in proc.stdout
    out = REPO / "runs" / "accelerator_check" / "cpu"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "cpu" and summary["devices"]
    for name in ("adapter_step", "fp8_scales", "kge_vs_pykeen"):
        last = (out / f"{name}.txt").read_text().strip().splitlines()[-1]
        assert isinstance(json.loads(last), dict), (name, last)
        assert summary[name] == json.loads(last)
