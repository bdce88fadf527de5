"""Every continual method on the scanned decoder equals the same run on its unrolled layers.

`DecoderLM` runs its layers under `nn.scan` with kernels stacked `(L, n, m)`;
`DecoderConfig(scan_layers=False)` is the same function with L separate 2-D kernels
`layers_{i}/...`. A method must treat the stack as L separate kernels: per-layer memories,
projections, SVDs, norms and statistics, and layer inputs recorded inside the scanned body. Each
method learns two tasks on both layouts, from the same LoRA initialisation (the unrolled run's
factors are drawn as the stack's and sliced, since `adapters.init` draws per path); the
consolidated kernels, head, last task's update and trainable factors, memories and test logits
must agree to float32 rounding. Tiny Llama-like model, float32.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import continual, models
from lowrank_jax.adapters.paths import get_path, named_leaves
from lowrank_jax.continual import _src
from lowrank_jax.continual.protocol import kernel_paths
from lowrank_jax.models.decoder import init_cache
from lowrank_jax.optim.orthogonal_projection import is_memory

L = 2
CONFIG = models.DecoderConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    dtype="float32",
)
STACKED = (r"params/model/layers/.*_proj/kernel",)
UNROLLED = (r"params/model/layers_\d+/.*_proj/kernel",)
SCANNED_LM = models.DecoderLM(CONFIG)
UNROLLED_LM = models.DecoderLM(dataclasses.replace(CONFIG, scan_layers=False))


def scanned_logits(variables, x):  # the LM as a classifier over the vocabulary
    return SCANNED_LM.apply(variables, x)[:, -1]


def unrolled_logits(variables, x):
    return UNROLLED_LM.apply(variables, x)[:, -1]


def unstack_variables(variables):
    model = dict(variables["params"]["model"])
    stack = model.pop("layers")
    for i in range(L):
        model[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stack)
    return {"params": {**variables["params"], "model": model}}


def restack_variables(variables):
    model = dict(variables["params"]["model"])
    layers = [model.pop(f"layers_{i}") for i in range(L)]
    model["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return {"params": {**variables["params"], "model": model}}


def restack(tree, axis=0):
    """``{".../layers_i/...": v_i}`` mappings (at any depth) as ``{".../layers/...": stack}``."""
    if isinstance(tree, dict) and any("/layers_" in k for k in tree):
        groups = {}
        for k, v in tree.items():
            i = int(re.search(r"/layers_(\d+)/", k).group(1))
            groups.setdefault(re.sub(r"/layers_\d+/", "/layers/", k), {})[i] = v
        return {
            k: jax.tree.map(lambda *a: jnp.stack(a, axis), *(g[i] for i in range(L)))
            for k, g in groups.items()
        }
    if isinstance(tree, dict):
        return {k: restack(v, axis) for k, v in tree.items()}
    return tree


def same_init_as_the_stack(real_lora_set):
    """`lora_set` for the unrolled model that draws the factors as the scanned model's does."""

    def lora_set(key, variables, targets, rank, **kwargs):
        assert tuple(targets) == UNROLLED
        stacked = real_lora_set(key, restack_variables(variables), STACKED, rank, **kwargs)
        return {
            path.replace("/layers/", f"/layers_{i}/"): jax.tree.map(lambda f, i=i: f[i], ad)
            for path, ad in stacked.items()
            for i in range(L)
        }

    return lora_set


@pytest.fixture(scope="module")
def variables():
    return jax.jit(SCANNED_LM.init)(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))


def tasks():
    rng = np.random.default_rng(0)
    out = []
    for t in range(2):  # task t: the class is 2t + (the last token is even)
        x = rng.integers(0, 32, size=(16, 6)).astype(np.int32)
        y = (2 * t + (x[:, -1] % 2 == 0)).astype(np.int32)
        out.append(continual.Task(t, np.array([2 * t, 2 * t + 1]), x, y, 32))
    return out


def learn(method, variables, steps=3):
    """Two tasks with a jitted Adam loop; returns the state and the last task's trainable."""
    state = method.init(variables)
    for task in tasks():
        trainable, frozen, tx = method.begin_task(state, jax.random.key(task.index), task)
        mask = jnp.zeros(32, bool).at[task.classes].set(True)

        @jax.jit
        def step(tr, opt_state, frozen, key, x, y, mask, tx=tx):
            def loss_fn(tr):
                ce = continual.masked_cross_entropy(method.apply(tr, frozen, x), y, mask)
                return ce + method.loss(tr, frozen, {"x": x, "y": y}, key)

            grads = jax.grad(loss_fn)(tr)
            updates, opt_state = tx.update(grads, opt_state, tr)
            return optax.apply_updates(tr, updates), opt_state

        opt_state = tx.init(trainable)
        for s in range(steps):
            key = jax.random.key(100 + s)
            trainable, opt_state = step(trainable, opt_state, frozen, key, task.x, task.y, mask)
        state = method.end_task(state, trainable, frozen, task)
    return state, trainable


def projectors(memory):
    """``{kernel path: (MMᵀ, size)}`` of a memory tree (``{}`` for a method without one)."""
    return {
        k: (jnp.einsum("...nk,...mk->...nm", m.basis, m.basis), m.size)
        for k, m in named_leaves(memory, is_leaf=is_memory).items()
        if m is not None
    }


