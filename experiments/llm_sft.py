"""Fine-tunes a user's Hugging Face decoder checkpoint on a user's JSONL data (``configs/llm_sft.py``).

1. **Inputs**: ``config.checkpoint`` (a ``save_pretrained`` directory ``models.load_hf_decoder``
   reads, with ``tokenizer.json``) and ``config.data.train`` / ``.valid`` (JSONL rows, see
   :mod:`lowrank_jax.data.text`), or, with ``config.fixture`` and those unset, the tiny
   checkpoint and files that :mod:`experiments.common.llm_fixture` builds in
   ``<workdir>/fixture``. Rows are tokenized with the checkpoint's tokenizer and chat template
   (``data.encode_jsonl``) and packed into rows of ``data.max_length`` tokens with segment ids,
   positions and loss masks (``data.pack``).
2. **Train** one ``common.fit`` run in ``<workdir>``: state ``{"adapters", "opt_state", "step"}``,
   LoRA, DoRA, FrameFT (P10) or SBVI (P8) factors stacked on the layer axis (``adapter.method``;
   LoRA initialised by ``adapter.init``: ``kaiming``, ``pissa`` or LoRA-DA, P6), the frozen base passed
   apart and stored as ``adapter.base`` (``nf4``: QLoRA; ``adapters.low_precision_base``),
   the loss the mean next-token negative log-likelihood of the packed targets. Data parallel over
   all local devices (FSDP with ``parallel.fsdp``), resumable, with the progress bar, throughput
   and utilisation of every ``fit`` run.
3. **Outputs**: ``<workdir>/adapter`` (PEFT format, ``adapters.save_peft``; LoRA and DoRA only), optionally
   ``<workdir>/merged`` (``adapters.fold`` + ``models.save_hf_decoder``, tokenizer files
   copied), ``results.md`` (validation loss and perplexity before and after, greedy samples of
   ``models.generate`` before and after) and the run's JSON (``valid_loss_before``,
   ``valid_loss_after``, ...).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common import llm_fixture
from experiments.common.llm_sft_report import sample, sampling_forward, write_report
from lowrank_jax import adapters, data, models, optim
from lowrank_jax.adapters.quant import BASE_DTYPES
from lowrank_jax.data import text
from lowrank_jax.optim.sbvi import sbvi_mean

METHODS = ("lora", "dora", "frameft", "sbvi")  # adapter.method
PEFT_METHODS = ("lora", "dora")  # the kinds a PEFT adapter_config.json describes
INITS = ("kaiming", "pissa", "lora_da")  # adapter.init (LoRA only besides kaiming)
KERNELS = r".*_proj/kernel"  # what a quantised base stores in low precision
# What a merged checkpoint needs besides the weights, copied from the input checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    if not config.fixture and (not config.checkpoint or not config.data.train):
        raise c.ConfigError(
            "config.checkpoint and config.data.train must be set: pass "
            "--config.checkpoint=DIR (a Hugging Face save_pretrained directory with "
            "tokenizer.json) and --config.data.train=FILE.jsonl, or use configs/llm_sft.py:smoke"
        )
    if config.checkpoint and not os.path.isfile(os.path.join(config.checkpoint, "config.json")):
        raise c.ConfigError(
            f"config.checkpoint={config.checkpoint!r} is invalid: no config.json there (a "
            "directory written by save_pretrained)"
        )
    for key in ("train", "valid"):
        path = config.data[key]
        if path and not os.path.isfile(path):
            raise c.ConfigError(f"config.data.{key}={path!r} is invalid: no such file")
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    if c.check_positive(config, "data.max_length", integer=True) < 2:
        raise c.ConfigError("config.data.max_length must be >= 2")
    for path in (
        "data.batch_size",
        "adapter.rank",
        "adapter.nf4_block_size",
        "eval.batch_size",
        "eval.sample_tokens",
    ):
        c.check_positive(config, path, integer=True)
    c.check_nonnegative(config, "eval.num_samples", integer=True)
    c.check_nonnegative(config, "eval.every", integer=True)
    c.check_choice(config, "model.dtype", ("float32", "bfloat16", "float16"))
    c.check_choice(config, "model.param_dtype", ("float32", "bfloat16"))
    c.check_choice(config, "adapter.method", METHODS)
    c.check_choice(config, "adapter.init", INITS)
    if config.adapter.init != "kaiming" and config.adapter.method != "lora":
        raise c.ConfigError(
            f"config.adapter.init={config.adapter.init!r} is invalid with adapter.method="
            f"{config.adapter.method!r}: 'pissa' and 'lora_da' initialise LoRA only (use "
            "--config.adapter.method=lora or --config.adapter.init=kaiming)"
        )
    c.check_positive(config, "adapter.init_rows", integer=True)
    c.check_positive(config, "adapter.frame_coeff", integer=True)
    c.check_positive(config, "adapter.frame_scale")
    c.check_nonnegative(config, "adapter.sbvi_temperature")
    c.check_nonnegative(config, "adapter.sbvi_friction")
    c.check_choice(config, "adapter.base", BASE_DTYPES)
    c.check_choice(config, "export.merged_dtype", ("", "float32", "bfloat16", "float16"))
    c.check_positive(config, "adapter.alpha")
    c.check_regexes(config, "adapter.targets")
    c.check_positive(config, "optim.learning_rate")
    c.check_nonnegative(config, "optim.weight_decay")
    c.check_nonnegative(config, "optim.grad_clip")
    common.config_checks.check_warmup(config)
    common.config_checks.check_fit_options(config)


# ----------------------------------------------------------------------------------------------
# Inputs.


def inputs(config: Any, workdir: str) -> dict[str, str]:
    """``{"checkpoint", "train", "valid"}``: the config's, or the fixture's where those are unset
    (``config.fixture``; the fixture's valid file only when its train file is used)."""
    out = {"checkpoint": config.checkpoint, "train": config.data.train, "valid": config.data.valid}
    if config.fixture and not (out["checkpoint"] and out["train"]):
        built = llm_fixture.build(os.path.join(workdir, "fixture"))
        if not out["train"]:
            out["valid"] = out["valid"] or built["valid"]
        out = {k: v or built[k] for k, v in out.items()}
    return out


def model_config(config: Any, hf: Any) -> models.DecoderConfig:
    """The checkpoint's architecture (``hf``: its directory or parsed ``config.json``) with the
    config's numerics."""
    m = config.model
    return models.config_from_hf(
        hf, dtype=m.dtype, param_dtype=m.param_dtype, remat_policy=m.remat_policy or None
    )


def load_examples(config: Any, tokenizer: data.Tokenizer, files: dict[str, str]) -> tuple:
    """``(train, valid)`` lists of ``text.Example``; without a valid file, a seeded
    ``data.valid_fraction`` of the training rows (at least one) is held out."""
    train = data.encode_jsonl(tokenizer, files["train"])
    if files["valid"]:
        return train, data.encode_jsonl(tokenizer, files["valid"])
    if len(train) < 2:
        raise ValueError(f"{files['train']} has one row: add rows or pass --config.data.valid.")
    order = np.random.default_rng(config.seed).permutation(len(train))
    n = min(len(train) - 1, max(1, round(config.data.valid_fraction * len(train))))
    return [train[i] for i in sorted(order[n:])], [train[i] for i in sorted(order[:n])]


# ----------------------------------------------------------------------------------------------
# Model, step and evaluation.


def adapter_rules(config: Any, init: str = "kaiming") -> list[tuple[str, Any]]:
    """``adapter.method``'s spec on every target, stacked on the layer axis (``(L, n, m)``)."""
    a = config.adapter
    layout = {"in_ndim": 1, "out_ndim": 1}
    if a.method == "frameft":  # P10: coefficients on a fixed frame of the kernel's shape
        spec = adapters.frameft(a.frame_coeff, scale=a.frame_scale, **layout)
    elif a.method == "sbvi":  # P8: U diag(σ) Vᵀ, σ evolved by scale_by_sbvi
        spec = adapters.spectral(a.rank, **layout)
    elif a.method == "dora":
        spec = adapters.dora(a.rank, alpha=a.alpha, **layout)
    else:
        spec = adapters.lora(a.rank, alpha=a.alpha, init=init, **layout)
    return [(t, spec) for t in a.targets]


def _packed_loss(forward: Any, batch: Any) -> jax.Array:
    """``loss_fn(forward, batch)`` of the data-aware initialisers: mean next-token loss."""
    logits = forward(
        batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
    )
    total, count = text.next_token_loss(logits, batch["tokens"], batch["loss_mask"])
    return total / jnp.maximum(count, 1.0)


def initial_adapters(
    config: Any, model: models.DecoderLM, variables: Any, packed: dict[str, np.ndarray]
) -> tuple[Any, Any]:
    """``(adapters, base)`` before training, by ``adapter.init``: ``kaiming`` (``B = 0``, the base
    unchanged), ``pissa`` (the top singular triples, ``adapters.unfold`` takes them out of the
    base) or ``lora_da`` (P6: ``adapters.lora_da`` from the per-example gradients and K-FAC
    statistics of the first ``adapter.init_rows`` packed training rows; the base unchanged)."""
    a, key = config.adapter, jax.random.key(config.seed)
    if a.init == "lora_da":
        rows = min(a.init_rows, len(packed["tokens"]))
        batch = {k: jnp.asarray(packed[k][:rows]) for k in ("tokens", "segment_ids", "positions", "loss_mask")}  # fmt: skip
        ad = adapters.lora_da(
            key, variables, adapter_rules(config), batch, apply_fn=model.apply,
            loss_fn=_packed_loss, num_train=len(packed["tokens"]), chunk_size=4,
        )  # fmt: skip
        return ad, variables
    ad = adapters.init(key, variables, adapter_rules(config, init=a.init))
    return ad, adapters.unfold(variables, ad) if a.init == "pissa" else variables


def sbvi_state(opt_state: Any) -> optim.SBVIState:
    """The ``SBVIState`` inside the run's optimizer state (chained after gradient clipping)."""
    is_state = lambda x: isinstance(x, optim.SBVIState)  # noqa: E731
    (found,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    return found


def evaluated(config: Any, state: dict[str, Any]) -> Any:
    """The adapters to evaluate and export: SBVI's at the posterior mean (its parameters hold a
    sample of ``q(σ)``), the others as trained."""
    if config.adapter.method != "sbvi":
        return state["adapters"]
    return sbvi_mean(state["adapters"], sbvi_state(state["opt_state"]))


def frozen_base(config: Any, variables: Any) -> Any:
    """The checkpoint's variables with the projection kernels stored as ``adapter.base``."""
    return adapters.low_precision_base(
        variables,
        config.adapter.base,
        patterns=(KERNELS,),
        block_size=config.adapter.nf4_block_size,
    )


def make_forward(model: models.DecoderLM) -> Any:
    """``forward(adapters, frozen, batch) -> logits`` on a packed batch, applied factorised."""
    adapted = adapters.adapt(model.apply)

    def forward(lora, frozen, batch):
        return adapted(
            frozen,
            lora,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )

    return forward


def optimizer(config: Any) -> optax.GradientTransformation:
    s = config.schedule
    lr = optax.warmup_cosine_decay_schedule(
        0.0, config.optim.learning_rate, s.warmup_steps, s.num_steps, end_value=0.0
    )
    if config.adapter.method == "sbvi":
        a = config.adapter
        tx = optim.scale_by_sbvi(
            learning_rate=config.optim.learning_rate, friction=a.sbvi_friction,
            temperature=a.sbvi_temperature, anneal_steps=max(1, int(0.8 * s.num_steps)),
            prune_start=max(1, s.num_steps // 4), seed=config.seed,
        )  # fmt: skip
    else:
        tx = optax.adamw(lr, weight_decay=config.optim.weight_decay)
    if config.optim.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), tx)
    return tx


def make_step(forward: Any, tx: optax.GradientTransformation) -> Any:
    """``step(state, frozen, batch, rng)`` for ``fit``: the mean loss over the batch's targets."""

    def step(state, frozen, batch, rng):
        del rng

        def loss_fn(lora):
            logits = forward(lora, frozen, batch)
            total, count = text.next_token_loss(logits, batch["tokens"], batch["loss_mask"])
            return total / jnp.maximum(count, 1.0), count

        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["adapters"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["adapters"])
        new = optax.apply_updates(state["adapters"], updates)
        return {**state, "adapters": new, "opt_state": opt_state}, {
            "loss": loss,
            "target_tokens": count,
        }

    return step


def make_evaluate(forward: Any, mesh: Any, *, batch_size: int) -> Any:
    """``evaluate(adapters, frozen, packed) -> {"valid/loss", "valid/ppl"}``: the mean next-token
    loss over every target of the packed validation rows, and its perplexity."""

    @jax.jit
    def sums(lora, frozen, batch, weight):
        logits = forward(lora, frozen, batch)
        return text.next_token_loss(logits, batch["tokens"], batch["loss_mask"] * weight[:, None])

    def evaluate(lora, frozen, packed):
        total = count = 0.0
        rows = {**packed, "y": np.zeros(len(packed["tokens"]))}
        for chunk, weight in common.padded_batches(rows, batch_size):
            del chunk["y"]
            t, n = sums(lora, frozen, *common.shard_batch(mesh, (chunk, weight)))
            total, count = total + float(t), count + float(n)
        loss = total / max(count, 1.0)
        return {"valid/loss": loss, "valid/ppl": data.perplexity(loss)}

    return evaluate


# ----------------------------------------------------------------------------------------------
# Outputs.


def export(
    config: Any, workdir: str, checkpoint: str, mc: Any, variables: Any, lora: Any
) -> dict[str, str]:
    """Writes ``<workdir>/adapter`` (PEFT; LoRA and DoRA only) and, with ``export.merged``,
    ``<workdir>/merged`` (``variables``: the base the adapters were trained on)."""
    out = {}
    if config.adapter.method in PEFT_METHODS:
        out["adapter_dir"] = os.path.join(workdir, "adapter")
    if config.export.merged:
        out["merged_dir"] = os.path.join(workdir, "merged")
    if jax.process_index() != 0:  # (every process holds the replicated adapters)
        return out
    if "adapter_dir" in out:
        adapters.save_peft(
            out["adapter_dir"],
            lora,
            module_name=models.decoder_module_name,
            base_model=os.path.abspath(checkpoint),
            task_type="CAUSAL_LM",
        )
    if config.export.merged:
        merged = adapters.fold(variables, lora)
        dtype = config.export.merged_dtype or None
        models.save_hf_decoder(out["merged_dir"], mc, merged, dtype=dtype)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(checkpoint, name)):
                shutil.copy2(os.path.join(checkpoint, name), out["merged_dir"])
    return out


