"""Fine-tuning a classifier three ways: LoRA, full fine-tuning, or the head only.

The family behind ``configs/lora_finetune.py`` (pretrained MiniLM on Shakespeare genre
classification) and ``configs/digits_mlp.py`` (an MLP on sklearn digits, the fast config the
machinery tests use). ``config.adapter.method`` picks what is trained:

* ``"lora"``: adapters on the kernels that match ``config.adapter.targets`` (full-match regexes
  over '/'-joined parameter paths) plus the classifier head; the base model is frozen and the
  adapted forward is computed factorised (``lowrank_jax.adapters.adapt``). ``config.adapter.kind``
  picks the adapter: ``"lora"`` (rank, alpha, dropout) or ``"frameft"`` (P10: ``n_coeff``
  coefficients per kernel in a fusion-frame basis, ``frame_l``, ``frame_scale``);
  ``config.optim.adapter_learning_rate`` (0: ``optim.learning_rate``) gives the adapters their
  own peak learning rate (FrameFT's coefficients want a much larger one than the head);
* ``"full"``: every parameter;
* ``"head"``: the classifier head only (``params/head/*``).

The train state is ``{"params": trainable params, "adapters": adapter factors (lora only),
"opt_state", "step"}``; the frozen parameters are passed separately and never donated. The run
reports test accuracy, the number of trained parameters and the mean step time, and writes
``config.json``, ``metrics.jsonl``, TensorBoard events, checkpoints, ``loss.png``,
``accuracy.png`` and ``results.md`` to the workdir.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common import config_checks, lowering, optimizers
from experiments.common import lora_finetune_report as report
from experiments.common.evaluation import padded_means
from lowrank_jax import adapters, data, models
from lowrank_jax.adapters.finetune import classifier_sums, make_classifier_step, trained_parts
from lowrank_jax.adapters.quant import BASE_DTYPES
from lowrank_jax.data.records import to_arrays
from lowrank_jax.data.shakespeare import GENRES

METHODS = ("lora", "full", "head")
ADAPTER_KINDS = ("lora", "frameft")
DATASETS = ("shakespeare_genre", "digits")
MODELS = ("minilm", "mlp")
# Which model reads which dataset, and which batch entries it takes as inputs.
_MODEL_DATA = {"minilm": ("shakespeare_genre",), "mlp": ("digits",)}
_INPUTS = {"minilm": ("input_ids", "attention_mask"), "mlp": ("x",)}
HEAD_PATTERN = r"params/head/.*"


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed.

    Raises:
      experiments.common.ConfigError: naming the first bad key, its value and what is allowed.
    """
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    name = c.check_choice(config, "data.name", DATASETS)
    model = c.check_choice(config, "model.name", MODELS)
    if name not in _MODEL_DATA[model]:
        raise c.ConfigError(
            f"config.data.name={name!r} does not fit config.model.name={model!r}: that model "
            f"reads {', '.join(repr(d) for d in _MODEL_DATA[model])}"
        )
    c.check_positive(config, "data.batch_size", integer=True)
    c.check_positive(config, "eval.batch_size", integer=True)
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    c.check_fraction(config, "data.test_fraction", allow_zero=False)
    if name == "shakespeare_genre":
        c.check_positive(config, "data.passage_chars", integer=True)
        c.check_positive(config, "data.max_passages_per_play", integer=True)
        if c.check_positive(config, "data.max_len", integer=True) < 2:
            raise c.ConfigError(
                f"config.data.max_len={config.data.max_len} is invalid: must be >= 2"
            )
    method = c.check_choice(config, "adapter.method", METHODS)
    base_dtype = config.model.get("base_dtype", "float32")
    if base_dtype not in BASE_DTYPES or (base_dtype != "float32" and method != "lora"):
        raise c.ConfigError(
            f"config.model.base_dtype={base_dtype!r} is invalid: must be one of "
            f"{BASE_DTYPES}, and only 'float32' unless adapter.method='lora'"
        )
    if method == "lora":
        kind = c.check_choice(config, "adapter.kind", ADAPTER_KINDS)
        if kind == "lora":
            c.check_positive(config, "adapter.rank", integer=True)
            c.check_positive(config, "adapter.alpha")
            c.check_fraction(config, "adapter.dropout")
        else:
            c.check_positive(config, "adapter.n_coeff", integer=True)
            c.check_positive(config, "adapter.frame_l", integer=True)
            c.check_positive(config, "adapter.frame_scale")
        if "adapter_learning_rate" in config.optim:  # optional: 0 = optim.learning_rate
            c.check_nonnegative(config, "optim.adapter_learning_rate")
        c.check_regexes(config, "adapter.targets")
    if model == "mlp":
        c.check_positive_ints(config, "model.features")
    c.check_choice(config, "optim.name", optimizers.OPTIMIZERS)
    c.check_positive(config, "optim.learning_rate")
    c.check_nonnegative(config, "optim.weight_decay")
    c.check_nonnegative(config, "optim.grad_clip")
    config_checks.check_warmup(config)
    c.check_nonnegative(config, "eval.every", integer=True)
    config_checks.check_fit_options(config)


