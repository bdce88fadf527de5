"""The wheel holds the library only, and the README's API tour runs from it outside the checkout."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def _api_tour() -> str:
    """The first python block of the README's "API tour" section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## API tour") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_wheel_holds_only_lowrank_jax_and_the_api_tour_runs_from_it(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("lowrank_jax-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lowrank_jax"}

    # A fresh venv that sees this environment's dependencies but not the checkout.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = (
        "import lowrank_jax, pathlib, sys\n"
        f"assert pathlib.Path(lowrank_jax.__file__).is_relative_to({str(venv)!r}), "
        "lowrank_jax.__file__\n" + _api_tour() + "\nprint('api tour ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(python), "-c", script], cwd=work, env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "api tour ok" in out.stdout
    assert (work / "out" / "adapter_model.safetensors").is_file()
