"""The README's decoder example (LoRA / QLoRA on a Hugging Face checkpoint) runs as written, on a
random tiny `transformers` Llama saved with `save_pretrained` (no download): the same loader is
checked against `transformers` logits in test_decoder_hf.py and against PEFT in
test_decoder_lora.py."""

import pathlib
import re

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _readme_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "models.load_hf_decoder(checkpoint)" in b]
    return block


def test_readme_decoder_example_runs(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "llama")
    code = _readme_block()
    code = re.sub(r'checkpoint = "[^"]*"', f'checkpoint = "{tmp_path / "llama"}"', code)
    code = code.replace('"out/"', f'"{tmp_path / "out"}"')
    rng = np.random.default_rng(0)
    namespace = {
        "tokens": rng.integers(0, 128, size=(2, 9)).astype(np.int32),
        "mask": np.ones((2, 9), np.int32),
    }
    exec(compile(code, "README.md", "exec"), namespace)
    assert np.isfinite(float(namespace["loss"]))
    lora = namespace["lora"]
    assert lora["params/model/layers/mlp/down_proj/kernel"].factors["a"].shape == (2, 128, 16)
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
