"""The report of ``experiments/llm_sft.py``: greedy samples before and after, and ``results.md``."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from experiments import common
from lowrank_jax import adapters, data, models
from lowrank_jax.data import text


def sampling_forward(model: models.DecoderLM) -> Any:
    """``forward({"base", "lora"}, tokens, mask, **kw)`` for ``models.generate``: made once per
    run, so that samples before and after training share one compiled sampler."""
    adapted = adapters.adapt(model.apply)
    return lambda v, *args, **kw: adapted(v["base"], v["lora"], *args, **kw)


def sample(
    model: models.DecoderLM,
    forward: Any,
    frozen: Any,
    lora: Any,
    examples: list[text.Example],
    tokenizer: data.Tokenizer,
    *,
    max_new_tokens: int,
) -> list[tuple[str, str]]:
    """``(prompt, greedy continuation)`` texts for each example: its tokens before the first
    target (the first half of a ``{"text"}`` row), left-padded, through ``models.generate`` with
    ``forward`` (from :func:`sampling_forward`); the continuation up to its first EOS, special
    tokens shown."""
    prompts = []
    for e in examples:
        first = int(np.argmax(e.loss_mask)) if e.loss_mask.any() else len(e.tokens)
        prompts.append(e.tokens[: first if first >= 2 else max(1, len(e.tokens) // 2)])
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, True
    eos = model.config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    out = models.generate(
        model,
        {"base": frozen, "lora": lora},
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        forward=forward,
    )
    stops = set(np.atleast_1d(eos).tolist()) if eos is not None else set()
    texts = []
    for p, row in zip(prompts, np.asarray(out).tolist(), strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))  # through EOS
        texts.append(tuple(tokenizer.decode(x, skip_special_tokens=False) for x in (p, row[:end])))
    return texts


def write_report(config, workdir, files, counts, before, after, samples, sections=()) -> None:
    """``results.md``: the losses before and after, the run's notes, ``sections`` (markdown
    lines, e.g. ``llm_fp8.report_lines``) and the greedy samples."""
    rows = [
        {"": "validation loss (nats per target token)", "before": before["valid/loss"],
         "after": after["valid/loss"]},
        {"": "validation perplexity", "before": before["valid/ppl"], "after": after["valid/ppl"]},
    ]  # fmt: skip
    a = config.adapter
    notes = (
        f"Checkpoint `{files['checkpoint']}`, {a.method.upper()} r={a.rank}, alpha={a.alpha:g} "
        f"on `{'`, `'.join(a.targets)}`, frozen base stored as {a.base}, compute dtype "
        f"{config.model.dtype}; {config.schedule.num_steps} steps of {config.data.batch_size} "
        f"packed rows of {config.data.max_length} tokens, peak learning rate "
        f"{config.optim.learning_rate:g}. Training `{files['train']}`: {counts['train_rows']} "
        f"rows in {counts['train_packed']} packed rows; validation "
        f"{'`' + files['valid'] + '`' if files['valid'] else 'held out of the training rows'}: "
        f"{counts['valid_rows']} rows, {counts['valid_targets']} target tokens. 'before' is the "
        f"frozen base ({a.base}) with the initial adapter (`adapter.init={a.init}`)."
    )
    if "selected_rows" in counts:
        notes += (
            f" GIST (P11) kept {len(counts['selected_rows'])} of {counts['selected_from']} "
            f"training rows for the target ({config.select.target or 'the validation rows'})."
        )
    if a.method not in ("lora", "dora"):
        notes += (
            f" No PEFT `adapter/` is written: PEFT has no {a.method} layer; the trained factors "
            "are in the run's checkpoints, and `merged/` (when exported) has them folded in."
        )
    body = common.write_results_md(workdir, rows, title="Fine-tuning", notes=notes)
    lines = [*sections, "", "## Greedy samples (prompt → continuation)", ""]
    for i, ((prompt, old), (_, new)) in enumerate(
        zip(samples["before"], samples["after"], strict=True)
    ):
        lines += [
            f"{i + 1}. prompt `{prompt!r}`",
            f"   - before: `{old!r}`",
            f"   - after: `{new!r}`",
        ]
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "results.md"), "w") as f:
            f.write(body + "\n".join(lines) + "\n")
