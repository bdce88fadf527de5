"""Accelerator readiness without an accelerator: every config's jitted steps, and the library
calls the README shows under ``jit``, lower for TPU and GPU with ``jax.export`` on an 8-device
mesh (``experiments/common/lowering.py``): no host callback, no float64, shardings kept.

The mesh is a ``jax.sharding.AbstractMesh``: the exported modules are for 8 devices
(``nr_devices == 8`` where the program is sharded), and no device, fake or real, is needed.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import common, lora_finetune, train
from experiments.common import lowering
from lowrank_jax import adapters, continual, fp8, models

MESH = lowering.abstract_mesh(8)
EXTRA = (  # variants whose programs differ from the plain :smoke ones
    "configs/frameft.py:smoke,minilm",
    "configs/digits_mlp.py:smoke,method=lora",
    "configs/lora_finetune.py:smoke,method=full",  # with FSDP: sharded parameters, below
    "configs/tpv.py:smoke,parts=pruning_cnn",
    "configs/multidim_tuning.py:smoke,parts=fused",
    "configs/tfft.py:smoke,stage2=resample",
    "configs/llm_sft.py:smoke,method=frameft",
    "configs/llm_sft.py:smoke,method=sbvi",  # the SBVI optimizer's update in the step
    # the pre-trained-ViT benchmarks at paper scale (ViT-B/16, 224x224, batch 128 over the
    # v5e-8-shaped mesh; no checkpoint: ViT-B/16's shapes), every continual method
    "configs/saber.py:benchmark=imagenet_r_10,method=every",
    "configs/llm_sft.py:smoke,fp8",  # P14's scales from the adapted W_Q, W_K; FP8 logits
    # the continual methods' first-task steps on the decoder (penalties, projections, magnitudes)
    *(f"configs/llm_sft.py:smoke,continual={m}" for m in ("saber", "gr_lora", "o_lora")),
    *(f"configs/llm_sft.py:smoke,continual={m}" for m in ("inflora", "sd_lora", "sequential")),
)
CONFIGS = [f"{path}:smoke" for path, _ in train.available_configs()] + list(EXTRA)


def _config(spec: str):
    path, _, arg = spec.partition(":")
    name = path.removeprefix("configs/").removesuffix(".py")
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    if spec == "configs/lora_finetune.py:smoke,method=full":
        config.parallel.fsdp = True  # parameters sharded too: their shardings must survive
    return config


def _config_steps(spec: str) -> list[lowering.Step]:
    config = _config(spec)
    return train.load_experiment(config).steps(config, MESH)


# ----------------------------------------------------------------------------------------------
# The library calls of the README's examples, jitted as a user's step would be.


def _spec(shape, dtype=jnp.float32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _readme_adapters() -> list[lowering.Step]:
    """README "Adapters": LoRA on MiniLM's query/value kernels, the factorised forward and its
    adapter gradients, the batch split over 8 devices."""
    config, variables = lowering.abstract_minilm()
    encoder = models.BertEncoder(config)
    rules = [(r".*attention/(query|value)/kernel", adapters.lora(rank=8, alpha=16.0)), (r".*", None)]  # fmt: skip
    lora = jax.eval_shape(lambda v: adapters.init(jax.random.key(0), v, rules), variables)
    forward = adapters.adapt(encoder.apply)
    batch = NamedSharding(MESH, P("data"))
    ids = _spec((16, 16), jnp.int32, batch)
    rep = NamedSharding(MESH, P())
    args = (lowering.abstract(variables, rep), lowering.abstract(lora, rep), ids, ids)

    def grads(variables, lora, ids, mask):
        return jax.grad(lambda ad: forward(variables, ad, ids, mask).sum())(lora)

    return [
        lowering.Step("adapted forward", jax.jit(forward), args),
        lowering.Step("adapter grads", jax.jit(grads), args),
    ]


def _readme_fp8() -> list[lowering.Step]:
    """README "FP8 attention scales": ``policy.scales`` and ``policy.observe`` inside a jitted
    step, for the geometry and the delayed policies."""
    layers, d, h, dh = 2, 64, 4, 16
    w_q, w_k, gains = _spec((layers, d, h, dh)), _spec((layers, d, h, dh)), _spec((layers,))
    out = []
    for name, policy in (
        ("geometry", fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=2048))),
        ("delayed", fp8.delayed_scaling_policy()),
    ):
        pstate = jax.eval_shape(lambda q, k, g, p=policy: p.init(jax.random.key(0), q, k, g), w_q, w_k, gains)  # fmt: skip

        def step(pstate, w_q, w_k, gains, amax, policy=policy):
            scales, pstate = policy.scales(pstate, w_q, w_k, gains)
            return scales, policy.observe(pstate, amax)

        args = (pstate, w_q, w_k, gains, _spec((layers, h)))
        out.append(lowering.Step(f"{name} scales+observe", jax.jit(step), args))
    return out


def _readme_continual() -> list[lowering.Step]:
    """README "Continual learning": a user's step on ``method.apply`` + ``method.loss`` of SABER."""
    model = models.MLP((32, 32), 10)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 16)))
    method = continual.saber(model.apply, targets=(r"params/dense_\d+/kernel",), rank=4, learning_rate=3e-3)  # fmt: skip
    x = np.zeros((8, 16), np.float32)
    task = continual.Task(0, np.arange(2), x, np.zeros(8, np.int32), 10)

    def begin(v):
        trainable, frozen, tx = method.begin_task(method.init(v), jax.random.key(0), task)
        return (trainable, frozen, tx.init(trainable)), tx

    (trainable, frozen, opt_state), tx = common.eval_shape_with_static(begin, variables)

    def step(trainable, opt_state, frozen, x, y, mask, key):
        def loss_fn(tr):
            logits = method.apply(tr, frozen, x)
            ce = continual.masked_cross_entropy(logits, y, mask)
            return ce + method.loss(tr, frozen, {"x": x, "y": y, "mask": mask}, key)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    batch = NamedSharding(MESH, P("data"))
    args = (trainable, opt_state, frozen, _spec((64, 16), sharding=batch),
            _spec((64,), jnp.int32, batch), _spec((64, 10), jnp.bool_, batch),
            jax.eval_shape(lambda: jax.random.key(0)))  # fmt: skip
    return [lowering.Step("saber user step", jax.jit(step), args)]