# ----------------------------------------------------------------------------------------------
# Data and model.


def _load_data(
    config: Any, tokenizer: Any = None
) -> tuple[dict[str, dict[str, np.ndarray]], tuple[str, ...]]:
    """``({"train"|"valid"|"test": {input arrays..., "y"}}, class names)``; text is tokenised."""
    if config.data.name == "digits":
        dataset = data.load_digits()
    else:
        dataset = data.load_shakespeare(
            label="genre",
            plays=tuple(config.data.get("plays", ())) or None,  # optional: () = all 35 plays
            passage_chars=config.data.passage_chars,
            max_passages_per_play=config.data.max_passages_per_play,
            seed=config.seed,
        )
    splits = data.split(
        dataset,
        seed=config.seed,
        valid_fraction=config.data.valid_fraction,
        test_fraction=config.data.test_fraction,
    )
    encode = None if tokenizer is None else (
        lambda x: models.tokenize(tokenizer, list(x), max_len=config.data.max_len)
    )  # fmt: skip
    return to_arrays(splits, encode=encode), dataset.class_names


def _build_model(
    config: Any, num_classes: int, key: jax.Array, *, pretrained: Any = None, train: Any = None
) -> tuple[Any, dict[str, Any]]:
    """``(flax module, variables)``: MiniLM (``pretrained``: ``load_minilm()``'s result, loaded
    if None) with a fresh head, or a fresh MLP shaped by the ``train`` arrays' ``"x"`` (arrays or
    ``jax.ShapeDtypeStruct``)."""
    if config.model.name == "minilm":
        bert_config, encoder_variables, _ = pretrained or models.load_minilm()
        model = models.BertClassifier(bert_config, num_classes)
        return model, models.classifier_variables(key, encoder_variables, num_classes=num_classes)
    model = models.MLP(tuple(config.model.features), num_classes)
    return model, model.init(key, jnp.zeros((1, *train["x"].shape[1:]), jnp.float32))


def _model_kwargs(config: Any, *, train: bool, key: jax.Array | None) -> dict[str, Any]:
    if config.model.name == "minilm":
        kwargs: dict[str, Any] = {"deterministic": not train}
        if train:
            kwargs["rngs"] = {"dropout": key}
        return kwargs
    return {}


def _optimizer(config: Any) -> optax.GradientTransformation:
    """The (clipped) optimizer; the adapters get their own peak learning rate if one is set."""
    adapter_lr = config.optim.get("adapter_learning_rate", 0.0)
    peaks = None
    if config.adapter.method == "lora" and adapter_lr:
        peaks = {"params": config.optim.learning_rate, "adapters": adapter_lr}
    return optimizers.warmup_cosine_optimizer(config, peaks=peaks)


def _adapter_rules(config: Any) -> list[tuple[str, Any]]:
    a = config.adapter
    if a.kind == "frameft":
        spec = adapters.frameft(a.n_coeff, l=a.frame_l, scale=a.frame_scale)
    else:
        spec = adapters.lora(rank=a.rank, alpha=a.alpha, dropout=a.dropout)
    return [(t, spec) for t in a.targets]


