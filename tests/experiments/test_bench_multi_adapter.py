"""``python -m experiments.bench.multi_adapter --quick``: runs end to end and prints the JSON row."""

from __future__ import annotations

import json

from experiments.bench import multi_adapter


def test_quick_prints_the_json_row(capsys):
    row = multi_adapter.main(["--quick"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == row
    assert row["adapters"] == 4 and row["mixed_s"] > 0 and row["separate_s"] > 0
    assert row["max_abs_diff"] <= 3e-2  # the mixed batch gives each sequence its own adapter
    assert row["adapter_effect"] > 10 * max(row["max_abs_diff"], 1e-3)  # and adapters matter
    # greedy decoding: the one-hot einsum baseline decodes the same tokens as the gathered bank
    assert row["decode_mixed_equals_onehot"] and row["decode_adapters"] == 2
    for name in (
        "mixed_vs_base_throughput",
        "mixed_vs_single_throughput",
        "mixed_vs_onehot_einsum",
    ):
        assert row[name] > 0
