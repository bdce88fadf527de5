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

Options (``experiments/common``): several training sources are the tasks of a continual run
(``continual.method``, :mod:`~experiments.common.llm_continual`); ``select.fraction`` keeps the
training rows GIST (P11) chooses for a target (:mod:`~experiments.common.llm_gist`); a source may
be a TFDS dataset (``tfds:NAME[@SPLIT]``, :mod:`~experiments.common.llm_data`). The step, the
evaluation and the export are in :mod:`~experiments.common.llm_sft_steps`; ``fp8.enabled`` casts
the attention logits to FP8 at P14's geometry-aware scales (:mod:`~experiments.common.llm_fp8`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from experiments import common
from experiments.common import llm_continual, llm_data, llm_fixture, llm_fp8, llm_gist
from experiments.common.llm_sft_report import sample, sampling_forward, write_report
from experiments.common.llm_sft_steps import (
    adapter_rules,
    evaluated,
    export,
    frozen_base,
    initial_adapters,
    make_evaluate,
    make_forward,
    make_step,
    optimizer,
    sbvi_state,
)
from lowrank_jax import adapters, data, models, optim
from lowrank_jax.adapters.quant import BASE_DTYPES

METHODS = ("lora", "dora", "frameft", "sbvi")  # adapter.method
INITS = ("kaiming", "pissa", "lora_da")  # adapter.init (LoRA only besides kaiming)


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
    llm_data.check_sources(config)
    if config.continual.method:
        llm_continual.check_config(config)
    if c.check_nonnegative(config, "select.fraction") > 1:
        raise c.ConfigError("config.select.fraction must be in [0, 1] (0: no selection)")
    if config.select.fraction and config.continual.method:
        raise c.ConfigError("config.select.fraction is for one training source, not continual")
    c.check_positive(config, "select.k", integer=True)
    c.check_positive(config, "select.chunk_size", integer=True)
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
    llm_fp8.check_config(config)
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
    """``(train, valid)`` lists of ``text.Example`` of one training source (``llm_data``)."""
    return llm_data.split_examples(config, tokenizer, files["train"], files["valid"])


def check_rows(config: Any, name: str, packed: dict[str, Any]) -> dict[str, Any]:
    """``packed`` if it fills a batch, else a ValueError saying what to change."""
    if len(packed["tokens"]) < config.data.batch_size:
        raise ValueError(
            f"{name} packs into {len(packed['tokens'])} rows of {config.data.max_length} "
            f"tokens, fewer than data.batch_size={config.data.batch_size}: lower "
            "--config.data.batch_size or add rows."
        )
    return packed


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
    tasks = llm_data.load_tasks(config, tokenizer, files)
    pack = lambda ex: data.pack(  # noqa: E731
        ex, max_length=config.data.max_length, pad_id=tokenizer.pad_token_id
    )
    for name, train, _ in tasks:
        check_rows(config, name, pack(train))
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
    if config.continual.method:
        specs = [{"name": n, "train": pack(t), "valid": pack(v)} for n, t, v in tasks]
        result = llm_continual.run(config, workdir, options, model, variables, specs)
        return llm_continual.finish(config, workdir, files, mc, result)
    ((_, train, valid),) = tasks
    train_packed, valid_packed = pack(train), pack(valid)
    forward = llm_fp8.make_forward(config, model) if config.fp8.enabled else make_forward(model)
    evaluate = make_evaluate(forward, mesh, batch_size=config.eval.batch_size)

    def on_mesh(tree):  # as fit places them
        shardings = common.param_sharding(mesh, tree, fsdp=config.parallel.fsdp)
        return common.sharding.put_global(tree, shardings)

    lora, base = initial_adapters(config, model, variables, train_packed)
    extra = {}
    if config.select.fraction:  # GIST (P11): keep the rows that serve the target
        target = valid
        if config.select.target:
            target = llm_data.read_examples(config, tokenizer, config.select.target)
        kept, _ = llm_gist.select(config, model, lora, base, train, target, tokenizer.pad_token_id)
        extra["selected_rows"] = sorted(int(i) for i in kept)
        extra["selected_from"] = len(train)
        train = [train[i] for i in extra["selected_rows"]]
        train_packed = check_rows(config, "the GIST selection", pack(train))
    zero = jax.device_get(lora)  # the adapters before training (fit donates its state)
    frozen = on_mesh(frozen_base(config, base))
    if config.fp8.enabled:  # P14's scales, and a naive amax scale evaluated beside them
        first = {k: v[: config.data.batch_size] for k, v in train_packed.items()}
        naive = llm_fp8.naive_scales(model, on_mesh(lora), frozen, first)
        evaluate = llm_fp8.make_evaluate(config, model, mesh, naive)
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
    if config.adapter.method == "sbvi":
        extra["sbvi_ranks"] = optim.sbvi_ranks(
            jax.device_get(sbvi_state(result.state["opt_state"]))
        )
    sections = []
    if config.fp8.enabled:
        extra.update(llm_fp8.summary(config, before, after))
        sections = llm_fp8.report_lines(config, before, after)
    write_report(config, workdir, files, {**counts, **extra}, before, after, samples, sections)
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

    if config.continual.method:
        variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        return llm_continual.steps(config, model, variables, mesh)
    (state, frozen), tx = common.eval_shape_with_static(build, jax.random.key(config.seed))
    a = config.adapter
    fp8 = config.fp8.enabled
    forward = llm_fp8.make_forward(config, model) if fp8 else make_forward(model)
    return [
        common.fit_step(
            make_step(forward, tx),
            state,
            frozen,
            batch,
            mesh=mesh,
            fsdp=config.parallel.fsdp,
            name=f"{a.method} on a {a.base} base" + (", FP8 logits (P14)" if fp8 else ""),
        )
    ]