METHODS = {
    "sequential_lora": (continual.sequential_lora, {}),
    "o_lora": (continual.o_lora, {}),
    "inflora": (continual.inflora, {"memory_threshold": 0.9}),
    "gpm_lora": (continual.gpm_lora, {"memory_threshold": 0.9}),
    "sd_lora": (continual.sd_lora, {}),
    # λ_align = 0: the shared A starts inside U_s, so the alignment gradient is rounding noise,
    # which Adam scales to ±lr (the penalty is compared on its own below)
    "saber": (
        continual.saber,
        {"recalibrate_steps": 3, "recalibrate_batch": 8, "lambda_align": 0.0},
    ),
    # token inputs: no Gaussian OOD inputs (the entropy rule still picks the module)
    "gr_lora": (continual.gr_lora, {"lambda_local": 0.0, "lambda_global": 0.0}),
}


def test_unrolled_layers_are_the_same_function(variables):
    x = jax.random.randint(jax.random.key(1), (3, 6), 0, 32)
    flat = unstack_variables(variables)
    np.testing.assert_allclose(
        unrolled_logits(flat, x), scanned_logits(variables, x), atol=1e-5, rtol=0
    )
    # ... with a KV cache too (the unrolled layers' caches stacked as the scan's)
    cache = init_cache(CONFIG, 3, 8)
    got, got_cache = UNROLLED_LM.apply(flat, x, cache=cache)
    want, want_cache = SCANNED_LM.apply(variables, x, cache=cache)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_cache.k, want_cache.k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_cache.v, want_cache.v, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="stacked layout"):  # the HF layout is the stack's
        models.save_hf_decoder("unused", UNROLLED_LM.config, flat)
    # Layer inputs recorded inside the scan (probe cotangents) == per-layer linen interception.
    stacked_paths = kernel_paths(variables, STACKED)
    _, inside = jax.jit(lambda v, x: continual.layer_inputs(scanned_logits, stacked_paths, v, x))(
        variables, x
    )
    _, per_layer = continual.layer_inputs(
        unrolled_logits, kernel_paths(flat, UNROLLED), flat, x, capture="linen"
    )
    got = restack(per_layer)
    assert set(got) == set(inside)
    for path, value in inside.items():
        assert value.shape == (L, 3 * 6, got[path].shape[-1])
        np.testing.assert_allclose(value, got[path], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="nn.scan"):
        continual.layer_inputs(scanned_logits, stacked_paths, variables, x, capture="linen")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_on_the_stack_equals_it_on_unrolled_layers(name, variables, monkeypatch):
    factory, kwargs = METHODS[name]
    common = dict(rank=2, learning_rate=1e-2, head_path="params/lm_head", **kwargs)
    method = factory(scanned_logits, targets=STACKED, **common)
    scanned, trained = learn(method, variables)
    monkeypatch.setattr(_src, "lora_set", same_init_as_the_stack(_src.lora_set))
    method_u = factory(unrolled_logits, targets=UNROLLED, **common)
    unrolled, trained_u = learn(method_u, unstack_variables(variables))

    def close(got, want, atol=1e-5):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=atol, rtol=0), got, want)

    close(restack_variables(unrolled.params), scanned.params)
    close(unrolled.head, scanned.head)
    close(restack(unrolled.update), scanned.update)
    got = restack({k: v for k, v in trained_u.items() if k != "alpha"})
    if "alpha" in trained_u:  # SD-LoRA's magnitudes: (T,) per layer, (T, L) on the stack
        got["alpha"] = restack(trained_u["alpha"], axis=1)
    # (GPM's last columns come from small singular values: 1e-7 input noise moves them ~1e-5,
    # and the last task's factors, trained in the projected subspace, by 1.4e-5 on one host)
    close(got, trained, atol=1e-4 if name == "gpm_lora" else 1e-5)  # last task's factors, head
    close(restack(projectors(unrolled.memory)), projectors(scanned.memory), atol=1e-4)
    if scanned.memory is not None:  # filled per layer: one size per layer
        q_proj = get_path(scanned.memory, "params/model/layers/self_attn/q_proj/kernel")
        sizes = np.asarray(q_proj.size)
        assert sizes.shape == (L,) and (sizes > 0).all()
    if name == "saber":
        close(restack(unrolled.extra.weights), scanned.extra.weights)  # (L, T): per layer
        aligned = {**common, "lambda_align": 1.0}  # ‖(I − U_sU_sᵀ)A‖² summed over the layers
        penalty = factory(scanned_logits, targets=STACKED, **aligned).loss(
            trained, {"shared_mem": scanned.memory}, None, None
        )
        penalty_u = factory(unrolled_logits, targets=UNROLLED, **aligned).loss(
            trained_u, {"shared_mem": unrolled.memory}, None, None
        )
        assert penalty > 1e-6
        np.testing.assert_allclose(penalty_u, penalty, rtol=1e-4)
    x = tasks()[1].x
    for task_id in (None, 1):
        got, picked_u = method_u.predict(unrolled, x, task_id)
        want, picked = method.predict(scanned, x, task_id)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(picked_u, picked)  # GR-LoRA's module choice (else None)


def test_capture_inside_the_scan_lowers_for_tpu_and_gpu():
    # bfloat16 compute under remat: no host callback, no float64 (as test_lowering checks steps)
    config = dataclasses.replace(CONFIG, dtype="bfloat16", remat_policy="nothing_saveable")
    model = models.DecoderLM(config)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 6), jnp.int32))
    paths = kernel_paths(variables, STACKED)

    def capture(v, x):
        return continual.layer_inputs(lambda v, x: model.apply(v, x)[:, -1], paths, v, x)[1]

    tokens = jax.ShapeDtypeStruct((4, 6), jnp.int32)
    exported = jax.export.export(jax.jit(capture), platforms=("tpu", "cuda"))(variables, tokens)
    text = exported.mlir_module()
    assert "callback" not in text.lower() and "f64" not in text
    shapes = {a.shape for a in exported.out_avals}
    assert shapes == {(L, 24, 32), (L, 24, 48)}  # (L, b·t, n) per stacked kernel
