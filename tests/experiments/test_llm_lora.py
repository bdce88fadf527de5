"""The decoder LoRA/QLoRA experiment (configs/llm_lora.py): a tiny run end to end, then rerun.

The rerun finds every ``fit`` finished (pretraining and each fine-tuning cell) and only
re-evaluates, so its results equal the first run's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import llm_lora as llm_config
from experiments import common, llm_lora


def _tiny():
    config = llm_config.get_config("smoke")
    config.data.max_passages_per_play = 12
    config.data.finetune_examples = 64
    config.model.pretrain_steps = 12
    config.schedule.num_steps = 4
    config.schedule.warmup_steps = 1
    config.finetune.learning_rates = (1e-2,)
    config.finetune.bases = ("float32", "int8", "nf4")  # bfloat16 too by default
    config.model.num_hidden_layers = 1  # (XLA unrolls a 2-step scan: twice the compile time)
    config.data.passage_chars = 64
    config.eval.sample_prompt_chars = 16
    config.eval.sample_tokens = 8
    config.eval.num_samples = 1
    config.ckpt.every = 4
    config.log.every = 2
    config.log.progress = False
    return config


def test_tiny_run_end_to_end_and_rerun(tmp_path):
    config = _tiny()
    first = llm_lora.run(config, str(tmp_path))
    assert not first["interrupted"]
    sizes = first["base_bytes"]
    assert sizes["nf4"] < sizes["int8"] < sizes["float32"]
    for base in ("float32", "nf4"):
        m = first["methods"][base]
        assert m["lr"] == 1e-2 and np.isfinite(m["test/ppl_after"]) and m["test/ppl_after"] > 1
        assert m["test/ppl_before"] == first["test/ppl_before"][base]
    assert len(first["samples"]["nf4"]) == 1 and len(first["samples"]["nf4"][0]) > 0
    table = (tmp_path / "results.md").read_text()
    assert "| LoRA | float32 |" in table and "| QLoRA (NF4) | nf4 |" in table
    assert "| (base only) | int8 |" in table
    for name in ("samples.md", "finetune_loss.png", "results.json", "pretrained_hf/config.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "finetune" / "nf4_lr0.01" / "checkpoints").is_dir()
    # Rerunning finds every fit finished: nothing trains again, the numbers repeat.
    again = llm_lora.run(config, str(tmp_path))
    for base in ("float32", "nf4"):
        assert again["methods"][base]["test/ppl_after"] == pytest.approx(
            first["methods"][base]["test/ppl_after"], rel=1e-6
        )
    steps = [r["step"] for r in common.read_metrics(tmp_path / "finetune" / "nf4_lr0.01")]
    assert max(steps) == 4
    assert json.loads((tmp_path / "results.json").read_text())["methods"]["nf4"]["lr"] == 1e-2


def test_config_errors_name_the_key():
    config = _tiny()
    config.data.finetune_genre = "comedy"  # also a pretraining genre
    with pytest.raises(common.ConfigError, match="held out"):
        llm_lora.check_config(config)
    config = _tiny()
    config.finetune.methods = ("float32", "fp4")
    with pytest.raises(common.ConfigError, match="'fp4'"):
        llm_lora.check_config(config)
