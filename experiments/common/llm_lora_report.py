"""The report of ``experiments/llm_lora.py``: greedy samples, tables, plot and JSON."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lowrank_jax import adapters, models


def decode(tokens: Any) -> str:
    """The text of byte tokens (invalid UTF-8 replaced)."""
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


def sample(
    model: models.DecoderLM, base_vars: Any, lora: Any, prompts: np.ndarray, *, tokens: int
) -> list[str]:
    """Greedy continuations of ``prompts`` (b, p) by ``model`` on ``base_vars`` (+ ``lora``)."""
    forward = None
    state = base_vars
    if lora is not None:
        adapted = adapters.adapt(model.apply)
        state = {"base": base_vars, "lora": lora}

        def forward(st, *args, **kwargs):
            return adapted(st["base"], st["lora"], *args, **kwargs)

    out = models.generate(model, state, jnp.asarray(prompts), max_new_tokens=tokens, forward=forward)  # fmt: skip
    return [decode(row) for row in np.asarray(out)]


def write_report(config, workdir, pre, before, sizes, cells, chosen, samples, prompts) -> dict:
    """Writes ``results.md``, ``samples.md``, ``finetune_loss.png``, ``results.json``; returns the
    result dict of ``llm_lora.run``."""
    f32 = sizes["float32"] if "float32" in sizes else max(sizes.values())
    names = {"float32": "LoRA", "nf4": "QLoRA (NF4)"}
    rows = []
    for base, size in sizes.items():
        best = chosen.get(base)
        rows.append({
            "method": names.get(base, f"LoRA ({base} base)") if best else "(base only)",
            "frozen base": base,
            "base bytes": size,
            "× float32": size / f32,
            "chosen lr": best["lr"] if best else "",
            "valid ppl": best["valid/ppl"] if best else "",
            "test ppl before": before[base],
            "test ppl after": best["test/ppl"] if best else "",
            "step s": best["step_time_s"] if best else "",
        })  # fmt: skip
    grid = ", ".join(f"{b}@{lr:g}: {c['valid/ppl']:.3f}" for (b, lr), c in cells.items())
    d, m = config.data, config.model
    notes = (
        f"Byte-level Llama-family decoder (d={m.hidden_size}, {m.num_hidden_layers} layers, "
        f"{m.num_attention_heads} heads / {m.num_key_value_heads} kv, MLP {m.intermediate_size}) "
        f"pretrained {m.pretrain_steps} steps on {', '.join(d.pretrain_genres)} "
        f"(validation perplexity per byte {pre.get('pretrain/valid/ppl', math.nan):.3f}), then "
        f"LoRA r={config.adapter.rank}, alpha={config.adapter.alpha:g} on all seven projections, "
        f"{config.schedule.num_steps} steps on {d.finetune_genre} passages of {d.passage_chars} "
        f"bytes (batch {d.batch_size}). Perplexity per byte on the held-out genre's test "
        f"passages. Every method had the same grid of peak learning rates "
        f"{tuple(config.finetune.learning_rates)}, chosen on validation perplexity ({grid}). "
        "Base bytes: the frozen model with its projection kernels stored as the named dtype "
        "(embeddings and norms float32; NF4: 4-bit codes + a float32 scale per block of "
        f"{config.adapter.nf4_block_size}). 'test ppl before': the pretrained model on that base."
    )
    common.write_results_md(workdir, rows, title="LoRA and QLoRA on a decoder", notes=notes)
    lines = ["# Greedy samples (prompt | continuation)", ""]
    for i, prompt in enumerate(prompts):
        lines.append(f"## prompt {i}: `{decode(prompt)!r}`")
        for name, texts in samples.items():
            lines.append(f"- {name}: `{texts[i]!r}`")
        lines.append("")
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "samples.md"), "w") as f:
            f.write("\n".join(lines))
    curves = {}
    for base, best in chosen.items():
        pts = [(r["step"], r["train/loss"]) for r in best["history"] if "train/loss" in r]
        curves[f"{names.get(base, base)} (lr {best['lr']:g})"] = tuple(zip(*pts, strict=True))
    common.plot_curves(os.path.join(workdir, "finetune_loss.png"), curves, title="fine-tuning loss (nats/byte)")  # fmt: skip
    methods = {
        base: {
            "lr": c["lr"],
            "valid/ppl": c["valid/ppl"],
            "test/ppl_before": before[base],
            "test/ppl_after": c["test/ppl"],
            "base_bytes": sizes[base],
            "step_time_s": c["step_time_s"],
        }
        for base, c in chosen.items()
    }
    result = {
        "pretrain/valid/ppl": pre.get("pretrain/valid/ppl"),
        "methods": methods,
        "base_bytes": sizes,
        "test/ppl_before": before,
        "samples": samples,
        "interrupted": False,
    }
    common.write_json(os.path.join(workdir, "results.json"), result)
    return result
