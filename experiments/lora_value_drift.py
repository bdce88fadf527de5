"""P3 part (c): a trained LoRA on MiniLM's value projections, head by head, against eigengaps.

Stage 1 trains the LoRA: ``config.finetune`` is a config of the experiment it names
(``lora_finetune``: value-kernel targets, the held-out plays left out of ``data.plays``), run
through its public ``check_config``/``run`` contract into ``<workdir>/finetune`` (resumable, as
every ``fit`` run). Stage 2 reads the adapter back from that run's last checkpoint and, with
``lowrank_jax.analysis.value_lora``, computes per layer and head the OV-circuit update ``ΔV_h``,
``‖ΔV_h‖₂ / gap_h`` and the embedding drift on the held-out plays of the whole adapter, of each
head's ``ΔV_h`` alone and of scale sweeps ``s·ΔV`` (whole adapter; per head around the Weyl
scale ``s* = gap_h/‖ΔV_h‖₂`` and around ``s_flip``, where the top eigenvector of
``V_h + sΔV_h`` has actually turned by 45°); then the across-head correlations and the
transition checks of specs §3. Writes ``config.json`` (by ``experiments.train``),
``cells/*.json`` (one per layer and sweep; a rerun reads them back), ``heads.json``,
``results.md``, ``summary.json``, ``drift_vs_ratio.png``, ``drift_vs_norm.png`` and
``sweep.png``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm import tqdm

from experiments import common
from experiments.common import lowering, sweep
from experiments.common.checkpoint_reader import CheckpointSequence, saved_steps
from lowrank_jax import adapters, data, models
from lowrank_jax.analysis import value_lora as vl
from lowrank_jax.models import bert

__all__ = ["check_config", "run"]

HEAD_FIELDS = (
    *vl.HeadGapStats._fields,
    "drift_relative",
    "drift_cosine",
)


def check_config(config: Any) -> None:
    """Validates ``config`` (and its ``finetune`` stage); raises ``common.ConfigError``."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    f = config.finetune
    module = importlib.import_module(f"experiments.{c.get_path(config, 'finetune.experiment')}")
    module.check_config(f)
    if f.model.name != "minilm" or f.adapter.method != "lora" or f.adapter.kind != "lora":
        raise c.ConfigError(
            "config.finetune must train a LoRA (adapter.method/kind 'lora') on MiniLM"
        )
    if any("value" not in t for t in f.adapter.targets):
        raise c.ConfigError(
            f"config.finetune.adapter.targets={f.adapter.targets!r}: target value kernels only"
        )
    train_plays, heldout = set(f.data.get("plays", ())), set(config.heldout.plays)
    if not train_plays or not heldout or train_plays & heldout:
        raise c.ConfigError(
            "config.finetune.data.plays and config.heldout.plays must be non-empty and disjoint "
            f"(overlap: {sorted(train_plays & heldout)})"
        )
    for path in ("heldout.passage_chars", "heldout.passages_per_play", "heldout.max_len"):
        c.check_positive(config, path, integer=True)
    c.check_nonnegative(config, "sweep.heads_per_layer", integer=True)
    c.check_positive(config, "sweep.flip_octaves", integer=True)
    for path in ("sweep.ratios", "sweep.joint_scales"):
        values = list(c.get_path(config, path))
        if len(values) < 3 or any(v <= 0 for v in values) or values != sorted(set(values)):
            raise c.ConfigError(f"config.{path}={values}: need >= 3 increasing positive values")
    if not set(config.sweep.layers) <= set(range(6)):
        raise c.ConfigError(f"config.sweep.layers={config.sweep.layers}: MiniLM layers are 0..5")


