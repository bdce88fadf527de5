"""Data parallelism over all devices with ``jax.sharding``: one code path for 1 CPU to a TPU pod.

The mesh is one-dimensional, axis ``"data"``, over every device of every process. Batches are
split along their leading axis over ``"data"``; parameters are replicated, or FSDP-sharded (each
large leaf split along one axis over ``"data"``) when ``config.parallel.fsdp`` is true. XLA's SPMD
partitioner inserts the all-reduces and all-gathers, so a step function written for one device
runs unchanged on many and gives the same numbers up to float summation order.

Multi-host: call :func:`initialize_distributed` first (``config.parallel.distributed=True``); every
process then builds the same global batch from the same data order and :func:`shard_batch` keeps
the rows that belong to its own devices.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "DATA_AXIS",
    "batch_sharding",
    "initialize_distributed",
    "make_mesh",
    "param_sharding",
    "place",
    "put_global",
    "replicated",
    "shard_batch",
    "sync_processes",
]

DATA_AXIS = "data"


def initialize_distributed(config: Any) -> None:
    """Calls ``jax.distributed.initialize()`` when ``config.parallel.distributed`` is true.

    Must run before any other JAX call. On Cloud TPU and SLURM/Open MPI clusters the coordinator
    address and process ids are detected automatically (see ``jax.distributed.initialize``).
    Elsewhere (several GPU hosts, or several processes on one machine) set, for each process,
    ``JAX_COORDINATOR_ADDRESS=<host of process 0>:<port>``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` (and optionally ``JAX_HEARTBEAT_TIMEOUT_SECONDS``, default 100: how long
    the survivors wait before a dead process stops the job). On CPU the processes exchange data
    through gloo collectives. Configs without a ``parallel`` section run single-process.
    """
    parallel = config.get("parallel", None) if hasattr(config, "get") else None
    if parallel is not None and parallel.get("distributed", False):
        kwargs = {}
        if "JAX_NUM_PROCESSES" in os.environ:
            kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
        if "JAX_PROCESS_ID" in os.environ:
            kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
        if "JAX_HEARTBEAT_TIMEOUT_SECONDS" in os.environ:  # how soon a dead peer is noticed
            kwargs["heartbeat_timeout_seconds"] = int(os.environ["JAX_HEARTBEAT_TIMEOUT_SECONDS"])
        if jax.config.jax_platforms in (None, "", "cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**kwargs)
        logging.info(
            "jax.distributed: process %d of %d, %d local / %d global devices",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )


_BARRIERS = [0]  # barriers passed so far: every process counts the same, so names stay unique


def sync_processes(name: str, *, timeout_s: int = 3600) -> None:
    """Waits until every process reaches this point (a no-op with one process).

    Uses the JAX coordination service (``wait_at_barrier``, through orbax), not a collective:
    gloo gives up on a peer that joins a collective more than about 30 s late, so ``fit`` waits
    here after compiling its step and before running it (one process may compile much slower).

    Raises:
      jax.errors.JaxRuntimeError: a process did not arrive within ``timeout_s`` seconds.
    """
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    _BARRIERS[0] += 1
    barrier = multihost.get_barrier_sync_fn()
    barrier(key=f"lowrank_jax_{name}_{_BARRIERS[0]}", timeout_ms=timeout_s * 1000)


def make_mesh(devices: Any = None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: all devices of all processes)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Splits the leading (batch) axis over ``"data"``; usable as a pytree prefix for a batch."""
    return NamedSharding(mesh, P(DATA_AXIS))


def _fsdp_spec(shape: tuple[int, ...], n: int, min_size: int) -> P:
    if n == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    # The largest axis that divides evenly; ties go to the last axis (the output features of a
    # Dense kernel), which keeps the all-gather contiguous.
    best = None
    for axis, size in enumerate(shape):
        if size % n == 0 and (best is None or size >= shape[best]):
            best = axis
    if best is None:
        return P()
    spec = [None] * len(shape)
    spec[best] = DATA_AXIS
    return P(*spec)


def param_sharding(mesh: Mesh, tree: Any, *, fsdp: bool = False, min_size: int = 2**14) -> Any:
    """Shardings for a pytree of parameters (or optimizer state): replicated, or FSDP.

    Args:
      mesh: a mesh with axis ``"data"`` (:func:`make_mesh`).
      tree: pytree of arrays or ``jax.ShapeDtypeStruct``.
      fsdp: if true, every leaf with at least ``min_size`` elements is split along its largest
        axis divisible by the number of devices (small leaves and scalars stay replicated).
      min_size: leaves smaller than this are replicated even under FSDP.

    Returns:
      A pytree of ``NamedSharding`` with the structure of ``tree``.
    """
    n = mesh.shape[DATA_AXIS]
    if not fsdp:
        return jax.tree.map(lambda _: replicated(mesh), tree)
    return jax.tree.map(
        lambda x: NamedSharding(mesh, _fsdp_spec(tuple(np.shape(x)), n, min_size)), tree
    )


def put_global(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works when the shardings span processes.

    Every process must hold the same full value of ``tree`` (e.g. the same initialisation from the
    same seed); each process places the shards its own devices hold. With one process this is
    ``jax.device_put``. PRNG key leaves are placed through their key data.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding))
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def place(mesh: Mesh, state: Any, frozen: Any, *, fsdp: bool = False) -> tuple[Any, Any]:
    """Puts a train state and its frozen arrays on ``mesh`` as ``fit`` trains them: replicated,
    or FSDP-sharded with ``fsdp`` (:func:`param_sharding`); logs how many arrays are sharded.

    Returns:
      ``((state, state_shardings), (frozen, frozen_shardings))``, the arrays placed.
    """
    state_sh = param_sharding(mesh, state, fsdp=fsdp)
    frozen_sh = param_sharding(mesh, frozen, fsdp=fsdp)
    leaves = jax.tree.leaves((state_sh, frozen_sh))
    logging.info(
        "Mesh of %d devices; batches split over 'data'; %d of %d parameter/state arrays sharded "
        "(fsdp=%s), the rest replicated.",
        mesh.size,
        sum(not s.is_fully_replicated for s in leaves),
        len(leaves),
        fsdp,
    )
    return (put_global(state, state_sh), state_sh), (put_global(frozen, frozen_sh), frozen_sh)


def shard_batch(mesh: Mesh, batch: Any) -> Any:
    """Puts a global host batch on the mesh, split along the leading axis.

    Every process passes the same global batch (numpy arrays with a leading batch axis divisible
    by the number of devices); each keeps only the rows its own devices hold, so this works
    unchanged on one host or many.

    Args:
      mesh: a mesh with axis ``"data"``.
      batch: pytree of arrays, each of shape ``(b, ...)`` with ``b % mesh.size == 0``.

    Returns:
      The same pytree of global ``jax.Array`` sharded with :func:`batch_sharding`.

    Raises:
      ValueError: if the batch size is not a multiple of the number of devices.
    """
    sharding = batch_sharding(mesh)
    n = mesh.shape[DATA_AXIS]

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % n:
            raise ValueError(
                f"batch of {x.shape[0]} rows cannot be split over {n} devices: "
                f"use a batch size that is a multiple of {n}"
            )
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        rows = [idx[0] for idx in sharding.addressable_devices_indices_map(x.shape).values()]
        start = min(r.start or 0 for r in rows)
        stop = max(x.shape[0] if r.stop is None else r.stop for r in rows)
        return jax.make_array_from_process_local_data(sharding, x[start:stop], x.shape)

    return jax.tree.map(put, batch)
