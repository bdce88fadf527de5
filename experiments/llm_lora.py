"""LoRA and QLoRA on a small Llama-family decoder pretrained here (``configs/llm_lora.py``).

1. **Pretrain** (or resume) a byte-level ``DecoderLM`` on the passages of
   ``config.data.pretrain_genres`` through ``common.fit`` in ``<workdir>/pretrain``; write it as a
   Hugging Face checkpoint (``models.save_hf_decoder``) to ``<workdir>/pretrained_hf`` and read it
   back with ``models.load_hf_decoder``: the fine-tunes start from the loaded checkpoint, as they
   would from a downloaded Llama.
2. **Fine-tune** on ``config.data.finetune_genre`` (never seen in pretraining): for each frozen
   base in ``config.finetune.methods`` (``"float32"``: LoRA, ``"nf4"``: QLoRA, also
   ``"bfloat16"``/``"int8"``) and each learning rate of ``config.finetune.learning_rates`` (the
   same budget for every method), one ``common.fit`` run in
   ``<workdir>/finetune/<base>_lr<rate>``: state ``{"adapters", "opt_state", "step"}``, the frozen
   base passed apart (``adapters.low_precision_base``), LoRA factors stacked on the layer axis
   (``adapters.lora(..., in_ndim=1, out_ndim=1)``) and applied factorised inside ``nn.scan``.
   The rate with the lowest validation perplexity is chosen; test perplexity is reported for it.
3. **Report**: perplexity per byte of the held-out genre's test passages before (the pretrained
   model on each base) and after, the bytes of each base, greedy samples before and after, in
   ``results.md``, ``results.json``, ``samples.md`` and ``finetune_loss.png``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common.llm_lora_report import sample, write_report
from lowrank_jax import adapters, data, models
from lowrank_jax.adapters.quant import BASE_DTYPES
from lowrank_jax.models.decoder_config import RopeConfig

VOCAB = 256  # bytes
KERNELS = r".*_proj/kernel"


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for genre in (*config.data.pretrain_genres, config.data.finetune_genre):
        if genre not in data.shakespeare.GENRES:
            raise c.ConfigError(f"genre {genre!r} is invalid: use one of {data.shakespeare.GENRES}")
    if config.data.finetune_genre in config.data.pretrain_genres or not config.data.pretrain_genres:
        raise c.ConfigError(
            "config.data.finetune_genre must be held out: not one of data.pretrain_genres "
            f"{tuple(config.data.pretrain_genres)} (which must not be empty)"
        )
    for path in (  # noqa: SIM905
        "data.passage_chars data.max_passages_per_play data.batch_size data.finetune_examples "
        "model.hidden_size model.intermediate_size model.num_hidden_layers "
        "model.num_attention_heads model.num_key_value_heads model.pretrain_steps adapter.rank "
        "adapter.nf4_block_size schedule.num_steps eval.batch_size eval.sample_prompt_chars "
        "eval.sample_tokens eval.num_samples ckpt.every ckpt.max_to_keep log.every"
    ).split():
        c.check_positive(config, path, integer=True)
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    c.check_fraction(config, "data.test_fraction", allow_zero=False)
    c.check_positive(config, "model.pretrain_learning_rate")
    c.check_positive(config, "adapter.alpha")
    c.check_regexes(config, "adapter.targets")
    for base in (*config.finetune.methods, *config.finetune.bases):
        if base not in BASE_DTYPES:
            raise c.ConfigError(f"base {base!r} is invalid: use one of {BASE_DTYPES}")
    if not config.finetune.methods or not config.finetune.learning_rates:
        raise c.ConfigError("config.finetune.methods and .learning_rates must not be empty")
    if any(not lr > 0 for lr in config.finetune.learning_rates):
        raise c.ConfigError("config.finetune.learning_rates must be positive")
    if config.eval.sample_prompt_chars >= config.data.passage_chars:
        raise c.ConfigError("config.eval.sample_prompt_chars must be < data.passage_chars")
    c.check_nonnegative(config, "optim.weight_decay")
    c.check_nonnegative(config, "optim.grad_clip")
    warmup = c.check_nonnegative(config, "schedule.warmup_steps", integer=True)
    if warmup >= config.schedule.num_steps:
        raise c.ConfigError("config.schedule.warmup_steps must be < schedule.num_steps")
    model_config(config)  # DecoderConfig's own checks (heads divide, ...)


# ----------------------------------------------------------------------------------------------
# Data and model.


def encode(texts: Any, length: int) -> np.ndarray:
    """UTF-8 bytes of each text, cut to ``length``: ``(N, length)`` int32 token ids < 256."""
    rows = [np.frombuffer(t.encode("utf-8")[:length], np.uint8) for t in texts]
    return np.stack([r for r in rows if len(r) == length]).astype(np.int32)


def load_text(config: Any) -> dict[str, dict[str, np.ndarray]]:
    """``{"pretrain/train", "pretrain/valid", "finetune/train", "finetune/valid",
    "finetune/test"}``, each ``{"tokens": (N, passage_chars)}``; splits stratified by play."""
    d = config.data
    out = {}
    for stage, genres in (("pretrain", d.pretrain_genres), ("finetune", (d.finetune_genre,))):
        plays = [p for p, (g, _) in data.shakespeare.PLAYS.items() if g in genres]
        ds = data.load_shakespeare(
            label="play",
            plays=plays,
            passage_chars=d.passage_chars,
            max_passages_per_play=d.max_passages_per_play,
            seed=config.seed,
        )
        test = d.test_fraction if stage == "finetune" else 0.0
        parts = data.split(
            ds, seed=config.seed, valid_fraction=d.valid_fraction, test_fraction=test
        )
        for part in ("train", "valid") + (("test",) if test else ()):
            tokens = encode(getattr(parts, part).x, d.passage_chars)
            if stage == "finetune" and part == "train":
                tokens = tokens[: d.finetune_examples]
            out[f"{stage}/{part}"] = {"tokens": tokens}
    return out


def model_config(config: Any) -> models.DecoderConfig:
    m = config.model
    return models.DecoderConfig(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=config.data.passage_chars,
        dtype=m.dtype,
        remat_policy=m.remat_policy or None,
    )


def _optimizer(config: Any, peak: float, steps: int, warmup: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, end_value=0.0)
    tx = optax.adamw(schedule, weight_decay=config.optim.weight_decay)
    if config.optim.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), tx)
    return tx


def next_byte_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``(b, t-1)`` negative log-likelihood of each next byte; ``logits`` of ``tokens[:, :-1]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def make_evaluate(forward: Any, mesh: Any, *, batch_size: int):
    """``evaluate(trained, frozen, arrays, prefix) -> {"<prefix>/nll", "<prefix>/ppl"}`` per byte,
    where ``forward(trained, frozen, inputs) -> logits``."""

    @jax.jit
    def sums(trained, frozen, tokens, weight):
        nll = next_byte_nll(forward(trained, frozen, tokens[:, :-1]), tokens)
        return jnp.sum(jnp.sum(nll, axis=1) * weight), jnp.sum(weight) * nll.shape[1]

    def evaluate(trained, frozen, arrays, prefix):
        total = count = 0.0
        rows = {"tokens": arrays["tokens"], "y": np.zeros(len(arrays["tokens"]))}
        for chunk, weight in common.padded_batches(rows, batch_size):
            s, n = sums(trained, frozen, *common.shard_batch(mesh, (chunk["tokens"], weight)))
            total, count = total + float(s), count + float(n)
        return {f"{prefix}/nll": total / count, f"{prefix}/ppl": math.exp(total / count)}

    return evaluate


def make_step(forward: Any, tx: optax.GradientTransformation, key: str):
    """``step(state, frozen, batch, rng)`` for ``fit``, training ``state[key]`` on next bytes."""

    def step(state, frozen, batch, rng):
        del rng

        def loss_fn(trained):
            tokens = batch["tokens"]
            return jnp.mean(next_byte_nll(forward(trained, frozen, tokens[:, :-1]), tokens))

        loss, grads = jax.value_and_grad(loss_fn)(state[key])
        updates, opt_state = tx.update(grads, state["opt_state"], state[key])
        new = optax.apply_updates(state[key], updates)
        return {**state, key: new, "opt_state": opt_state}, {"loss": loss}

    return step


# ----------------------------------------------------------------------------------------------
# The two stages.


def pretrain(
    config: Any, texts: dict, workdir: str, mesh: Any, *, options: common.TrainOptions
) -> tuple[Any, dict[str, float]]:
    """Pretrains (or resumes) the decoder, saves and reloads it as an HF checkpoint.

    Returns:
      ``(variables loaded from <workdir>/pretrained_hf, {"pretrain/valid/ppl", ...})``.
    """
    mc = model_config(config)
    model = models.DecoderLM(mc)
    steps = config.model.pretrain_steps
    tx = _optimizer(config, config.model.pretrain_learning_rate, steps, max(1, steps // 10))
    variables = jax.jit(model.init)(jax.random.key(config.seed), jnp.zeros((1, 8), jnp.int32))
    forward = lambda params, _, tokens: model.apply(params, tokens)  # noqa: E731
    evaluate = make_evaluate(forward, mesh, batch_size=config.eval.batch_size)
    result = common.fit(
        {"params": variables, "opt_state": tx.init(variables), "step": 0},
        None,
        make_step(forward, tx, "params"),
        data.BatchIterator(
            texts["pretrain/train"], batch_size=config.data.batch_size, seed=config.seed
        ),  # fmt: skip
        key=jax.random.key(config.seed + 1),
        num_steps=steps,
        workdir=os.path.join(workdir, "pretrain"),
        eval_fn=lambda s, f: evaluate(s["params"], f, texts["pretrain/valid"], "pretrain/valid"),
        mesh=mesh,
        **common.fit_options(config),
        description="pretrain",
        options=options,
    )
    if result.interrupted:
        return None, {}
    hf_dir = os.path.join(workdir, "pretrained_hf")
    models.save_hf_decoder(hf_dir, mc, jax.device_get(result.state["params"]))
    # replicated on the mesh: with several processes, the first device is not every process's
    _, loaded = models.load_hf_decoder(hf_dir, config=mc, shardings=common.replicated(mesh))
    return loaded, {**result.last_eval, "pretrain/step_time_s": result.step_time_s}


def lora_rules(config: Any) -> list[tuple[str, Any]]:
    a = config.adapter
    spec = adapters.lora(a.rank, alpha=a.alpha, in_ndim=1, out_ndim=1)  # (L, n, m): stacked
    return [(t, spec) for t in a.targets]


def frozen_base(config: Any, variables: Any, base: str) -> Any:
    """The pretrained variables with every projection kernel stored as ``base``."""
    return adapters.low_precision_base(
        variables, base, patterns=(KERNELS,), block_size=config.adapter.nf4_block_size
    )


def lora_forward(config: Any) -> Any:
    """``forward(lora, frozen, tokens) -> logits``: the adapted decoder, LoRA applied factorised."""
    adapted = adapters.adapt(models.DecoderLM(model_config(config)).apply)
    return lambda lora, frozen, tokens: adapted(frozen, lora, tokens)


def finetune(
    config: Any,
    base: str,
    lr: float,
    variables: Any,
    frozen: Any,
    texts: dict,
    workdir: str,
    mesh: Any,
    evaluate: Any,
    *,
    options: common.TrainOptions,
) -> dict[str, Any]:
    """One fine-tuning cell: LoRA on ``frozen`` (``variables`` stored as ``base``) at peak rate
    ``lr``; ``evaluate`` is ``make_evaluate(lora_forward(config), ...)``, shared by the cells so
    that its program is compiled once per base.
    """
    lora = adapters.init(jax.random.key(config.seed + 2), variables, lora_rules(config))
    s = config.schedule
    tx = _optimizer(config, lr, s.num_steps, s.warmup_steps)
    name = f"{base}_lr{lr:g}"
    result = common.fit(
        {"adapters": lora, "opt_state": tx.init(lora), "step": 0},
        frozen,
        make_step(lora_forward(config), tx, "adapters"),
        data.BatchIterator(
            texts["finetune/train"], batch_size=config.data.batch_size, seed=config.seed
        ),  # fmt: skip
        key=jax.random.key(config.seed + 3),
        num_steps=s.num_steps,
        workdir=os.path.join(workdir, "finetune", name),
        eval_fn=lambda st, f: evaluate(st["adapters"], f, texts["finetune/valid"], "valid"),
        eval_every=config.eval.every,
        mesh=mesh,
        **common.fit_options(config),
        description=f"finetune {name}",
        options=options,
    )
    out = {"base": base, "lr": lr, "interrupted": result.interrupted, "history": result.history}
    if not result.interrupted:
        out.update(result.last_eval)
        out["step_time_s"] = result.step_time_s
        out["adapters"] = jax.device_get(result.state["adapters"])
    return out


# ----------------------------------------------------------------------------------------------
# The run.


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Pretrains, fine-tunes every (method, learning rate) cell and writes the report.

    Returns:
      ``{"pretrain/valid/ppl", "methods": {base: {"lr", "valid/ppl", "test/ppl_before",
      "test/ppl_after", "base_bytes", ...}}, "base_bytes": {...}, "interrupted"}``.
    """
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    workdir = os.fspath(workdir)
    mesh = common.make_mesh()
    for path in ("data.batch_size", "eval.batch_size"):
        common.check_divisible(config, path, mesh.size, why=f"the {mesh.size} devices")
    texts = load_text(config)
    variables, pre = pretrain(config, texts, workdir, mesh, options=options)
    if variables is None:
        return {"interrupted": True}

    model = models.DecoderLM(model_config(config))
    evaluate = make_evaluate(lora_forward(config), mesh, batch_size=config.eval.batch_size)

    def on_mesh(tree):  # as fit places parameters: evaluate's batches are on the mesh
        shardings = common.param_sharding(mesh, tree, fsdp=config.parallel.fsdp)
        return common.sharding.put_global(tree, shardings)

    zero = on_mesh(adapters.init(jax.random.key(0), variables, lora_rules(config)))  # B = 0
    bases = list(dict.fromkeys((*config.finetune.bases, *config.finetune.methods)))
    frozen = {base: on_mesh(frozen_base(config, variables, base)) for base in bases}
    sizes = {base: adapters.quant.base_bytes(f) for base, f in frozen.items()}
    test = texts["finetune/test"]
    before = {base: evaluate(zero, f, test, "test")["test/ppl"] for base, f in frozen.items()}

    cells = {}
    for base in config.finetune.methods:
        shared = (variables, frozen[base], texts, workdir, mesh, evaluate)
        for lr in config.finetune.learning_rates:
            cell = finetune(config, base, lr, *shared, options=options)
            if cell["interrupted"]:
                return {"interrupted": True}
            cells[(base, lr)] = cell
    chosen = {}
    for base in config.finetune.methods:
        best = min((c for (b, _), c in cells.items() if b == base), key=lambda c: c["valid/ppl"])
        best["test/ppl"] = evaluate(best["adapters"], frozen[base], test, "test")["test/ppl"]
        chosen[base] = best

    prompts = test["tokens"][: config.eval.num_samples, : config.eval.sample_prompt_chars]
    n = config.eval.sample_tokens
    samples = {"before": sample(model, variables, None, prompts, tokens=n)}
    for base, best in chosen.items():
        samples[base] = sample(model, frozen[base], best["adapters"], prompts, tokens=n)
    result = write_report(config, workdir, pre, before, sizes, cells, chosen, samples, prompts)
    logging.info("llm_lora: %s", {k: v for k, v in result.items() if k != "methods"})
    return result


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The run's jitted train steps (as ``fit`` runs them), on abstract inputs.

    Pre-training, then LoRA on the float32 base and on the NF4 base (QLoRA); no text is read and
    no weight computed. ``mesh`` (default: all devices) may be a ``jax.sharding.AbstractMesh``.
    """
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    model = models.DecoderLM(model_config(config))
    tokens = jax.ShapeDtypeStruct((config.data.batch_size, config.data.passage_chars), jnp.int32)
    key = jax.random.key(config.seed)
    s = config.schedule

    def pretrain_state(k):
        variables = model.init(k, jnp.zeros((1, 8), jnp.int32))
        tx = _optimizer(config, config.model.pretrain_learning_rate, 10, 1)
        return {"params": variables, "opt_state": tx.init(variables), "step": 0}, tx

    state, tx = common.eval_shape_with_static(pretrain_state, key)
    forward = lambda params, _, t: model.apply(params, t)  # noqa: E731
    out = [
        common.fit_step(
            make_step(forward, tx, "params"),
            state,
            None,
            {"tokens": tokens},
            mesh=mesh,
            name="pretrain",
        )  # fmt: skip
    ]
    for base in ("float32", "nf4"):

        def lora_state(k, base=base):
            variables = model.init(k, jnp.zeros((1, 8), jnp.int32))
            lora = adapters.init(k, variables, lora_rules(config))
            tx = _optimizer(config, 1e-3, s.num_steps, s.warmup_steps)
            frozen = frozen_base(config, variables, base)
            return ({"adapters": lora, "opt_state": tx.init(lora), "step": 0}, frozen), tx

        (state, frozen), tx = common.eval_shape_with_static(lora_state, key)
        out.append(
            common.fit_step(
                make_step(lora_forward(config), tx, "adapters"),
                state,
                frozen,
                {"tokens": tokens},
                mesh=mesh,
                fsdp=config.parallel.fsdp,
                name=f"LoRA, {base} base",
            )  # fmt: skip
        )
    return out