def _value_deltas(config: Any, workdir: str, encoder_params: Any) -> dict[int, jax.Array]:
    """``{layer: ΔW_v (d, d)}`` of the adapter in the fine-tuning run's last checkpoint."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    last = saved_steps(ckpt_dir)[-1]
    restored = CheckpointSequence(ckpt_dir, steps=[last], select=lambda s: s["adapters"])[0]
    a = config.finetune.adapter
    rules = [(t, adapters.lora(rank=a.rank, alpha=a.alpha)) for t in a.targets]
    template = adapters.init(jax.random.key(0), {"params": {"bert": encoder_params}}, rules)
    deltas = {}
    for path, adapter in template.items():
        factors = restored[path]["factors"] if "factors" in restored[path] else restored[path]
        trained = adapter.replace(factors=jax.tree.map(jnp.asarray, dict(factors)))
        layer = int(path.split("/layer_")[1].split("/")[0])
        deltas[layer] = adapters.delta(
            trained,
            (encoder_params["encoder"][f"layer_{layer}"]["attention"]["value"]["kernel"].shape),
        )
    return deltas


def _with_values(encoder_params: Any, deltas: dict[int, jax.Array], scale: float) -> Any:
    layers = dict(encoder_params["encoder"])
    for layer, dw in deltas.items():
        name = f"layer_{layer}"
        att = dict(layers[name]["attention"])
        att["value"] = {**att["value"], "kernel": att["value"]["kernel"] + scale * dw}
        layers[name] = {**layers[name], "attention": att}
    return {**encoder_params, "encoder": layers}


def _mean_drift(base, pooled) -> dict[str, float]:
    d = vl.embedding_drift(base, pooled)
    return {"relative": float(jnp.mean(d.relative)), "cosine": float(jnp.mean(d.cosine))}


def _layer_cell(cfg, params, dw, base, layer, embed) -> dict[str, Any]:
    """Gap statistics and each head's solo drift for one layer."""
    att = params["encoder"][f"layer_{layer}"]["attention"]
    heads = cfg.num_attention_heads
    stats = vl.head_gap_ratios(att["value"]["kernel"], dw, att["out"]["kernel"], num_heads=heads)
    per_head = vl.head_value_kernel_deltas(dw, num_heads=heads)
    solo = [_mean_drift(base, embed(layer, per_head[h])) for h in range(heads)]
    out = {k: np.asarray(v, np.float64).tolist() for k, v in stats._asdict().items()}
    out["drift_relative"] = [s["relative"] for s in solo]
    out["drift_cosine"] = [s["cosine"] for s in solo]
    out["layer_drift"] = _mean_drift(base, embed(layer, dw))
    return out


def _sweep_cell(config, cfg, dw, base, layer, head, crossing, embed):
    per_head = vl.head_value_kernel_deltas(dw, num_heads=cfg.num_attention_heads)[head]
    scales = crossing * np.asarray(config.sweep.ratios, np.float64)
    drift = [_mean_drift(base, embed(layer, s * per_head)) for s in scales]
    rel = [d["relative"] for d in drift]
    tr = vl.scale_transition(scales, rel, crossing=crossing)
    return {
        "scales": scales.tolist(),
        "relative": rel,
        "cosine": [d["cosine"] for d in drift],
        "jump": tr.jump,
        "linear": tr.linear,
        "slopes": tr.slopes.tolist(),
        "steepest": tr.steepest,
        "transition_at_gap": tr.transition_at_gap,
    }


def _embed_from_layer(cfg: Any, layer: int):
    """Jitted ``(params, x, mask, dv) -> pooled`` embeddings from ``layer`` on, ``dv`` on W_v."""
    return jax.jit(
        lambda p, x, m, dv: vl.embeddings_from_layer(
            cfg, p, x, m, first_layer=layer, value_delta=dv
        )
    )


