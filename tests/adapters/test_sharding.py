"""Sharded LoRA training on 8 fake CPU devices equals the 1-device run."""

import json
import subprocess
import sys

import numpy as np
from jax.sharding import PartitionSpec as P

from lowrank_jax import adapters as A


def _run(devices: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.adapters.sharded_step", str(devices)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_eight_devices_equal_one():
    one, eight = _run(1), _run(8)
    assert eight["b_spec"] == str(P(None, "model"))  # B of 'up' stays split over 'model'
    np.testing.assert_allclose(eight["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    assert eight["losses"][-1] < eight["losses"][0]


def test_partition_specs_follow_kernel_layout():
    import jax.numpy as jnp

    params = {"stack": jnp.ones((3, 4, 2, 5)), "w": jnp.ones((4, 6))}
    ad = A.init(
        __import__("jax").random.key(0),
        params,
        [("stack", A.lora(2, in_ndim=1, out_ndim=2)), ("w", A.lora(2))],
    )
    specs = A.partition_specs(ad, {"stack": P("layers", "fsdp", "tp", None), "w": None})
    assert specs["stack"].factors == {"a": P("layers", "fsdp", None), "b": P("layers", None, "tp")}
    assert specs["w"].factors == {"a": P(None, None), "b": P(None, None)}


def test_partition_specs_for_kinds_with_vector_factors():
    import jax
    import jax.numpy as jnp

    params = {"w": jnp.ones((8, 6)), "st": jnp.ones((3, 8, 6))}
    rules = [("w", A.spectral(2)), ("st", A.spectral(2, in_ndim=1, out_ndim=1))]
    ad = A.init(jax.random.key(0), params, rules)
    specs = A.partition_specs(ad, {"w": P("fsdp", "tp"), "st": P("layers", "fsdp", "tp")})
    assert specs["w"].factors == {"u": P("fsdp", None), "s": P(None), "v": P("tp", None)}
    assert specs["st"].factors["s"] == P("layers", None)
