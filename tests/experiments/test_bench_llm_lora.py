"""``python -m experiments.bench.llm_lora --quick``: runs end to end and prints the JSON headline.

No timing assertions (speed is what the benchmark reports). Checked are identities: zero-initialised
LoRA starts at the full model's loss, NF4 stores 4 bits plus one float32 scale per 64 entries, the
LoRA step holds no copy of the frozen kernels. (The `transformers` parity that the benchmark
reports is tested by tests/models/test_decoder_hf.py; `--no-hf` here saves its seconds.)
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from experiments.bench import llm_lora


@pytest.fixture(scope="module")
def run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        headline = llm_lora.main(["--quick", "--no-hf"])  # parity: tests/models/test_decoder_hf.py
    return headline, out.getvalue()


@pytest.fixture(scope="module")
def quick(run):
    return run[0]


def test_quick_run_prints_tables_and_the_headline_last(run):
    headline, text = run
    assert json.loads(text.strip().splitlines()[-1]) == json.loads(json.dumps(headline))
    for key in (
        "scan_lora_extra_over_adapter_bytes",
        "nf4_base_bytes_ratio",
        "lora_vs_full_step",
        "hf_logits_maxdiff",
    ):
        assert key in headline
    assert "| tokens | LoRA step temp MiB |" in text and "| nf4 |" in text
    assert "| qlora-nf4 |" in text


def test_identities_of_the_quick_run(quick):
    # 4-bit codes + one float32 scale per block of 64 inputs: (0.5 + 4/64) / 4 of float32.
    assert quick["nf4_base_bytes_ratio"] == 0.140625
    assert quick["bf16_base_bytes_ratio"] == 0.5
    assert quick["nf4_model_bytes_ratio"] > quick["nf4_base_bytes_ratio"]  # embeddings stay f32
    # Zero-initialised B: LoRA's first loss is the full model's; NF4 rounds the base a little.
    loss0 = quick["loss0"]
    assert abs(loss0["lora"] - loss0["full"]) <= 1e-5
    assert 0 < abs(loss0["qlora-nf4"] - loss0["lora"]) < 5e-2
    # What LoRA adds is about its own gradients (XLA may pack them into holes of the frozen
    # step's buffers at this tiny size), never a copy of the frozen kernels.
    extra = quick["scan_lora_extra_over_adapter_bytes"] * quick["adapter_bytes"]
    assert 0 < extra < 0.5 * quick["base_bytes"]["float32"]["kernels"]
    assert quick["scan_lora_extra_layers"] == 1
    assert quick["layer_factor_bytes"] == quick["adapter_bytes"]  # one layer: all the factors
    assert quick["scan_lora_per_iteration_bytes"] == round(extra) - quick["adapter_bytes"]
    assert quick["lora_vs_full_step"] > 0 and quick["qlora_vs_full_step"] > 0
    assert quick["hf_logits_maxdiff"] is None  # --no-hf


@pytest.mark.parametrize(
    "argv, message",
    [(["--tokens", "1"], "token counts >= 2"), (["--layers", "0"], "positive integer")],
)
def test_bad_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        llm_lora.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