# ----------------------------------------------------------------------------------------------
# The method: what is trained, and the forward pass that uses it.


def init_state(
    config: Any, model: Any, variables: dict[str, Any], key: jax.Array
) -> tuple[dict[str, Any], Any, Callable[..., jax.Array], optax.GradientTransformation]:
    """The train state, the frozen parameters, the forward pass and the optimizer of a method.

    Args:
      config: the experiment config (``adapter``, ``optim``, ``schedule``, ``model`` sections).
      model: the flax module whose ``apply`` computes the logits.
      variables: its (pretrained) variables ``{"params": ...}``.
      key: PRNG key for the adapter factors.

    Returns:
      ``(state, frozen, logits_fn, tx)``: ``state = {"params": trained params (``None`` where
      frozen), "adapters": adapter factors (lora only), "opt_state", "step": 0}``; ``frozen``, the
      complementary params (``None`` for ``full``); ``logits_fn(state, frozen, batch, *, train,
      key) -> (b, num_classes)`` logits; the optax transformation.
    """
    method = config.adapter.method
    if method == "full":
        trainable, frozen = variables, None
    else:
        trainable, frozen = adapters.split_trainable(variables, (HEAD_PATTERN,))
    state: dict[str, Any] = {"params": trainable}
    apply = model.apply
    if method == "lora":
        state["adapters"] = adapters.init(key, variables, _adapter_rules(config))
        apply = adapters.adapt(model.apply)
        # The frozen kernels in bfloat16 or int8 (adapters and optimizer state stay float32).
        frozen = adapters.low_precision_base(frozen, config.model.get("base_dtype", "float32"))
    tx = _optimizer(config)
    state["opt_state"] = tx.init(trained_parts(state))
    state["step"] = 0
    input_keys = _INPUTS[config.model.name]

    def logits_fn(state, frozen, batch, *, train, key):
        params = state["params"] if frozen is None else adapters.combine(state["params"], frozen)
        inputs = [batch[k] for k in input_keys]
        kwargs = _model_kwargs(config, train=train, key=key)
        if "adapters" in state:
            adapter_key = key if train and config.adapter.get("dropout", 0.0) else None
            return apply(params, state["adapters"], *inputs, adapter_key=adapter_key, **kwargs)
        return apply(params, *inputs, **kwargs)

    return state, frozen, logits_fn, tx


def make_evaluate(logits_fn: Callable[..., jax.Array], mesh: Any, *, batch_size: int):
    """``evaluate(state, frozen, arrays, prefix) -> {"<prefix>/loss", "<prefix>/accuracy"}``.

    Runs the jitted :func:`lowrank_jax.adapters.finetune.classifier_sums` over all examples of
    ``arrays`` (``(N, ...)`` host arrays with ``"y"``) in sharded batches of ``batch_size``,
    the last one padded with zero-weight rows (:func:`experiments.common.evaluation.padded_means`).
    """
    sums = jax.jit(classifier_sums(logits_fn))

    def evaluate(state, frozen, arrays, prefix):
        out = padded_means(lambda *b: sums(state, frozen, *b), arrays, batch_size, mesh=mesh)
        return {f"{prefix}/{k}": v for k, v in out.items()}

    return evaluate


# ----------------------------------------------------------------------------------------------
# The jitted steps on abstract inputs (the lowering test), and the run.

# What a batch holds, per dataset: (shape after the batch axis, dtype); "seq" is data.max_len.
_BATCH_SPECS = {
    "digits": {"x": ((8, 8, 1), jnp.float32), "y": ((), jnp.int32)},
    "shakespeare_genre": {
        "input_ids": (("seq",), jnp.int32),
        "attention_mask": (("seq",), jnp.int32),
        "y": ((), jnp.int32),
    },
}
_NUM_CLASSES = {"digits": 10, "shakespeare_genre": len(GENRES)}


