r"""What the pre-trained-ViT continual benchmarks cost at the papers' scale (#47), without running
them: XLA's FLOPs per training step, memory per device, and the estimated wall time of each
benchmark on a TPU v5e-8 and on one H100 at a stated utilisation.

For each benchmark of ``configs/saber.py`` (``cifar100_10``, ``imagenet_r_5/10/20``,
``domainnet_5``) at its full configuration (ViT-B/16 at 224x224, batch 128, InfLoRA's epochs and
ranks; no checkpoint or data is read: the shapes are ViT-B/16's) and each method:

* ``train_gflop``: XLA's cost analysis of the lowered training step of the unrolled model (a
  layer under ``nn.scan`` would be counted once) (the global program on one
  device: forward, backward to the adapters, the optimizer), GFLOP per step;
* ``forward_gflop``: one forward pass of a batch of 128 (the evaluation and the end-of-task
  feature passes);
* ``steps``: ``tasks x epochs x floor(train images per task / 128)`` with the train split sizes
  of :data:`TRAIN_IMAGES`; ``forwards``: the test images evaluated after every task
  (``N_test (T + 1) / 2`` for equal tasks) plus one pass over each task's training images (the
  methods' end-of-task features and memories);
* ``v5e8_minutes`` and ``h100_minutes``: total FLOPs over ``devices x peak x utilisation``, with the
  peak dense bf16 of a v5e chip (197 TFLOP/s; XLA on TPU runs float32 matmuls in bf16 passes at
  its default precision) and an H100 SXM's TF32 peak (495 TFLOP/s, float32 matmuls at JAX's
  default precision on GPU); the data parallel step on 8 chips is taken to scale perfectly.

``--memory`` also compiles the step on the CPU for one device at batch 128 (one H100) and 16
(one v5e chip of eight under data parallelism) and reports XLA's memory analysis (arguments,
outputs and temporaries); the CPU backend's buffer assignment, not the TPU's or GPU's.

Not in the estimate: decoding and augmenting JPEGs on the host (InfLoRA's transforms, on the
host's threads), checkpointing and compilation. Command::

    python -m experiments.bench.paper_scale                      # SABER on the five benchmarks
    python -m experiments.bench.paper_scale --methods every --benchmarks imagenet_r_10 --memory

Prints a markdown table and, as the last line, a JSON of the rows.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from configs import saber
from experiments import common
from experiments.common.continual_backbones import make_model
from experiments.common.continual_methods import METHODS, program_steps
from experiments.common.continual_setup import stream_shapes

# (train, test) images of each dataset: CIFAR-100 (TFDS), ImageNet-R's 80/20 split of its 30,000
# images (lowrank_jax.data.tfds_images), DomainNet's six domains (its own split, 409,832 /
# 176,743 images)
TRAIN_IMAGES = {
    "cifar100": (50_000, 10_000),
    "imagenet_r": (24_000, 6_000),
    "domainnet": (409_832, 176_743),
}
BENCHMARKS = ("cifar100_10", "imagenet_r_5", "imagenet_r_10", "imagenet_r_20", "domainnet_5")
PEAKS = {"v5e8": (8, 197e12), "h100": (1, 495e12)}  # devices, peak FLOP/s per device


def _dataset(benchmark: str) -> str:
    return benchmark.rsplit("_", 1)[0]


def _flops(lowered: Any) -> float:
    analysis = lowered.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, Sequence) else analysis
    return float(analysis["flops"])


def _memory(step: Any) -> float:
    """XLA's memory analysis (arguments + outputs + temporaries, GB) of the compiled step."""
    m = step.fn.lower(*step.args, **step.kwargs).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return (total - m.alias_size_in_bytes) / 1e9


def _forward_flops(config: Any, batch: int) -> float:
    shapes = stream_shapes(config)
    model = make_model(config, shapes["num_classes"])
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shapes["x"])))
    x = jax.ShapeDtypeStruct((batch, *shapes["x"]), jnp.float32)
    return _flops(jax.jit(model.apply).lower(variables, x))


def row(benchmark: str, method: str, *, utilisation: float, memory: bool) -> dict[str, Any]:
    """The cost of ``method`` on ``benchmark`` at its full configuration (module docstring)."""
    config = saber.get_config(f"benchmark={benchmark},method={method}")
    config.model.scan_layers = False  # XLA's cost analysis counts a scanned layer once
    b, tasks = config.data.batch_size, config.data.num_tasks
    (train_step,) = program_steps(config, common.make_mesh())
    train_flops = _flops(train_step.fn.lower(*train_step.args, **train_step.kwargs))
    train, test = TRAIN_IMAGES[_dataset(benchmark)]
    steps = tasks * config.schedule.epochs_per_task * (train // tasks // b)
    forwards = test * (tasks + 1) / 2 + train
    forward_flops = _forward_flops(config, b)
    total = steps * train_flops + forwards / b * forward_flops
    out = {
        "benchmark": benchmark,
        "method": method,
        "train_gflop": train_flops / 1e9,
        "forward_gflop": forward_flops / 1e9,
        "steps": steps,
        "forwards": int(forwards),
        "total_pflop": total / 1e15,
    }
    for name, (devices, peak) in PEAKS.items():
        out[f"{name}_minutes"] = total / (devices * peak * utilisation) / 60
    if memory:
        for name, per_device in (("h100", b), ("v5e8", b // 8)):
            config.data.batch_size = per_device
            (step,) = program_steps(config, common.make_mesh())
            out[f"{name}_memory_gb"] = _memory(step)
    return out


def table(rows: Sequence[dict[str, Any]], utilisation: float) -> str:
    keys = [k for k in rows[0] if k not in ("benchmark", "method")]
    lines = [
        f"Utilisation {utilisation:.0%} of the peak (v5e: 197 TFLOP/s bf16 per chip, 8 chips; "
        "H100 SXM: 495 TFLOP/s TF32).",
        "",
        "| benchmark | method | " + " | ".join(keys) + " |",
        "| --- | --- |" + " ---: |" * len(keys),
    ]
    for r in rows:
        cells = [f"{r[k]:,.3g}" if isinstance(r[k], float) else f"{r[k]:,}" for k in keys]
        lines.append(f"| {r['benchmark']} | {r['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    p.add_argument("--methods", default="saber", help="comma-separated, or 'every'")
    p.add_argument("--utilisation", type=float, default=0.4)
    p.add_argument("--memory", action="store_true", help="compile on the CPU for XLA's memory")
    args = p.parse_args(argv)
    methods = METHODS if args.methods == "every" else tuple(args.methods.split(","))
    if not 0 < args.utilisation <= 1 or not math.isfinite(args.utilisation):
        p.error(f"--utilisation must lie in (0, 1]; got {args.utilisation}")
    rows = [
        row(b, m, utilisation=args.utilisation, memory=args.memory)
        for b in args.benchmarks.split(",")
        for m in methods
    ]
    print(table(rows, args.utilisation))
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
