"""The library's continual methods and merges take the decoder as it is (stacked, scanned layers).

`continual.sequential_lora` trains stacked LoRA factors on the scanned projections and merges
them into the stacked kernels; TIES merges two stacked LoRAs layer by layer. Tiny Llama-like
model, float32. (Every continual method on the stack against its unrolled layers:
`test_decoder_continual.py`.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, continual, merging, models
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.merging.sparsify import ties_delta
from lowrank_jax.merging.task_merges import trim_task_vectors

CONFIG = models.DecoderConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    dtype="float32",
)
TARGETS = (r"params/model/layers/.*_proj/kernel",)


@pytest.fixture(scope="module")
def decoder():
    model = models.DecoderLM(CONFIG)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))
    return model, variables


def test_sequential_lora_on_the_scanned_decoder(decoder):
    model, variables = decoder

    def last_token_logits(v, x):  # the LM as a classifier over the vocabulary
        return model.apply(v, x)[:, -1]

    method = continual.sequential_lora(
        last_token_logits, targets=TARGETS, rank=2, learning_rate=1e-2, head_path="params/lm_head"
    )
    state = method.init(variables)
    forward = jax.jit(method.apply)
    step = None
    rng = np.random.default_rng(0)
    for t in range(2):  # task t: the class is 2t + (the last token is even)
        x = rng.integers(0, 32, size=(16, 6)).astype(np.int32)
        y = (2 * t + (x[:, -1] % 2 == 0)).astype(np.int32)
        task = continual.Task(t, np.array([2 * t, 2 * t + 1]), x, y, 32)
        trainable, frozen, tx = method.begin_task(state, jax.random.key(t), task)
        shared = trainable["shared"]["params/model/layers/mlp/down_proj/kernel"]
        assert shared.factors["a"].shape == (2, 48, 2)  # stacked on the layer axis
        mask = jnp.zeros(32, bool).at[task.classes].set(True)
        if step is None:  # every task's tx is the same transformation: compile once

            @jax.jit
            def step(tr, opt_state, frozen, x, y, mask, tx=tx):
                def loss_fn(tr):
                    return continual.masked_cross_entropy(method.apply(tr, frozen, x), y, mask)

                loss, grads = jax.value_and_grad(loss_fn)(tr)
                updates, opt_state = tx.update(grads, opt_state, tr)
                return optax.apply_updates(tr, updates), opt_state, loss

        opt_state = tx.init(trainable)
        losses = []
        for _ in range(10):
            trainable, opt_state, loss = step(trainable, opt_state, frozen, x, y, mask)
            losses.append(float(loss))
        assert losses[-1] < losses[0]
        adapted = forward(trainable, frozen, x)
        state = method.end_task(state, trainable, frozen, task)
        # The consolidated model (LoRA merged into the stacked kernels) is the trained one.
        merged, _ = method.predict(state, x)
        np.testing.assert_allclose(merged, adapted, atol=1e-5, rtol=0)
    # Only the targeted kernels (and the head) changed.
    before, after = named_leaves(variables), named_leaves(state.params)
    for path, leaf in after.items():
        changed = not np.array_equal(leaf, before[path])
        assert changed == path.endswith("_proj/kernel"), path


def test_ties_merge_of_two_stacked_loras(decoder):
    model, variables = decoder
    rules = [(TARGETS[0], adapters.lora(2, alpha=4.0, in_ndim=1, out_ndim=1))]
    loras = [
        jax.tree.map(
            lambda f, k=k: f + 0.1 * jax.random.normal(jax.random.key(k), f.shape),
            adapters.init(jax.random.key(k), variables, rules),
        )
        for k in (1, 2)
    ]
    # rank None: the exact merged update; per-kernel trimming (PEFT's) ranks each layer alone.
    merged = merging.merge_ties(loras, density=0.5, trim="per_kernel")
    path = "params/model/layers/self_attn/q_proj/kernel"
    kernel = named_leaves(variables)[path]
    assert merged[path].factors["a"].shape[0] == 2  # still stacked (L, n, r)
    deltas = jnp.stack([adapters.delta(lora[path], kernel.shape) for lora in loras])  # (K, L, n, m)
    for layer in range(2):  # TIES per layer, as PEFT and mergekit trim per matrix
        expected = ties_delta(deltas[:, layer], density=0.5)
        got = adapters.delta(merged[path], kernel.shape)[layer]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    # The default (the TIES paper) trims each task vector over all its kernels and layers at once,
    # then elects signs per entry: TIES on the globally trimmed views with no further trimming.
    merged = merging.merge_ties(loras, density=0.5)
    trimmed = trim_task_vectors(loras, density=0.5)[path]  # (K, L, n, m)
    for layer in range(2):
        expected = ties_delta(trimmed[:, layer], density=1.0)
        got = adapters.delta(merged[path], kernel.shape)[layer]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    tokens = jax.random.randint(jax.random.key(3), (2, 6), 0, 32)
    factorised = adapters.adapt(model.apply)(variables, merged, tokens)
    dense = model.apply(adapters.fold(variables, merged), tokens)
    np.testing.assert_allclose(factorised, dense, atol=1e-5, rtol=0)
