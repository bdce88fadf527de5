"""The frozen backbones of the continual-learning experiment (``continual.py``): the model of
``config.model`` with a head over the stream's classes, a base session's pre-training, and the
pre-trained checkpoints (MiniLM's top layers, a Hugging Face ViT).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax

from experiments import common
from lowrank_jax import continual, data, models
from lowrank_jax.models.bert import BertTopClassifier, split_encoder
from lowrank_jax.models.hf_vit import load_hf_vit, vit_from_hf_config

MODELS = ("mlp", "vit", "minilm", "vit_b16")
# google/vit-base-patch16-224-in21k's config.json (the sizes that matter): the backbone's shape
# when no checkpoint is read (lowering, costing)
VIT_B16 = dict(
    model_type="vit",
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    image_size=224,
    patch_size=16,
)


def minilm_config() -> Any:
    return models.BertConfig.from_json(models.minilm_dir() / "config.json")


def make_model(config: Any, num_classes: int) -> Any:
    """The linen classifier of ``config.model`` with a ``head`` over ``num_classes``."""
    m = config.model
    if m.name == "mlp":
        return models.MLP(tuple(m.features), num_classes)
    if m.name == "vit":
        v = m.vit
        return models.ViT(v.patch, v.dim, v.depth, v.heads, v.mlp_dim, num_classes)
    if m.name == "minilm":
        return BertTopClassifier(minilm_config(), m.first_layer, num_classes)
    if m.name == "vit_b16":
        return vit_b16(config, num_classes)[0]
    raise common.ConfigError(f"config.model.name={m.name!r}: allowed values are {MODELS}")


def vit_b16(config: Any, num_classes: int) -> tuple[Any, tuple[int, int, int]]:
    """The checkpoint's ViT (with a head of ``num_classes``) and its image shape; ViT-B/16's
    sizes when ``config.model.checkpoint`` is not set (lowering and costing, no weights)."""
    checkpoint = config.model.checkpoint
    if checkpoint:
        with open(os.path.join(checkpoint, "config.json")) as f:
            hf = json.load(f)
    else:
        hf = VIT_B16
    return vit_from_hf_config(hf, num_classes=num_classes, scan_layers=config.model.scan_layers)


def pretrain_setup(config: Any, model: Any, x_shape: tuple[int, ...], key: jax.Array):
    """The base session's train state (the whole ``model`` on inputs of shape ``x_shape``) and
    its ``fit`` step."""
    variables = model.init(key, jnp.zeros((1, *x_shape)))
    clip = [optax.clip_by_global_norm(config.optim.grad_clip)] if config.optim.grad_clip else []
    tx = optax.chain(*clip, optax.scale_by_adam(), optax.scale(-config.optim.learning_rate))
    state = {"params": variables, "opt_state": tx.init(variables), "step": 0}

    def step(state, frozen, batch, key):
        del frozen, key

        def loss_fn(p):
            logits = model.apply(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss}

    return state, step


def _pretrain(
    config: Any,
    stream: continual.TaskStream,
    key: jax.Array,
    workdir: str,
    options: common.TrainOptions,
) -> Any:
    """Trains the whole model on the base session; returns its variables."""
    model = make_model(config, stream.base_classes)
    state, step = pretrain_setup(config, model, stream.base["x"].shape[1:], key)
    steps = config.model.pretrain_steps
    result = common.fit(
        state,
        None,
        step,
        data.BatchIterator(stream.base, batch_size=config.data.batch_size, seed=0),
        key=key,
        num_steps=steps,
        workdir=os.path.join(workdir, "base"),
        log_every=config.log.every,
        ckpt_every=steps,
        max_to_keep=1,
        progress=config.log.progress,
        description="base session",
        options=options,
    )
    return jax.device_get(result.state["params"])


def build_backbone(
    config: Any,
    stream: continual.TaskStream,
    seed: int,
    workdir: str,
    *,
    options: common.TrainOptions,
) -> tuple[Any, Any]:
    """``(model, variables)``: the backbone with a fresh head over all classes of the stream.

    With a base session (``stream.base``) the whole model is first trained on it (``common.fit``
    with ``options``); its body is
    kept, and its head rows too when ``stream.keep_base_head``. The MiniLM model starts from the
    pretrained top layers.
    """
    key = jax.random.key(seed)
    k_init, k_pre = jax.random.split(key)
    model = make_model(config, stream.num_classes)
    if config.model.name == "vit_b16":  # the pre-trained checkpoint with a fresh head
        checkpoint, scan = config.model.checkpoint, config.model.scan_layers
        model, variables = load_hf_vit(
            checkpoint, num_classes=stream.num_classes, key=k_init, scan_layers=scan
        )
        return model, jax.device_get(variables)
    x0 = jnp.zeros((1, *stream.tasks[0]["train"]["x"].shape[1:]))
    variables = model.init(k_init, x0)
    if config.model.name == "minilm":
        bert_config, encoder_vars, _ = models.load_minilm()
        _, _, top = split_encoder(bert_config, encoder_vars, config.model.first_layer)
        variables = {"params": {**variables["params"], **top}}
    if stream.base is not None and config.model.pretrain_steps:
        pre = _pretrain(config, stream, k_pre, workdir, options)["params"]
        body = {k: v for k, v in pre.items() if k != "head"}
        params = {**variables["params"], **body}
        if stream.keep_base_head:
            rows = stream.base_classes
            head = params["head"]
            params["head"] = {
                "kernel": head["kernel"].at[:, :rows].set(pre["head"]["kernel"]),
                "bias": head["bias"].at[:rows].set(pre["head"]["bias"]),
            }
        variables = {"params": params}
    return model, jax.device_get(variables)
