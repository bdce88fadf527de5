"""Benchmark: lowrank_jax.kge vs PyKEEN, DistMult and ComplEx on Nations, UMLS and Kinships.

``python -m experiments.bench.kge_vs_pykeen`` trains the same model on both sides with the same
regime and compares filtered test metrics and training throughput:

* 1-N training (PyKEEN's LCWA) with inverse relations, softmax cross-entropy against the
  label-normalised multi-hot targets (PyKEEN's ``CrossEntropyLoss``), Adam, the same embedding
  dimension (``--dim`` real dimensions; PyKEEN's ComplEx gets ``dim/2`` complex ones), epochs,
  batch size (queries per step), learning rate and initial embedding scale (``N(0, s^2)`` for every
  real coordinate, ``s = dim^{-1/4}``);
* no regulariser and no entity normalisation on either side (PyKEEN's DistMult defaults to both;
  they are switched off to match);
* evaluation: filtered ranks of both sides against train + valid + test, realistic ranks (mean of
  optimistic and pessimistic), MRR and Hits@10 (PyKEEN's ``RankBasedEvaluator``).

Throughput is training triples per second (original training triples x epochs / training wall
time), given both including our first epoch (which compiles) and at steady state (epochs 2..n);
PyKEEN's ``train`` call is timed as a whole. Both sides use the same number of CPU threads.
The table prints per dataset and model; the LAST line is a JSON object with the headline figures.

Needs the ``peers`` extra (``pip install -e ".[test,peers]"``: torch==2.13.0, pykeen==1.11.1);
without it the benchmark prints why and exits with status 0.

Default run: about 5-10 minutes on 2 shared CPU cores. ``--quick`` (Nations, DistMult, 3 epochs)
takes seconds.

Example::

    python -m experiments.bench.kge_vs_pykeen
    python -m experiments.bench.kge_vs_pykeen --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench import common
from lowrank_jax import kge
from lowrank_jax.data import load_kg
from lowrank_jax.kge.metrics import rank_metrics, rank_triples
from lowrank_jax.kge.training import init_kge, make_train_epoch


def _missing_peers() -> str | None:
    for name in ("torch", "pykeen"):
        if importlib.util.find_spec(name) is None:
            return (
                f"{name} is not installed; install the peers extra with "
                '`pip install -e ".[test,peers]"` (torch==2.13.0, pykeen==1.11.1)'
            )
    return None


def _init_std(dim: int) -> float:
    return dim**-0.25


def run_ours(kg_data, *, scorer: str, dim: int, epochs: int, batch_size: int, lr: float, seed: int):
    """Trains and evaluates our model; returns metrics and timings."""
    e, r = kg_data.num_entities, kg_data.num_relations
    targets = kge.build_query_targets(
        kge.add_inverse_triples(kg_data.train, num_relations=r), num_entities=e
    )
    key = jax.random.key(seed)
    key, k_init = jax.random.split(key)
    params = init_kge(
        k_init,
        scorer=scorer,
        output="softmax",
        num_entities=e,
        num_relations=r,
        dim=dim,
        init_std=_init_std(dim),
    )
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(params)
    epoch_fn = make_train_epoch(
        optimizer,
        scorer=scorer,
        output="softmax",
        num_entities=e,
        num_queries=len(targets.queries),
        batch_size=batch_size,
    )
    queries, objects = jnp.asarray(targets.queries), jnp.asarray(targets.objects)
    t0 = time.perf_counter()
    t_first = None
    for epoch in range(epochs):
        key, k_epoch = jax.random.split(key)
        params, opt_state, loss = epoch_fn(params, opt_state, k_epoch, queries, objects)
        if epoch == 0:
            loss.block_until_ready()
            t_first = time.perf_counter()
    jax.block_until_ready(params)
    t_end = time.perf_counter()
    known = kge.build_query_targets(
        kge.add_inverse_triples(
            np.concatenate([kg_data.train, kg_data.valid, kg_data.test]), num_relations=r
        ),
        num_entities=e,
    )
    score = jax.tree_util.Partial(partial(kge.kge_scores, scorer=scorer, output="softmax"), params)
    ranks = rank_triples(score, kg_data.test, known, num_relations=r, batch_size=512)
    metrics = rank_metrics(ranks["realistic"], ks=(1, 3, 10))
    n = len(kg_data.train)
    return {
        "mrr": metrics["mrr"],
        "hits@10": metrics["hits@10"],
        "final_loss": float(loss),
        "train_s": t_end - t0,
        "throughput": n * epochs / (t_end - t0),
        "throughput_steady": n * (epochs - 1) / max(t_end - t_first, 1e-9) if epochs > 1 else None,
        "queries": len(targets.queries),
    }


def run_pykeen(
    kg_data, *, scorer: str, dim: int, epochs: int, batch_size: int, lr: float, seed: int
):
    """Trains and evaluates the PyKEEN model with the matched regime; returns metrics and timings."""
    import torch
    from pykeen.evaluation import RankBasedEvaluator
    from pykeen.losses import CrossEntropyLoss
    from pykeen.models import ComplEx, DistMult
    from pykeen.regularizers import Regularizer
    from pykeen.training import LCWATrainingLoop
    from pykeen.triples import CoreTriplesFactory, LCWAInstances

    torch.manual_seed(seed)
    e, r = kg_data.num_entities, kg_data.num_relations
    train_tf = CoreTriplesFactory(
        torch.as_tensor(kg_data.train, dtype=torch.long),
        num_entities=e,
        num_relations=r,
        create_inverse_triples=True,
    )
    std = _init_std(dim)
    if scorer == "distmult":
        init = partial(torch.nn.init.normal_, std=std)
        model = DistMult(
            triples_factory=train_tf,
            embedding_dim=dim,
            entity_initializer=init,
            relation_initializer=init,
            entity_constrainer=None,
            regularizer=None,
            loss=CrossEntropyLoss(),
            random_seed=seed,
        )
    else:
        # PyKEEN applies the initializer to the real view (..., 2) of the complex embedding, so
        # std is already the standard deviation of each of Re and Im (checked: "init std" printed).
        init = partial(torch.nn.init.normal_, std=std)
        model = ComplEx(
            triples_factory=train_tf,
            embedding_dim=dim // 2,
            entity_initializer=init,
            relation_initializer=init,
            regularizer=None,
            loss=CrossEntropyLoss(),
            random_seed=seed,
        )
    entity = model.entity_representations[0](indices=None).detach()
    entity_std = float(torch.view_as_real(entity).std() if entity.is_complex() else entity.std())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loop = LCWATrainingLoop(model=model, triples_factory=train_tf, optimizer=optimizer)
    t0 = time.perf_counter()
    losses = loop.train(
        triples_factory=train_tf,
        num_epochs=epochs,
        batch_size=batch_size,
        use_tqdm=False,
        use_tqdm_batch=False,
        drop_last=False,
    )
    train_s = time.perf_counter() - t0
    evaluator = RankBasedEvaluator(filtered=True)
    results = evaluator.evaluate(
        model,
        torch.as_tensor(kg_data.test, dtype=torch.long),
        additional_filter_triples=[
            torch.as_tensor(kg_data.train, dtype=torch.long),
            torch.as_tensor(kg_data.valid, dtype=torch.long),
        ],
        batch_size=512,
        use_tqdm=False,
    )
    n = len(kg_data.train)
    return {
        "mrr": float(results.get_metric("both.realistic.inverse_harmonic_mean_rank")),
        "hits@10": float(results.get_metric("both.realistic.hits_at_10")),
        "final_loss": float(losses[-1]),
        "train_s": train_s,
        "throughput": n * epochs / train_s,
        "queries": len(LCWAInstances.from_triples_factory(train_tf)),
        "init_std": entity_std,
        "regularized": any(isinstance(m, Regularizer) for m in model.modules()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default="nations,umls,kinships")
    parser.add_argument("--models", default="distmult,complex")
    parser.add_argument("--dim", type=int, default=64, help="real embedding dimension")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=512, help="queries per step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="Nations, DistMult, 3 epochs")
    args = parser.parse_args(argv)
    if args.quick:
        args.datasets, args.models, args.epochs = "nations", "distmult", 3

    missing = _missing_peers()
    if missing is not None:
        print(f"kge_vs_pykeen skipped: {missing}.")
        out = {"skipped": missing}
        print(json.dumps(out))
        return out

    import torch

    threads = common.num_threads()
    torch.set_num_threads(threads)
    settings = {
        "dim": args.dim,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads": threads,
        "loss": "LCWA softmax cross-entropy, inverse relations, Adam, no regularizer",
    }
    print(f"settings: {settings}")
    rows, headline = [], {"settings": settings, "mrr": {}, "hits@10": {}, "throughput_ratio": {}}
    steady_ratios = {}
    for name in args.datasets.split(","):
        kg_data = load_kg(name)
        for scorer in args.models.split(","):
            kw = dict(
                scorer=scorer,
                dim=args.dim,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                seed=args.seed,
            )
            ours = run_ours(kg_data, **kw)
            peer = run_pykeen(kg_data, **kw)
            if ours["queries"] != peer["queries"]:
                print(
                    f"warning: {name}: {ours['queries']} queries here, {peer['queries']} in PyKEEN"
                )
            key = f"{name}/{scorer}"
            ratio = ours["throughput"] / peer["throughput"]
            headline["mrr"][key] = {"ours": ours["mrr"], "pykeen": peer["mrr"]}
            headline["hits@10"][key] = {"ours": ours["hits@10"], "pykeen": peer["hits@10"]}
            headline["throughput_ratio"][key] = ratio
            if ours["throughput_steady"] is not None:
                steady_ratios[key] = ours["throughput_steady"] / peer["throughput"]
            rows.append(
                [
                    name,
                    scorer,
                    ours["mrr"],
                    peer["mrr"],
                    ours["hits@10"],
                    peer["hits@10"],
                    ours["final_loss"],
                    peer["final_loss"],
                    ours["throughput"],
                    ours["throughput_steady"] or float("nan"),
                    peer["throughput"],
                    ratio,
                ]
            )
            print(
                f"{key}: MRR {ours['mrr']:.4f} vs {peer['mrr']:.4f}, "
                f"{ours['throughput']:.0f} vs {peer['throughput']:.0f} triples/s "
                f"(x{ratio:.1f}); PyKEEN init std {peer['init_std']:.3f}, "
                f"regularized={peer['regularized']}",
                flush=True,
            )
    print()
    print(
        common.markdown_table(
            [
                "dataset",
                "model",
                "MRR ours",
                "MRR PyKEEN",
                "H@10 ours",
                "H@10 PyKEEN",
                "final loss ours",
                "final loss PyKEEN",
                "triples/s ours",
                "triples/s ours (steady)",
                "triples/s PyKEEN",
                "speed-up",
            ],
            rows,
        )
    )
    ratios = list(headline["throughput_ratio"].values())
    headline["throughput_ratio_min"] = min(ratios)
    headline["throughput_ratio_steady_min"] = min(steady_ratios.values()) if steady_ratios else None
    headline["mrr_ours_ge_pykeen"] = {
        k: v["ours"] >= v["pykeen"] for k, v in headline["mrr"].items()
    }
    headline["mrr_diff_mean"] = float(
        np.mean([v["ours"] - v["pykeen"] for v in headline["mrr"].values()])
    )
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main(sys.argv[1:])