def _abstract_batch(config: Any, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    def shape(dims):
        return (batch_size, *(config.data.max_len if d == "seq" else d for d in dims))

    return {
        k: jax.ShapeDtypeStruct(shape(dims), dtype)
        for k, (dims, dtype) in _BATCH_SPECS[config.data.name].items()
    }


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The run's jitted train step (as ``fit`` runs it) and evaluation, on abstract inputs.

    No data is loaded and no weight is read (MiniLM's shapes come from its ``config.json``);
    ``mesh`` (default: all devices) may be a ``jax.sharding.AbstractMesh``.
    """
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    train = _abstract_batch(config, config.data.batch_size)
    num_classes = _NUM_CLASSES[config.data.name]
    encoder = lowering.abstract_minilm() if config.model.name == "minilm" else (None, None)

    def build(key, encoder_variables):
        pretrained = (encoder[0], encoder_variables, None) if encoder[0] is not None else None
        model, variables = _build_model(
            config, num_classes, key, pretrained=pretrained, train=train
        )
        state, frozen, logits_fn, tx = init_state(config, model, variables, key)
        return (state, frozen), (logits_fn, tx)

    key = jax.random.key(0)
    (state, frozen), (logits_fn, tx) = common.eval_shape_with_static(build, key, encoder[1])
    fsdp = config.parallel.fsdp
    evaluate = common.Step(
        "eval",
        jax.jit(classifier_sums(logits_fn)),
        (
            common.placed(state, mesh, fsdp=fsdp),
            common.placed(frozen, mesh, fsdp=fsdp),
            *common.sharded_batch(
                (
                    _abstract_batch(config, config.eval.batch_size),
                    jax.ShapeDtypeStruct((config.eval.batch_size,), jnp.float32),
                ),
                mesh,
            ),
        ),
    )
    train_step = common.fit_step(
        make_classifier_step(logits_fn, tx), state, frozen, train, mesh=mesh, fsdp=fsdp
    )
    return [train_step, evaluate]


# ----------------------------------------------------------------------------------------------
# The run.


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Trains and evaluates one method; returns the final metrics.

    Returns:
      ``{"method", "test/accuracy", "test/loss", "valid/accuracy", "valid/loss",
      "trainable_params", "total_params", "step_time_s", "steps", "interrupted"}``.
    """
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    mesh = common.make_mesh()
    for path in ("data.batch_size", "eval.batch_size"):
        common.check_divisible(config, path, mesh.size, why=f"the {mesh.size} devices")
    init_key, adapter_key, train_key = jax.random.split(jax.random.key(config.seed), 3)

    pretrained = models.load_minilm() if config.model.name == "minilm" else None
    arrays, class_names = _load_data(config, pretrained[2] if pretrained else None)
    model, variables = _build_model(
        config, len(class_names), init_key, pretrained=pretrained, train=arrays["train"]
    )
    method = config.adapter.method
    if method == "lora":
        method = config.adapter.kind  # "lora" or "frameft": what the results table reports
    state, frozen, logits_fn, tx = init_state(config, model, variables, adapter_key)
    num_trained = adapters.count_params(trained_parts(state))
    num_total = adapters.count_params(variables)
    logging.info("%s: training %d of %d parameters", method, num_trained, num_total)
    evaluate = make_evaluate(logits_fn, mesh, batch_size=config.eval.batch_size)

    batches = data.BatchIterator(
        arrays["train"], batch_size=config.data.batch_size, seed=config.seed
    )
    result = common.fit(
        state,
        frozen,
        make_classifier_step(logits_fn, tx),
        batches,
        key=train_key,
        num_steps=config.schedule.num_steps,
        workdir=workdir,
        eval_fn=lambda s, f: evaluate(s, f, arrays["valid"], "valid"),
        eval_every=config.eval.every,
        mesh=mesh,
        **common.fit_options(config),
        description=f"{config.model.name}/{method}",
        options=options,
    )
    final = {
        "method": method,
        **result.last_eval,
        "trainable_params": num_trained,
        "total_params": num_total,
        "step_time_s": result.step_time_s,
        "steps": int(jax.device_get(result.state["step"])),
        "interrupted": result.interrupted,
    }
    if result.interrupted:
        return final
    final.update(evaluate(result.state, frozen, arrays["test"], "test"))
    report.write_report(config, workdir, final, result.history)
    return final