README = {
    "README adapters": _readme_adapters,
    "README fp8": _readme_fp8,
    "README continual": _readme_continual,
}


@pytest.mark.parametrize("case", CONFIGS + list(README))
def test_steps_lower_for_tpu_and_gpu(case):
    steps = README[case]() if case in README else _config_steps(case)
    assert steps, f"{case}: no jitted step to lower"
    problems = [
        f"{case} step {step.name!r}: {problem}"
        for step in steps
        for problem in lowering.lower_and_check(step, mesh=MESH)
    ]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------------------
# The check itself, and the abstract inputs against the real ones.


def test_the_check_names_callbacks_float64_and_lost_shardings():
    x = _spec((8, 4))

    def with_callback(x):
        y = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)  # fmt: skip
        return y + 1

    [problem] = lowering.lower_and_check(lowering.Step("cb", jax.jit(with_callback), (x,)))
    assert problem.startswith("host callback pure_callback at ") and "test_lowering.py" in problem

    with jax.enable_x64(True):
        wide = lowering.Step("f64", jax.jit(lambda x: (x.astype(jnp.float64) ** 2).astype(x.dtype)), (x,))  # fmt: skip
        problems = lowering.lower_and_check(wide)
    assert problems and all(p.startswith("float64 value: ") for p in problems)
    assert "test_lowering.py" in problems[0]
    with jax.enable_x64(True):
        assert lowering.lower_and_check(wide, allow_float64=True) == []

    split = _spec((8, 4), sharding=NamedSharding(MESH, P("data")))
    kept = lowering.Step("kept", jax.jit(lambda x: x * 2), (split,))
    assert lowering.lower_and_check(kept, mesh=MESH) == []
    replicated = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(MESH, P()))
    exported = lowering.export_step(lowering.Step("r", replicated, (_spec((8, 4)),)))
    [lost] = lowering.check_exported(exported, kept, mesh=MESH)
    assert (
        lost.startswith("lost sharding: input ") and "was P('data', None), is P(None, None)" in lost
    )


def test_steps_of_digits_match_the_run():
    """The abstract state and batch of ``digits_mlp:smoke,method=lora`` are the run's."""
    config = _config("configs/digits_mlp.py:smoke,method=lora")
    config.parallel.fsdp = True  # (too small to shard: replicated all the same)
    train_step = lora_finetune.steps(config, MESH)[0]
    arrays, classes = lora_finetune._load_data(config)
    model, variables = lora_finetune._build_model(
        config, len(classes), jax.random.key(0), train=arrays["train"]
    )
    state, frozen, _, _ = lora_finetune.init_state(config, model, variables, jax.random.key(1))
    batch = next(iter(common.MapBatches(_batches(arrays, config), lambda b: b)))
    real = ({**state, "step": jnp.int32(0)}, frozen, jax.tree.map(jnp.asarray, batch))
    shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), t)  # noqa: E731
    assert shapes(train_step.args[:3]) == shapes(real)


def _batches(arrays, config):
    from lowrank_jax import data

    return data.BatchIterator(arrays["train"], batch_size=config.data.batch_size, seed=0)


def test_abstract_minilm_matches_the_loaded_weights():
    config, variables = lowering.abstract_minilm()
    loaded_config, loaded, _ = models.load_minilm()
    assert config == loaded_config
    shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), t)  # noqa: E731
    assert shapes(variables) == shapes(loaded)
