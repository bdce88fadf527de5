"""The test tiers. ``tests/conftest.py`` gives every test the marker of the first rule below whose
pattern matches its test id (``tests/<path>.py::<name>[<params>]``, shell-style ``fnmatch``), and
``unit`` when none does; so a test's tier follows from its path and no test body names it.

``make test-fast`` is ``pytest -m unit``; ``make test`` runs every tier. The contributor guide
(docs/guides/contributing.md) says which tier to run when and holds the durations table that
``python tools/test_durations.py`` regenerates.
"""

from __future__ import annotations

import fnmatch

# The tiers, in the order of the contributor guide: name -> what it holds.
TIERS = {
    "unit": "identities, invariants, plumbing and error messages: seconds each (make test-fast)",
    "slow": "integration runs: experiments end to end, CLI runs, resume, long fits",
    "notebooks": "the colabs executed in smoke mode and the site's executed copies",
    "docs": "the README's and the site's examples and the Sphinx build",
    "peers": "checks against PyTorch PEFT, transformers, PyKEEN and the other peers",
    "multiprocess": "several processes or eight fake devices in subprocesses",
}

# (pattern over the test id, tier); the first match wins.
RULES: tuple[tuple[str, str], ...] = (
    ("tests/test_notebooks.py::*", "notebooks"),
    ("tests/test_docs.py::*", "docs"),
    # several processes, or fake devices that need a process of their own
    ("tests/experiments/test_multiprocess.py::*", "multiprocess"),
    ("tests/experiments/test_devices.py::*", "multiprocess"),
    ("tests/adapters/test_sharding.py::*", "multiprocess"),
    ("tests/models/test_decoder_sharding.py::*", "multiprocess"),
    # the peers (the `peers` extra)
    ("tests/adapters/test_peft.py::test_pytorch_peft_*", "peers"),
    ("tests/adapters/test_peft_edge_cases.py::*", "peers"),
    ("tests/adapters/test_peft_minilm.py::*", "peers"),
    ("tests/adapters/test_peft_parity.py::*", "peers"),
    ("tests/analysis/test_pruning_peers.py::*", "peers"),
    ("tests/changepoint/test_changepoint.py::test_ruptures_*", "peers"),
    ("tests/merging/test_peft_agreement.py::*", "peers"),
    ("tests/models/test_decoder_hf.py::*", "peers"),
    ("tests/models/test_readme_decoder.py::*", "peers"),
    ("tests/tuning/test_bo.py::test_random_and_tpe_searches_follow_the_table", "peers"),
    ("tests/tuning/test_lasso.py::test_*_cvxpy_*", "peers"),
    ("tests/tuning/test_lasso.py::test_proxes_equal_their_definition", "peers"),
    ("tests/tuning/test_lasso_tuners.py::test_tpe_peer_*", "peers"),
    # integration runs
    ("tests/test_wheel.py::*", "slow"),
)


def tier_of(test_id: str) -> str:
    """The tier of a test, from its id (``tests/adapters/test_core.py::test_merge[lora]``)."""
    for pattern, tier in RULES:
        if fnmatch.fnmatchcase(test_id, pattern):
            return tier
    return "unit"
