"""K-FAC statistics of the kernels an adapter rule list targets, from per-example gradients.

:func:`kfac_statistics` runs ``jax.vmap(jax.grad(...))`` over single examples with a *statistics
probe* on every targeted kernel: the probe (an adapter kind that adds zero to the layer's output)
has a custom VJP that returns, per example, ``Σ_t a_t g_tᵀ`` (the kernel gradient), ``Σ_t a_t a_tᵀ``
(K-FAC's input factor), ``Σ_t g_t ⊙ g_t`` (the diagonal output Fisher) and the token count, where
``a_t`` is the layer input and ``g_t`` the loss gradient at its output for token ``t``. It works
for any model and kernel layout that :func:`lowrank_jax.adapters.adapt` supports (including
``nn.scan``-stacked kernels); tokens are all the positions the layer sees (padding included).
The data-aware initialisers (:mod:`lowrank_jax.adapters.initializers`: LoRA-DA, LoRA-One, LoRA-GA,
EVA) are built on it.

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate Curvature",
  ICML 2015 (the input factor); P6 LoRA-DA, arXiv 2510.24561 (its use for initialisation).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.adapt import adapt
from lowrank_jax.adapters.core import init as init_adapters
from lowrank_jax.adapters.kinds import AdapterKind, LoRA

LossFn = Callable[[Callable[..., Any], Any], jax.Array]

__all__ = ["KFACStats", "batch_size", "check_lora_rules", "kfac_statistics"]


class KFACStats(NamedTuple):
    """Per-kernel statistics (leading axes: the kernel's stacked layers, if any).

    Attributes:
      grad: ``(n, m)`` mean loss gradient ``G`` w.r.t. the kernel's matrix view.
      z: ``(n, n)`` K-FAC input factor ``E_tokens[a aᵀ]``.
      f: ``(m,)`` diagonal output Fisher ``E_tokens[g ⊙ g]``.
      tokens: ``()`` number of tokens the averages are over.
    """

    grad: jax.Array
    z: jax.Array
    f: jax.Array
    tokens: jax.Array


# --- the statistics probe -------------------------------------------------------------------------


@jax.custom_vjp
def _probe(g: jax.Array, z: jax.Array, f: jax.Array, t: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.zeros((*x.shape[:-1], f.shape[-1]), x.dtype)


def _probe_fwd(g, z, f, t, x):
    return _probe(g, z, f, t, x), (x, g, z, f, t)


def _probe_bwd(res, ct):
    x, g, z, f, t = res
    xf = jnp.reshape(x, (-1, x.shape[-1])).astype(z.dtype)
    cf = jnp.reshape(ct, (-1, ct.shape[-1])).astype(z.dtype)
    return (
        (xf.T @ cf).astype(g.dtype),
        (xf.T @ xf).astype(z.dtype),
        jnp.sum(cf * cf, axis=0).astype(f.dtype),
        jnp.asarray(xf.shape[0], t.dtype),
        jnp.zeros_like(x),
    )


_probe.defvjp(_probe_fwd, _probe_bwd)


@dataclasses.dataclass(frozen=True)
class _Probe(AdapterKind):
    """An adapter kind that adds zero and collects K-FAC statistics in its gradient."""

    in_ndim: int | None = None
    out_ndim: int | None = None

    def check_shape(self, n: int, m: int, path: str) -> None:
        pass

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        n, m = kernel.shape
        return {
            "g": jnp.zeros((n, m), jnp.float32),
            "z": jnp.zeros((n, n), jnp.float32),
            "f": jnp.zeros((m,), jnp.float32),
            "t": jnp.zeros((), jnp.float32),
        }

    def apply_delta(self, factors, x, *, shape=None, key=None):
        return _probe(factors["g"], factors["z"], factors["f"], factors["t"], x)

    def apply_delta_transposed(self, factors, y, *, shape=None):
        raise NotImplementedError(
            "data-aware initialisers support kernels used as x @ W only (not tied x @ W.T); "
            "exclude the tied embedding from the rules."
        )

    def materialize(self, factors, *, shape=None):
        return jnp.zeros_like(factors["g"])

    def factor_specs(self, in_spec, out_spec):
        return {"g": (in_spec, out_spec), "z": (in_spec, None), "f": (out_spec,), "t": ()}


def check_lora_rules(rules: paths.Rules) -> list[tuple[str, Any]]:
    """``rules`` as ``(pattern, spec)`` pairs, checking every non-``None`` spec is a ``LoRA``.

    Raises:
      TypeError: if a rule's spec is another adapter kind.
    """
    out = []
    for regex, spec in paths.check_rules(rules):
        if spec is not None and not isinstance(spec, LoRA):
            raise TypeError(
                f"data-aware initialisers make LoRA adapters; the rule {regex.pattern!r} has a "
                f"{type(spec).__name__} spec. Use lora(rank=...) specs."
            )
        out.append((regex.pattern, spec))
    return out


def batch_size(batch: Any) -> int:
    """The common leading (example) axis length of every leaf of ``batch``.

    Raises:
      ValueError: if the leaves disagree.
    """
    sizes = {int(jnp.shape(a)[0]) for a in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch leaves must share a leading example axis; got sizes {sizes}.")
    return sizes.pop()


def _accumulate_impl(params, probes, chunks, weights, *, apply_fn, loss_fn):
    """Weighted sums over examples of the probes' per-example gradients (scan over chunks)."""
    adapted = adapt(apply_fn)

    def one(example):
        example = jax.tree.map(lambda a: a[None], example)

        def loss(pr):
            return loss_fn(lambda *a, **k: adapted(params, pr, *a, **k), example)

        return jax.grad(loss)(probes)

    def body(acc, xs):
        ex, w = xs
        per = jax.vmap(one)(ex)
        summed = jax.tree.map(lambda p: jnp.tensordot(w, p, axes=1), per)
        return jax.tree.map(jnp.add, acc, summed), None

    zero = jax.tree.map(jnp.zeros_like, probes)
    acc, _ = jax.lax.scan(body, zero, (chunks, weights))
    return acc


_accumulate = jax.jit(_accumulate_impl, static_argnames=("apply_fn", "loss_fn"))


def kfac_statistics(
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_examples: int | None = None,
    chunk_size: int = 16,
) -> dict[str, KFACStats]:
    """Mean gradient and K-FAC factors of every kernel the rules target, from per-example grads.

    For the first ``S`` examples, ``jax.vmap(jax.grad)`` of each single-example loss gives
    ``G_i = Σ_t a_t g_tᵀ``, ``Z_i = Σ_t a_t a_tᵀ`` and ``F_i = Σ_t g_t²`` (see the module
    docstring); then ``G = (1/S) Σ_i G_i``, ``Z = Σ_i Z_i / T`` and ``F = Σ_i F_i / T`` with ``T``
    the token count. Memory is ``O(chunk_size · (n² + nm))`` per kernel.

    Args:
      params: the model's parameter pytree.
      rules: ``(regex, spec)`` rules; the non-``None`` specs choose the kernels (and their layout).
      batch: pytree of arrays with a leading example axis.
      apply_fn: ``apply_fn(params, *args, **kw)``.
      loss_fn: ``loss_fn(forward, batch) -> scalar``, the mean loss of a batch.
      num_examples: ``S``, the first examples used (default: all).
      chunk_size: examples per ``vmap`` chunk.

    Returns:
      ``{path: KFACStats}`` in float32.

    Raises:
      ValueError: ``num_examples`` out of range, or the batch leaves disagree on their length.
    """
    total = batch_size(batch)
    s = total if num_examples is None else int(num_examples)
    if not 1 <= s <= total:
        raise ValueError(f"num_examples must be in [1, {total}] (the batch size), got {s}.")
    chunk = max(1, min(int(chunk_size), s))
    probe_rules = [
        (regex, None if spec is None else _Probe(spec.in_ndim, spec.out_ndim))
        for regex, spec in check_lora_rules(rules)
    ]
    probes = init_adapters(jax.random.key(0), params, probe_rules)
    num_chunks = -(-s // chunk)
    used = jax.tree.map(lambda a: jnp.asarray(a)[:s], batch)
    pad = num_chunks * chunk - s
    weights = jnp.concatenate([jnp.ones(s), jnp.zeros(pad)]).reshape(num_chunks, chunk)
    chunks = jax.tree.map(
        lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)]).reshape(
            num_chunks, chunk, *a.shape[1:]
        ),
        used,
    )
    try:
        acc = _accumulate(params, probes, chunks, weights, apply_fn=apply_fn, loss_fn=loss_fn)
    except TypeError as e:  # unhashable apply_fn/loss_fn: no compilation cache, same result
        if "hash" not in str(e):
            raise
        fn = functools.partial(_accumulate_impl, apply_fn=apply_fn, loss_fn=loss_fn)
        acc = jax.jit(fn)(params, probes, chunks, weights)
    out = {}
    for path, ad in acc.items():
        f = ad.factors
        t = jnp.maximum(f["t"], 1.0)
        out[path] = KFACStats(
            grad=f["g"] / s,
            z=f["z"] / t[..., None, None],
            f=f["f"] / t[..., None],
            tokens=f["t"],
        )
    return out
