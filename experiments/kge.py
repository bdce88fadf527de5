"""Rank bottlenecks in KGEs (P4): training-set fit of linear vs mixture-of-softmaxes output layers.

``run(config, workdir)`` trains many small 1-N models (one *cell* each: dataset, scorer, output
layer, d, K), each in seconds, and writes:

- ``config.json``; ``metrics.jsonl`` (the logged training loss of every cell, and its final
  metrics at the last epoch); ``cells/<cell>.json`` (per-cell results, written atomically by
  :class:`experiments.common.sweep.CellStore`; a rerun skips them);
- ``results.md``: graph statistics with the Forster-type necessary dimension, the d x K sweep,
  the baselines at small d, the synthetic size/density control, and the trend checks of
  specs.md section 4 marked as reproduced or not; ``results.json`` with the same numbers;
- PNG plots: ``fit_<metric>_<dataset>_<scorer>.png`` (training fit vs d, one line per K),
  ``synthetic_fit.png``, ``synthetic_bound.png``.

Training is full batch by default (``schedule.batch_size = 0``); each epoch is one jitted call
with the parameters and optimizer state donated (``lowrank_jax.kge.training.make_train_epoch``,
driven by :func:`experiments.common.sweep.train_epochs`), and the loss comes to the host only every
``log.every`` epochs. The trend checks, tables and plots are in
:mod:`experiments.common.kge_report`.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import common
from experiments.common import kge_report, sweep
from lowrank_jax import kge
from lowrank_jax.adapters import count_params
from lowrank_jax.data import load_kg
from lowrank_jax.kge.metrics import rank_metrics, rank_triples
from lowrank_jax.kge.scorers import SCORERS
from lowrank_jax.kge.training import init_kge, make_train_epoch

__all__ = ["check_config", "run"]

_OUTPUTS_OF_BASELINE = {"sigmoid": "sigmoid", "mos1": "mos", "mol": "mol", "matched": "softmax"}


def check_config(config) -> None:
    """Validates the config before anything is computed."""
    c = common
    for name in config.data.datasets:
        if name not in ("nations", "umls", "kinships"):
            raise c.ConfigError(
                f"config.data.datasets has {name!r}: allowed values are nations, umls, kinships"
            )
    for s in (*config.model.scorers, config.model.synthetic_scorer):
        if s not in SCORERS:
            raise c.ConfigError(f"scorer {s!r} is invalid: allowed values are {SCORERS}")
    for b in config.model.baselines:
        if b not in (*_OUTPUTS_OF_BASELINE, "ensemble"):
            raise c.ConfigError(
                f"config.model.baselines has {b!r}: allowed values are "
                f"{', '.join((*_OUTPUTS_OF_BASELINE, 'ensemble'))}"
            )
    c.check_positive_ints(config, "model.dims")
    if "complex" in (*config.model.scorers, config.model.synthetic_scorer) and any(
        d % 2 for d in config.model.dims
    ):
        raise c.ConfigError("config.model.dims must be even for ComplEx (real dimension)")
    if not config.model.components or min(config.model.components) < 1:
        raise c.ConfigError("config.model.components must be positive ints, e.g. (1, 2, 4)")
    for p in config.data.synthetic_densities:
        if not 0.0 < p < 1.0:
            raise c.ConfigError(f"config.data.synthetic_densities has {p}: must lie in (0, 1)")
    c.check_choice(config, "model.proj_init", ("identity", "random"))
    c.check_positive(config, "optim.learning_rate")
    c.check_positive(config, "schedule.epochs", integer=True)
    c.check_nonnegative(config, "schedule.batch_size", integer=True)
    c.check_positive(config, "eval.batch_size", integer=True)
    c.check_fraction(config, "eval.fit_mrr", allow_zero=False)
    c.check_positive(config, "log.every", integer=True)
    c.check_positive(config, "model.baseline_dim", integer=True)
    c.check_positive(config, "model.baseline_components", integer=True)


# --------------------------------------------------------------------------------------------
# Data


def _load_graphs(config) -> dict[str, dict[str, Any]]:
    graphs = {}
    for name in config.data.datasets:
        kg_data = load_kg(name)
        graphs[name] = {
            "train": kg_data.train,
            "valid": kg_data.valid,
            "test": kg_data.test,
            "E": kg_data.num_entities,
            "R": kg_data.num_relations,
            "synthetic": False,
        }
    for i, e in enumerate(config.data.synthetic_entities):
        for j, p in enumerate(config.data.synthetic_densities):
            g = kge.make_synthetic_kg(
                num_entities=e,
                num_relations=config.data.synthetic_relations,
                density=p,
                seed=config.seed + 100 * i + j,
            )
            graphs[f"syn_E{e}_p{p}"] = {
                "train": g.train,
                "valid": g.valid,
                "test": g.test,
                "E": e,
                "R": config.data.synthetic_relations,
                "synthetic": True,
                "p": p,
            }
    for g in graphs.values():
        g["targets"] = kge.build_query_targets(
            kge.add_inverse_triples(g["train"], num_relations=g["R"]), num_entities=g["E"]
        )
        known = np.concatenate([g["train"], g["valid"], g["test"]])
        g["known"] = kge.build_query_targets(
            kge.add_inverse_triples(known, num_relations=g["R"]), num_entities=g["E"]
        )
    return graphs


# --------------------------------------------------------------------------------------------
# Training and evaluation of one cell


@functools.cache
def _score_fn(scorer: str, output: str):
    def fn(params, heads, relations):
        return kge.kge_scores(params, heads, relations, scorer=scorer, output=output)

    return fn


@functools.cache
def _ensemble_score_fn(scorer: str):
    def fn(members, heads, relations):
        log_p = [
            jax.nn.log_softmax(kge.kge_scores(p, heads, relations, scorer=scorer, output="softmax"))
            for p in members
        ]
        return jax.nn.logsumexp(jnp.stack(log_p), axis=0) - math.log(len(members))

    return fn


@functools.cache
def _epoch_fn(lr: float, scorer: str, output: str, num_entities: int, q: int, batch_size: int):
    """The jitted 1-N epoch (one compilation per scorer, output layer and graph size)."""
    return make_train_epoch(
        sweep.adam(lr), scorer=scorer, output=output, num_entities=num_entities, num_queries=q,
        batch_size=batch_size,
    )  # fmt: skip


def _setup(config, g, *, scorer, output, dim, components, key):
    """``(epoch_fn, params, batch_size)`` of one model on graph ``g``."""
    q = len(g["targets"].queries)
    batch_size = min(config.schedule.batch_size or q, q)
    epoch_fn = _epoch_fn(config.optim.learning_rate, scorer, output, g["E"], q, batch_size)
    params = init_kge(
        key, scorer=scorer, output=output, num_entities=g["E"], num_relations=g["R"],
        dim=dim, num_components=components, proj_init=config.model.proj_init,
    )  # fmt: skip
    return epoch_fn, params, batch_size


def steps(config, mesh=None) -> list[common.Step]:
    """The jitted 1-N training epoch of every kind of cell (scorer, output layer, components) on
    each graph, at the largest dimension. The small triple files are read (the query targets'
    shapes are the data's); the parameters, optimizer state and targets stay abstract."""
    del mesh  # the sweep's programs run on one device
    check_config(config)
    graphs, largest = _load_graphs(config), {}
    for cell in _cells(config, graphs):
        kind = (cell["dataset"], cell["scorer"], cell["output"], cell["K"])
        largest[kind] = max(largest.get(kind, 0), cell["d"])
    out, key = [], jax.random.key(0)
    for (name, scorer, output, k), dim in largest.items():
        g = graphs[name]
        params, (epoch_fn, _) = common.eval_shape_with_static(
            lambda key, g=g, s=scorer, o=output, d=dim, k=k: _pair(
                _setup(config, g, scorer=s, output=o, dim=d, components=k, key=key)
            ),
            key,
        )
        t = g["targets"]
        args = (params, jax.eval_shape(sweep.adam(config.optim.learning_rate).init, params),
                jax.eval_shape(lambda: key), *common.lowering.abstract((t.queries, t.objects)))  # fmt: skip
        out.append(common.Step(f"{name} {scorer} {output} K={k} d={dim}", epoch_fn, args))
    return out


def _pair(setup):
    epoch_fn, params, batch_size = setup
    return params, (epoch_fn, batch_size)


def _train(config, g, *, scorer, output, dim, components, seed, options):
    """Trains one model on graph ``g``: ``(params, number of parameters, loss curve)``."""
    t = g["targets"]
    q = len(t.queries)
    rng, k_init = jax.random.split(jax.random.key(seed))
    epoch_fn, params, batch_size = _setup(
        config, g, scorer=scorer, output=output, dim=dim, components=components, key=k_init
    )
    lr = config.optim.learning_rate
    n_params = count_params(params)
    params, _, curve = sweep.train_epochs(
        epoch_fn, params, sweep.adam(lr).init(params), rng, jnp.asarray(t.queries),
        jnp.asarray(t.objects), num_epochs=config.schedule.epochs, log_every=config.log.every,
        examples_per_epoch=q, steps_per_epoch=-(-q // batch_size), options=options,
    )  # fmt: skip
    return params, n_params, curve


def _evaluate(g, score, config) -> dict[str, float]:
    fit = kge.train_fit_metrics(
        score, g["targets"], num_entities=g["E"], batch_size=config.eval.batch_size
    )
    ranks = rank_triples(
        score, g["test"], g["known"], num_relations=g["R"], batch_size=config.eval.batch_size
    )
    test = rank_metrics(ranks["realistic"], ks=(1, 3, 10))
    out = {f"train_{k}": float(v) for k, v in fit.items()}
    out.update({f"test_{k}": float(v) for k, v in test.items()})
    out["test_nll"] = float(-np.mean(ranks["log_prob"]))
    return out


def _run_cell(g, cell, config, options) -> dict[str, Any]:
    t0 = time.time()
    if cell["kind"] == "ensemble":
        members, curves, n_params = [], [], 0
        for i in range(cell["K"]):
            params, n, curve = _train(
                config,
                g,
                scorer=cell["scorer"],
                output="softmax",
                dim=cell["d"],
                components=1,
                seed=config.seed + 1000 * i,
                options=options,
            )
            members.append(params)
            curves.append(curve)
            n_params += n
        score = jax.tree_util.Partial(_ensemble_score_fn(cell["scorer"]), members)
        curve = [
            (e, float(np.mean([c[j][1] for c in curves]))) for j, (e, _) in enumerate(curves[0])
        ]
    else:
        params, n_params, curve = _train(
            config,
            g,
            scorer=cell["scorer"],
            output=cell["output"],
            dim=cell["d"],
            components=cell["K"],
            seed=config.seed,
            options=options,
        )
        score = jax.tree_util.Partial(_score_fn(cell["scorer"], cell["output"]), params)
    result = dict(cell)
    result.update(_evaluate(g, score, config))
    result["params"] = n_params
    result["curve"] = curve
    result["seconds"] = time.time() - t0
    return result


# --------------------------------------------------------------------------------------------
# The cells of the experiment


def _cells(config, graphs) -> list[dict[str, Any]]:
    cells = []
    m = config.model
    for name, g in graphs.items():
        if g["synthetic"]:
            scorers, comps, group = (m.synthetic_scorer,), m.synthetic_components, "synthetic"
        else:
            scorers, comps, group = m.scorers, m.components, "sweep"
        for scorer in scorers:
            for d in m.dims:
                for k in comps:
                    output = "softmax" if k == 1 else "mos"
                    cells.append(
                        dict(
                            group=group,
                            dataset=name,
                            scorer=scorer,
                            kind=output,
                            output=output,
                            d=d,
                            K=k,
                        )
                    )
            if g["synthetic"]:
                continue
            d, k = m.baseline_dim, m.baseline_components
            for b in m.baselines:
                if b == "ensemble":
                    cells.append(
                        dict(
                            group="baseline",
                            dataset=name,
                            scorer=scorer,
                            kind="ensemble",
                            output="softmax",
                            d=d,
                            K=k,
                        )
                    )
                    continue
                output = _OUTPUTS_OF_BASELINE[b]
                cell = dict(
                    group="baseline", dataset=name, scorer=scorer, kind=b, output=output, d=d, K=1
                )
                if b == "mol":
                    cell["K"] = k
                if b == "matched":  # linear softmax with the parameter count of MoS(d, K)
                    extra = k * (d * d + 2 * d)
                    d2 = d + max(1, round(extra / (g["E"] + 2 * g["R"])))
                    if scorer == "complex" and d2 % 2:
                        d2 += 1
                    cell["d"] = d2
                cells.append(cell)
    for c in cells:
        c["id"] = f"{c['group']}-{c['dataset']}-{c['scorer']}-{c['kind']}-d{c['d']}-K{c['K']}"
    return cells


# --------------------------------------------------------------------------------------------


def _compute_cell(graphs, cell, config, i, n, options) -> dict[str, Any]:
    result = _run_cell(graphs[cell["dataset"]], cell, config, options)
    logging.info(
        "kge [%d/%d] %s: train NLL %.3f MRR %.3f perfect %.3f, test MRR %.3f (%.1fs)",
        i + 1, n, cell["id"], result["train_nll"], result["train_mrr"],
        result["train_perfect"], result["test_mrr"], result["seconds"],
    )  # fmt: skip
    jax.clear_caches()  # hundreds of small compilations: keep the memory bounded
    return result


def run(config, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs every cell (resuming finished ones) and writes the outputs into ``workdir``."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    workdir = os.fspath(workdir)
    common.write_config_json(workdir, config)
    t0 = time.time()
    graphs = _load_graphs(config)
    bounds = {
        n: kge.linear_output_dim_bound(g["train"], num_entities=g["E"], num_relations=g["R"])
        for n, g in graphs.items()
    }
    cells = _cells(config, graphs)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume, log_metrics=False)
    results = []
    for i, cell in enumerate(cells):
        results.append(
            store.get(
                cell["id"],
                functools.partial(_compute_cell, graphs, cell, config, i, len(cells), options),
            )
        )

    writer = common.MetricWriter(workdir, tensorboard=config.log.tensorboard)
    epochs = sorted({e for r in results for e, _ in r["curve"]})
    for e in epochs:
        record = {f"{r['id']}/loss": v for r in results for ep, v in r["curve"] if ep == e}
        if e == epochs[-1]:
            for r in results:
                for k in ("train_nll", "train_mrr", "train_perfect", "test_mrr", "test_hits@10"):
                    record[f"{r['id']}/{k}"] = r[k]
        writer.write(e, record)
    writer.close()

    checks, summary = kge_report.trend_checks(config, graphs, results, bounds)
    plots = kge_report.plots(workdir, config, graphs, results, bounds)
    text = kge_report.results_md(config, graphs, results, bounds, checks)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(
            "# Rank bottleneck in KGEs: linear vs mixture-of-softmaxes output (P4)\n\n"
            + text
            + "\n"
        )
    out = {
        "checks": {c["criterion"]: c["reproduced"] for c in checks},
        "bounds": {n: b["sign_rank_bound"] for n, b in bounds.items()},
        "synthetic_d_star": summary.get("synthetic_d_star", {}),
        "cells": len(results),
        "plots": [os.path.basename(p) for p in plots],
        "runtime_s": time.time() - t0,
    }
    common.write_json(
        os.path.join(workdir, "results.json"),
        {**out, "results": results, "graphs": bounds, "gains": summary.get("gains", {})},
    )
    return out