def _pool(cfg: Any):
    """Jitted ``(params, input_ids, mask) -> pooled`` embeddings of the whole encoder."""
    return jax.jit(
        lambda p, ids, m: models.mean_pool(models.BertEncoder(cfg).apply({"params": p}, ids, m), m)
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """Stage 1's steps (the fine-tuning experiment's ``steps``) and the held-out embeddings from
    each swept layer and of the whole encoder, on abstract inputs (no data, no weights read)."""
    check_config(config)
    finetune = importlib.import_module(f"experiments.{config.finetune.experiment}")
    out = [s._replace(name=f"finetune {s.name}") for s in finetune.steps(config.finetune, mesh)]
    cfg, variables = lowering.abstract_minilm()
    h, spec, d = config.heldout, jax.ShapeDtypeStruct, cfg.hidden_size
    mask = spec((h.batch_size, h.max_len), jnp.int32)
    for layer in config.sweep.layers:
        args = (variables["params"], spec((h.batch_size, h.max_len, d), jnp.float32), mask, spec((d, d), jnp.float32))  # fmt: skip
        out.append(common.Step(f"embed from layer {layer}", _embed_from_layer(cfg, layer), args))
    ids = spec((h.batch_size, h.max_len), jnp.int32)
    return [*out, common.Step("pool", _pool(cfg), (variables["params"], ids, mask))]


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Trains the value-only LoRA (stage 1), then relates ``‖ΔV_h‖/gap_h`` to embedding drift.

    Stage 1 trains with the options of its own config (``config.finetune.train``, ...) and reports
    to this run's log (its cost rows, its start).
    """
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    finetune_dir = os.path.join(workdir, "finetune")
    module = importlib.import_module(f"experiments.{config.finetune.experiment}")
    stage = common.TrainOptions.from_config(config.finetune, workdir)
    trained = module.run(config.finetune, finetune_dir, dataclasses.replace(stage, log=options.log))
    if trained.get("interrupted"):
        return {"interrupted": True}

    cfg, variables, tokenizer = models.load_minilm()
    params = variables["params"]
    deltas = _value_deltas(config, finetune_dir, params)
    h = config.heldout
    ds = data.load_shakespeare(
        plays=tuple(h.plays),
        passage_chars=h.passage_chars,
        max_passages_per_play=h.passages_per_play,
        seed=config.seed,
    )
    tokens = models.tokenize(tokenizer, list(ds.x), max_len=h.max_len)
    chunks = [  # (input_ids, attention_mask) in chunks of heldout.batch_size passages
        (
            jnp.asarray(tokens["input_ids"][i : i + h.batch_size]),
            jnp.asarray(tokens["attention_mask"][i : i + h.batch_size]),
        )
        for i in range(0, len(ds.x), h.batch_size)
    ]
    inputs = [  # per chunk, what each layer receives
        [x for x, _, _ in bert.attention_inputs(cfg, variables, ids, m)] for ids, m in chunks
    ]
    top = {}

    def embed(layer, dv):
        """Pooled embeddings of all held-out passages with ``dv`` added to ``layer``'s W_v."""
        if layer not in top:
            top[layer] = _embed_from_layer(cfg, layer)
        return jnp.concatenate(
            [top[layer](params, x[layer], m, dv) for x, (_, m) in zip(inputs, chunks, strict=True)]
        )

    pool = _pool(cfg)

    def encode(p):
        return jnp.concatenate([pool(p, ids, m) for ids, m in chunks])

    base = encode(params)
    logging.info("held-out: %d passages of %s", len(ds.x), ", ".join(h.plays))
    store = sweep.CellStore(workdir, options=options)
    layers = sorted(deltas)
    cells = {
        la: store.get(
            f"layer={la}",
            lambda la=la: _layer_cell(cfg, params, deltas[la], base, la, embed),
        )
        for la in tqdm(layers, desc="heads", disable=not config.log.progress)
    }
    joint = store.get(
        "joint",
        lambda: {
            "scales": list(config.sweep.joint_scales),
            "drift": [
                _mean_drift(base, encode(_with_values(params, deltas, s)))
                for s in config.sweep.joint_scales
            ],
        },
    )

    heads = [
        dict(layer=la, head=i, **{k: cells[la][k][i] for k in HEAD_FIELDS})
        for la in layers
        for i in range(cfg.num_attention_heads)
    ]
    # Per swept head, s * dV_h around the Weyl scale s* = gap_h / |dV_h|_2 ("sweep") and around
    # s_flip, where the top eigenvector of V_h + s dV_h has turned by 45 degrees ("flip").
    swept, flipped = [], []
    for la in [la for la in config.sweep.layers if la in cells]:
        att = params["encoder"][f"layer_{la}"]["attention"]
        v = vl.head_value_deltas(
            att["value"]["kernel"], att["out"]["kernel"], num_heads=cfg.num_attention_heads
        )
        dv = vl.head_value_deltas(
            deltas[la], att["out"]["kernel"], num_heads=cfg.num_attention_heads
        )
        for i in np.argsort(cells[la]["ratio"])[::-1][: config.sweep.heads_per_layer]:
            i = int(i)
            row = heads[layers.index(la) * cfg.num_attention_heads + i]
            s_star = 1.0 / row["ratio"]
            args = (config, cfg, deltas[la], base, la, i, s_star, embed)
            swept.append(
                (row, store.get(f"sweep/layer={la}/head={i}", lambda a=args: _sweep_cell(*a)))
            )
            grid = s_star * 2.0 ** (np.arange(4 * config.sweep.flip_octaves + 1) / 4)
            s_flip = vl.top_direction_flip(v[i], dv[i], grid)
            if np.isfinite(s_flip):
                args = (config, cfg, deltas[la], base, la, i, s_flip, embed)
                cell = store.get(f"flip/layer={la}/head={i}", lambda a=args: _sweep_cell(*a))
                flipped.append(({**row, "s_flip": s_flip, "s_star": s_star}, cell))
    common.write_json(os.path.join(workdir, "heads.json"), heads)
    return _report(config, workdir, trained, heads, cells, joint, swept, flipped)


def _report(config, workdir, trained, heads, cells, joint, swept, flipped) -> dict[str, Any]:
    col = {k: np.asarray([r[k] for r in heads]) for k in heads[0]}
    col["rotation"] = 1.0 - col["top_overlap"]  # how far the top eigenvector actually turned
    corr = {
        (y, x): vl.correlations(col[x], col[y])
        for y in ("drift_relative", "drift_cosine")
        for x in ("ratio", "delta_norm", "delta_fro", "gap", "rotation")
    }
    stats = ("spearman", "spearman_p", "pearson", "pearson_log")
    rows = [{"drift": y, "predictor": x, **{k: c[k] for k in stats}} for (y, x), c in corr.items()]
    fit = vl.log_drift_fit(col["drift_relative"], col["delta_norm"], col["gap"], col["layer"])
    same = [col["layer"] == la for la in cells]  # within-layer Spearman: depth held fixed
    by_layer = {
        x: [vl.correlations(col[x][m], col["drift_relative"][m])["spearman"] for m in same]
        for x in ("ratio", "delta_norm")
    }
    r_ratio = corr[("drift_relative", "ratio")]["spearman"]
    r_norm = corr[("drift_relative", "delta_norm")]["spearman"]
    checks = [
        sweep.check(
            "drift rank-correlates with |dV_h|/gap_h better than with |dV_h| (Spearman)",
            bool(r_ratio > r_norm),
            f"{r_ratio:.3f} vs {r_norm:.3f} over {len(heads)} heads",
        ),
        sweep.check(
            "within layers too (median over layers of the Spearman over its heads)",
            bool(np.median(by_layer["ratio"]) > np.median(by_layer["delta_norm"])),
            f"{np.median(by_layer['ratio']):.3f} vs {np.median(by_layer['delta_norm']):.3f}",
        ),
        sweep.check(
            "drift depends on |dV_h|/gap_h: log D = a log|dV| + b log gap + c_layer has b ~ -a",
            bool(fit["b"] < -0.5 * fit["a"]),
            f"a = {fit['a']:.3f}, b = {fit['b']:.3f}; R2 {fit['r2']:.3f} "
            f"(without the gap {fit['r2_without_gap']:.3f})",
        ),
        _sweep_check("s |dV_h|_2 = gap_h (the Weyl scale s*)", swept),
        _sweep_check("the top eigenvector of V_h + s dV_h turns by 45 degrees (s_flip)", flipped),
    ]
    ratio = col["ratio"]
    extra = {
        "finetune test accuracy": round(float(trained.get("test/accuracy", float("nan"))), 4),
        "heads": len(heads),
        "heads with |dV|/gap > 1": int(np.sum(ratio > 1)),
        "median |dV|/gap": float(np.median(ratio)),
        "max ‖dV_h‖₂/gap_h": float(np.max(ratio)),
        "min top-eigenvector overlap": float(np.min(col["top_overlap"])),
        "whole-adapter drift s*dW (relative / 1-cos)": ", ".join(
            f"s={s:g}: {d['relative']:.3g} / {d['cosine']:.3g}"
            for s, d in zip(joint["scales"], joint["drift"], strict=True)
        ),
    }
    table = [
        {
            "layer": la,
            "median gap": np.median(c["gap"]),
            "median ‖dV_h‖₂": np.median(c["delta_norm"]),
            "max ‖dV_h‖₂/gap_h": np.max(c["ratio"]),
            "layer drift (rel)": c["layer_drift"]["relative"],
            "max head drift (rel)": np.max(c["drift_relative"]),
            "min overlap": np.min(c["top_overlap"]),
        }
        for la, c in cells.items()
    ]
    r0 = config.sweep.ratios[0]
    sweeps = _sweep_rows(swept, "s*", r0) + _sweep_rows(flipped, "s_flip", r0)
    command = sweep.command_line("python -m experiments.train --config=configs/lora_value_drift.py")
    out = sweep.write_sweep_results(
        workdir,
        table,
        checks,
        title="P3 (c): value-only LoRA on MiniLM, per-head |dV|/gap vs drift",
        columns=list(table[0]),
        command=command,
        extra=extra,
    )
    with open(os.path.join(workdir, "results.md"), "a") as fh:
        fh.write(
            "\n\n## Correlations across heads (drift of each head's dV_h alone)\n\n"
            + sweep.markdown_table(rows, [(k, k) for k in rows[0]])
            + "\n\n## Scale sweeps of s dV_h alone, centred on s_c = s* (Weyl) or s_flip "
            "(jump = D(2 s_c)/D(s_c/2); slopes = d log D / d log s)\n\n"
            + (sweep.markdown_table(sweeps, [(k, k) for k in sweeps[0]]) if sweeps else "none")
            + "\n"
        )
    _plots(workdir, col, swept)
    return out


def _sweep_check(where: str, pairs: list) -> dict[str, Any]:
    """§3's jump: D(2 s_c)/D(s_c/2) >= 2x a linear drift's, steepest segment in [s_c/2, 2 s_c]."""
    jumps = [c["jump"] / c["linear"] for _, c in pairs]
    n = sum(c["transition_at_gap"] for _, c in pairs)
    return sweep.check(
        f"drift jumps where {where}",
        bool(pairs) and n > len(pairs) / 2,
        f"{n}/{len(pairs)} swept heads; median jump / linear "
        f"{np.median(jumps) if jumps else float('nan'):.3f}",
    )


def _sweep_rows(pairs: list, centre: str, first_ratio: float) -> list[dict[str, Any]]:
    return [
        {
            "head": f"L{r['layer']}H{r['head']}",
            "centre s_c": centre,
            "s_c": c["scales"][0] / first_ratio,
            "‖dV_h‖₂/gap_h": r["ratio"],
            "drift at s = 1": r["drift_relative"],
            "jump / linear": c["jump"] / c["linear"],
            "steepest (s/s_c)": c["steepest"],
            "max slope": max(c["slopes"]),
            "transition": c["transition_at_gap"],
        }
        for r, c in pairs
    ]


def _plots(workdir, col, swept) -> None:
    from experiments.common.plots import subplots

    for x, name in (("ratio", "|dV_h|_2 / gap_h"), ("delta_norm", "|dV_h|_2")):
        fig, ax = subplots(figsize=(5, 4))
        ax.scatter(col[x], np.maximum(col["drift_relative"], 1e-12), c=col["layer"], s=14)
        ax.set(
            xscale="log", yscale="log", xlabel=name, ylabel="relative embedding drift (head alone)"
        )
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, f"drift_vs_{'ratio' if x == 'ratio' else 'norm'}.png"))
    if swept:
        common.plot_curves(
            os.path.join(workdir, "sweep.png"),
            {
                f"L{r['layer']}H{r['head']}": (
                    list(np.log10(np.asarray(c["scales"]) * r["ratio"])),
                    c["relative"],
                )
                for r, c in swept
            },
            title="drift of s dV_h alone vs log10(s |dV_h| / gap_h)",
            xlabel="log10(s |dV_h|_2 / gap_h)",
            ylabel="relative embedding drift",
            logy=True,
            marks={"gap": 0.0},
        )
