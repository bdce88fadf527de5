"""Repository tooling, run from the checkout's root and never shipped (the wheel holds
``lowrank_jax`` only).

``python tools/status.py`` and ``python tools/test_durations.py`` are scripts; the notebook tools
are modules that the tests import (``from tools import render_notebooks``):
``python -m tools.render_notebooks``, ``python -m tools.colab_cells``,
``python -m tools.make_minilm_fixture``; a Colab runtime runs ``python tools/colab_install.py``.
Investigation scripts that produced a note's numbers live beside the notes, in
``docs/notes/scripts/``.
"""
