"""Where the peak RSS of one adapter step is held: RSS per phase, one process per method.

    python docs/notes/scripts/adapter_rss_phases.py [--batch 64] [--methods lora-fused,lora-quax,full,peft]

Each method runs alone in a fresh subprocess (``--one NAME``) that records RSS (MiB) after:
python + numpy, ``import jax`` and the CPU client, ``import torch`` (PEFT only, or every method
with ``--both``), the block's parameters, adapters and batch (JAX arrays), the compiled step (JAX)
or the PEFT model plus its first step (which creates Adam's state), and the peak while two
further steps run (sampled every 5 ms, ``common.PeakRSS``) and the RSS after them. The shape is
the benchmark's (``experiments.bench.adapter_step``: d=1024, mlp 4096, 16 heads, r=8, seq 128).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

MB = 1 << 20


def one(name: str, batch: int, both: bool) -> dict:
    import numpy as np  # noqa: F401

    from experiments.bench import common

    phases = {"python+numpy": common.rss_bytes()}
    import jax
    import jax.numpy as jnp

    jnp.zeros(()).block_until_ready()
    phases["import jax + CPU client"] = common.rss_bytes()
    if name == "peft" or both:
        import torch  # noqa: F401

        phases["import torch"] = common.rss_bytes()
    from experiments.bench import adapter_step as bench
    from lowrank_jax import adapters

    args = bench.parse_args(["--batch", str(batch), "--depths", ""])
    kx, ky, kp, ka = jax.random.split(jax.random.key(args.seed), 4)
    x = jax.random.normal(kx, (args.batch, args.seq, args.d), jnp.float32)
    y = jax.random.normal(ky, (args.batch, args.seq, args.d), jnp.float32)
    model = bench.make_model(args)
    variables = model.init(kp, x[:1])
    rules = [(bench.RULES_PATTERN, adapters.lora(rank=args.rank, alpha=args.alpha))]
    ad = adapters.init(ka, variables, rules)
    jax.block_until_ready((x, y, variables, ad))
    phases["params + adapters + batch"] = common.rss_bytes()
    if name == "peft":
        method = bench.build_peft_method(args, variables, ad, x, y)
        phases["PEFT model + first step"] = common.rss_bytes()
    else:
        (method,) = bench.build_jax_methods(args, model, variables, ad, x, y, names=[name])
        phases["compiled step"] = common.rss_bytes()
    del variables, ad  # what the step needs is held by the method
    common.trim_malloc()
    peak = 0
    for _ in range(2):
        with common.PeakRSS() as rss:
            method.run()
        peak = max(peak, rss.peak)
    phases["peak during step"] = peak
    common.trim_malloc()
    phases["after steps"] = common.rss_bytes()
    st = method.stats
    return {
        "method": name,
        "phases_mib": {k: round(v / MB, 1) for k, v in phases.items()},
        "xla_temp_mib": None if st is None else round(st.temp / MB, 1),
        "xla_args_mib": None if st is None else round(st.argument / MB, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--methods", default="lora-fused,lora-quax,full,peft")
    p.add_argument("--both", action="store_true", help="import torch in the JAX processes too")
    p.add_argument("--one", default=None)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.batch, a.both)))
        return
    for name in a.methods.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--batch",
            str(a.batch),
        ]
        cmd += ["--both"] if a.both else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