# ----------------------------------------------------------------------------------------------
# The run.


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Fine-tunes, exports and reports (module docstring).

    Returns:
      ``{"valid_loss_before", "valid_loss_after", "valid_ppl_before", "valid_ppl_after",
      "adapter_dir", ["merged_dir"], "train_rows", "valid_rows", "step_time_s", "interrupted"}``.
    """
    check_config(config)
    workdir = os.fspath(workdir)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    mesh = common.make_mesh()
    for path in ("data.batch_size", "eval.batch_size"):
        common.check_divisible(config, path, mesh.size, why=f"the {mesh.size} devices")
    files = inputs(config, workdir)
    tokenizer = data.load_tokenizer(files["checkpoint"])
    train, valid = load_examples(config, tokenizer, files)
    pack = lambda ex: data.pack(
        ex, max_length=config.data.max_length, pad_id=tokenizer.pad_token_id
    )  # noqa: E731
    train_packed, valid_packed = pack(train), pack(valid)
    if len(train_packed["tokens"]) < config.data.batch_size:
        raise ValueError(
            f"{files['train']} packs into {len(train_packed['tokens'])} rows of "
            f"{config.data.max_length} tokens, fewer than data.batch_size="
            f"{config.data.batch_size}: lower --config.data.batch_size or add rows."
        )
    mc = model_config(config, files["checkpoint"])
    if tokenizer.vocab_size > mc.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
            f"{mc.vocab_size}: the tokenizer is not the checkpoint's."
        )
    _, variables = models.load_hf_decoder(
        files["checkpoint"], config=mc, shardings=common.replicated(mesh)
    )
    model = models.DecoderLM(mc)
    forward = make_forward(model)
    evaluate = make_evaluate(forward, mesh, batch_size=config.eval.batch_size)

    def on_mesh(tree):  # as fit places them
        shardings = common.param_sharding(mesh, tree, fsdp=config.parallel.fsdp)
        return common.sharding.put_global(tree, shardings)

    lora, base = initial_adapters(config, model, variables, train_packed)
    zero = jax.device_get(lora)  # the adapters before training (fit donates its state)
    frozen = on_mesh(frozen_base(config, base))
    before = evaluate(on_mesh(lora), frozen, valid_packed)
    tx = optimizer(config)
    result = common.fit(
        {"adapters": lora, "opt_state": tx.init(lora), "step": 0},
        frozen,
        make_step(forward, tx),
        data.BatchIterator(train_packed, batch_size=config.data.batch_size, seed=config.seed),
        key=jax.random.key(config.seed + 1),
        num_steps=config.schedule.num_steps,
        workdir=workdir,
        eval_fn=lambda s, f: evaluate(evaluated(config, s), f, valid_packed),
        eval_every=config.eval.every,
        mesh=mesh,
        **common.fit_options(config),
        description="fine-tune",
        options=options,
    )
    if result.interrupted:
        return {"interrupted": True}
    after = result.last_eval
    trained = jax.device_get(evaluated(config, result.state))
    out = export(config, workdir, files["checkpoint"], mc, base, trained)
    shown = valid[: config.eval.num_samples]
    n = config.eval.sample_tokens
    forward = sampling_forward(model)
    samples = {
        name: sample(model, forward, frozen, ad, shown, tokenizer, max_new_tokens=n)
        if shown
        else []
        for name, ad in (("before", zero), ("after", trained))
    }
    counts = {
        "train_rows": len(train),
        "train_packed": len(train_packed["tokens"]),
        "valid_rows": len(valid),
        "valid_targets": int(valid_packed["loss_mask"][:, 1:].sum()),
    }
    extra = {}
    if config.adapter.method == "sbvi":
        extra["sbvi_ranks"] = optim.sbvi_ranks(
            jax.device_get(sbvi_state(result.state["opt_state"]))
        )
    write_report(config, workdir, files, counts, before, after, samples)
    metrics = {
        "valid_loss_before": before["valid/loss"],
        "valid_loss_after": after["valid/loss"],
        "valid_ppl_before": before["valid/ppl"],
        "valid_ppl_after": after["valid/ppl"],
        **out,
        **counts,
        **extra,
        "step_time_s": result.step_time_s,
        "interrupted": False,
    }
    logging.info("llm_sft: %s", metrics)
    return metrics


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The run's jitted train step (as ``fit`` runs it) on abstract inputs: the architecture is
    read from ``config.checkpoint``'s ``config.json`` (the fixture's without one); no weight is
    read and no text tokenized. ``mesh`` may be a ``jax.sharding.AbstractMesh``."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    hf = config.checkpoint or {
        "model_type": "llama",
        "vocab_size": llm_fixture.VOCAB_SIZE,
        **llm_fixture.LLAMA,
    }
    model = models.DecoderLM(model_config(config, hf))
    shape = (config.data.batch_size, config.data.max_length)
    batch = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32),
        "positions": jax.ShapeDtypeStruct(shape, jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
    }

    def build(k):
        variables = model.init(k, jnp.zeros((1, 8), jnp.int32))
        lora = adapters.init(k, variables, adapter_rules(config))
        tx = optimizer(config)
        state = {"adapters": lora, "opt_state": tx.init(lora), "step": 0}
        return (state, frozen_base(config, variables)), tx

    (state, frozen), tx = common.eval_shape_with_static(build, jax.random.key(config.seed))
    a = config.adapter
    return [
        common.fit_step(
            make_step(make_forward(model), tx),
            state,
            frozen,
            batch,
            mesh=mesh,
            fsdp=config.parallel.fsdp,
            name=f"{a.method} on a {a.base} base",
        )
    ]
