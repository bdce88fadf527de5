"""A LoRA adapter trained here on the real MiniLM loads in PyTorch PEFT and gives the same outputs.

Needs the peers extra (torch 2.13.0 CPU, transformers, peft); skipped without it.
"""

import importlib.util

import jax
import numpy as np
import pytest

from lowrank_jax import adapters, models

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "peft")),
    reason="needs the peers extra (pip install -e '.[peers]')",
)


def test_minilm_adapter_round_trips_through_pytorch_peft(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import BertModel

    config, variables, tokenizer = models.load_minilm()
    encoder = models.BertEncoder(config)
    rules = [(r".*(attention/(query|value)|mlp/fc1)/kernel", adapters.lora(4, alpha=8.0))]
    lora = adapters.init(jax.random.key(0), variables, rules)
    lora = jax.tree.map(lambda t: t + 0.02, lora)  # non-zero B, as after training
    adapters.save_peft(tmp_path, lora, module_name=models.peft_module_name)

    texts = ["To be, or not to be, that is the question.", "Now is the winter of our discontent"]
    batch = models.tokenize(tokenizer, texts, max_len=24)
    ours = adapters.adapt(encoder.apply)(
        variables, lora, batch["input_ids"], batch["attention_mask"]
    )

    hf = BertModel.from_pretrained(str(models.minilm_dir()), add_pooling_layer=True).eval()
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    with torch.no_grad():
        theirs = peft_model(
            input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
            attention_mask=torch.from_numpy(batch["attention_mask"].astype(np.int64)),
        ).last_hidden_state.numpy()
    mask = batch["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(ours)[mask], theirs[mask], atol=1e-4)
    # And back: PEFT's file loads into the same adapters.
    back = adapters.load_peft(tmp_path, variables, module_path=models.flax_path_from_peft)
    for path in lora:
        np.testing.assert_array_equal(back[path].factors["a"], lora[path].factors["a"])
