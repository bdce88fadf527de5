"""The wheel holds the library only, and the MiniLM/PEFT example of the docs' getting-started page
runs from it outside the checkout."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def _api_tour() -> str:
    """The first python block of the "PEFT in and out" section of docs/getting_started.md."""
    page = (REPO / "docs" / "getting_started.md").read_text()
    section = page[page.index("## The pretrained MiniLM, and PEFT in and out") :]
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

    # The wheel installed into a directory of its own, first on PYTHONPATH, run by this
    # interpreter from outside the checkout: it sees the active environment's dependencies
    # (a virtualenv's or a global install's alike; a nested `venv --system-site-packages` would
    # see the *base* interpreter's instead) and imports lowrank_jax from the wheel.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = (
        "import lowrank_jax, pathlib, sys\n"
        f"assert pathlib.Path(lowrank_jax.__file__).is_relative_to({str(target)!r}), "
        "lowrank_jax.__file__\n"
        f"assert not any(pathlib.Path(p or '.').resolve() == pathlib.Path({str(REPO)!r}) "
        "for p in sys.path), sys.path\n" + _api_tour() + "\nprint('api tour ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=work, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "api tour ok" in out.stdout
    assert (work / "out" / "adapter_model.safetensors").is_file()
