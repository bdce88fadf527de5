"""A LoRA adapter trained here on the real MiniLM loads in PyTorch PEFT and gives the same outputs.

Needs the peers extra (torch 2.13.0 CPU, transformers, peft); skipped without it.
"""

import importlib.util

import jax
import numpy as np
import pytest

from lowrank_jax import adapters, models
from tests.adapters.models import perturb_torch

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
    adapters.save_peft(tmp_path, lora, module_name=models.bert_module_name)

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
    back = adapters.load_peft(tmp_path, variables, module_path=models.bert_path_from_module)
    for path in lora:
        np.testing.assert_array_equal(back[path].factors["a"], lora[path].factors["a"])


TEXTS = ["To be, or not to be, that is the question.", "Now is the winter of our discontent"]


def _hf_outputs(peft_model, batch):
    import torch

    with torch.no_grad():
        out = peft_model(
            input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
            attention_mask=torch.from_numpy(batch["attention_mask"].astype(np.int64)),
        )
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _our_outputs(encoder, variables, adapter_set, batch):
    fwd = adapters.adapt(encoder.apply)
    hidden = fwd(variables, adapter_set, batch["input_ids"], batch["attention_mask"])
    pooled = adapters.adapt(lambda v, h: encoder.apply(v, h, method="pooled_output"))(
        variables, adapter_set, hidden
    )
    return np.asarray(hidden), np.asarray(pooled)


def _max_gap(ours, theirs, mask):
    return max(
        float(np.abs(ours[0][mask] - theirs[0][mask]).max()),
        float(np.abs(ours[1] - theirs[1]).max()),
    )


def test_minilm_dora_embedding_lora_and_trained_modules_from_peft(tmp_path):
    """PEFT -> ours: DoRA on attention and MLP, LoRA on the word embeddings, bias="lora_only" and
    the pooler as a module to save, all moved away from their initial values."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertModel

    config, variables, tokenizer = models.load_minilm()
    encoder = models.BertEncoder(config)
    hf = BertModel.from_pretrained(str(models.minilm_dir()), add_pooling_layer=True)
    lora_config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["query", "value", "intermediate.dense"],
        use_dora=True,
        bias="lora_only",
        modules_to_save=["pooler.dense"],
    )
    peft_model = perturb_torch(get_peft_model(hf, lora_config), 0.02)
    peft_model.eval().save_pretrained(str(tmp_path))
    batch = models.tokenize(tokenizer, TEXTS, max_len=24)
    theirs = _hf_outputs(peft_model, batch)

    dora, trained = adapters.load_peft(
        tmp_path, variables, module_path=models.bert_path_from_module, with_trained=True
    )
    assert all(isinstance(a.kind, adapters.DoRA) for a in dora.values()) and len(dora) == 18
    ours = _our_outputs(encoder, adapters.combine(trained, variables), dora, batch)
    assert _max_gap(ours, theirs, batch["attention_mask"].astype(bool)) <= 1e-5


def test_minilm_dora_and_embedding_lora_trained_here_load_in_peft(tmp_path):
    """Ours -> PEFT: a DoRA set, and a LoRA set with embedding LoRA and trained biases."""
    from peft import PeftModel
    from transformers import BertModel

    config, variables, tokenizer = models.load_minilm()
    encoder = models.BertEncoder(config)
    batch = models.tokenize(tokenizer, TEXTS, max_len=24)
    mask = batch["attention_mask"].astype(bool)
    dora = adapters.init(
        jax.random.key(0),
        variables,
        [(r".*(attention/(query|value)|mlp/fc1)/kernel", adapters.dora(4, alpha=8.0))],
    )
    dora = jax.tree.map(lambda t: t + 0.02, dora)
    lora = adapters.init(
        jax.random.key(1),
        variables,
        [(r".*word/embedding", adapters.lora(4)), (r".*mlp/fc2/kernel", adapters.lora(4))],
    )
    lora = jax.tree.map(lambda t: t + 0.02, lora)
    trained, _ = adapters.split_trainable(variables, [r".*mlp/fc2/bias", r".*ln_mlp/bias"])
    trained = jax.tree.map(lambda t: t + 0.05, trained)
    adapters.save_peft(tmp_path / "dora", dora, module_name=models.bert_module_name)
    adapters.save_peft(
        tmp_path / "lora",
        lora,
        module_name=models.bert_module_name,
        params=variables,
        trained=trained,
    )
    for name, ours_set, base in (
        ("dora", dora, variables),
        ("lora", lora, adapters.combine(trained, variables)),
    ):
        hf = BertModel.from_pretrained(str(models.minilm_dir()), add_pooling_layer=True)
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path / name)).eval()
        theirs = _hf_outputs(peft_model, batch)
        ours = _our_outputs(encoder, base, ours_set, batch)
        assert _max_gap(ours, theirs, mask) <= 1e-5, name
