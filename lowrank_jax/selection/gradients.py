"""Per-example gradients of adapter factors, chunked, and LESS's Adam-state normalisation.

The per-example gradient of a LoRA adapter is taken with respect to its factors ``A: (n, r)``
and ``B: (r, m)`` (the adapter pytree of :func:`lowrank_jax.adapters.init`), by ``vmap(grad)``:
one ``(r·(n + m))``-vector per example and kernel, never the full-size ``ΔW = s·A B`` or its
``(m·n)`` gradient. :func:`gradient_features` runs that over a pool in chunks of
``chunk_size`` examples under one ``lax.map`` and reduces every chunk to features at once
(``transform``: a random projection, an Adam normalisation, a GIST projection), so a pool of any
size needs memory for ``chunk_size`` flat gradients plus the ``(N, k)`` features only.

References:
  Xia et al. 2024, "LESS: Selecting Influential Data for Targeted Instruction Tuning" (ICML),
  github.com/princeton-nlp/LESS ``less/data_selection/collect_grad_reps.py``
  (``obtain_gradients_with_adam``, ``prepare_optimizer_state``); P11 GIST (Min et al. 2026,
  arXiv 2602.18584), specs §11.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "adam_moments",
    "adam_precondition",
    "adam_update_direction",
    "flatten_per_example",
    "gradient_features",
    "per_example_grads",
]

LossFn = Callable[[Any, Any, Any], jax.Array]


def _num_examples(examples: Any) -> int:
    leaves = jax.tree.leaves(examples)
    if not leaves:
        raise ValueError("examples is an empty pytree; pass arrays with a leading example axis.")
    sizes = {int(jnp.shape(x)[0]) if jnp.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"every leaf of examples needs the same leading example axis; got sizes {sorted(sizes)}."
        )
    return sizes.pop()


def _check_chunk(chunk_size: int | None) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size!r}.")


def _chunked(examples: Any, n: int, chunk_size: int) -> Any:
    """``(num_chunks, chunk_size, ...)`` leaves; the last chunk padded with the final example."""
    num = -(-n // chunk_size)
    pad = num * chunk_size - n

    def reshape(x):
        x = jnp.asarray(x)
        if pad:
            x = jnp.concatenate([x, jnp.repeat(x[-1:], pad, 0)])
        return x.reshape(num, chunk_size, *x.shape[1:])

    return jax.tree.map(reshape, examples)


def per_example_grads(
    loss_fn: LossFn,
    trainable: Any,
    frozen: Any,
    examples: Any,
    *,
    chunk_size: int | None = None,
) -> Any:
    """Gradients of ``loss_fn`` at every example, with respect to ``trainable`` (``vmap(grad)``).

    ``g_i = ∇_θ ℓ(θ, frozen, z_i)`` for each example ``z_i`` (a slice of ``examples`` along its
    leading axis, without a batch axis), with ``θ = trainable`` (e.g. an adapter set: the
    gradients are those of the LoRA factors ``A`` and ``B``).

    Args:
      loss_fn: ``(trainable, frozen, example) -> scalar`` for ONE example.
      trainable: the pytree differentiated (adapter factors).
      frozen: passed through (base parameters; may be None).
      examples: pytree of arrays with a leading example axis ``N``.
      chunk_size: ``vmap`` over chunks of this many examples under ``lax.map`` (None: all at
        once). Results do not depend on it.

    Returns:
      A pytree like ``trainable`` whose leaves have a leading axis ``N``.

    Raises:
      ValueError: for inconsistent leading axes or a bad ``chunk_size``.

    Example:
      >>> g = per_example_grads(loss, adapters, params, {"x": x, "y": y}, chunk_size=64)  # doctest: +SKIP
    """
    _check_chunk(chunk_size)
    n = _num_examples(examples)
    grad_one = jax.vmap(jax.grad(loss_fn), in_axes=(None, None, 0))
    if chunk_size is None or chunk_size >= n:
        return jax.jit(grad_one)(trainable, frozen, examples)

    def run(trainable, frozen, chunks):
        out = jax.lax.map(lambda c: grad_one(trainable, frozen, c), chunks)
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:n], out)

    return jax.jit(run)(trainable, frozen, _chunked(examples, n, chunk_size))


def flatten_per_example(grads: Any) -> jax.Array:
    """``(N, D)``: the leaves of a per-example gradient pytree raveled and concatenated.

    The order is ``jax.tree.leaves`` order, the same as ``flatten_per_example`` of any pytree of
    that structure (and as ``jax.flatten_util.ravel_pytree`` of one example's gradient).
    """
    leaves = jax.tree.leaves(grads)
    if not leaves:
        raise ValueError("grads has no leaves.")
    n = leaves[0].shape[0]
    return jnp.concatenate([jnp.reshape(x, (n, -1)) for x in leaves], axis=1)


@functools.partial(jax.jit, static_argnames=("loss_fn", "transform", "chunk_size", "n"))
def _features(trainable, frozen, chunks, transform_args, *, loss_fn, transform, chunk_size, n):
    grad_one = jax.vmap(jax.grad(loss_fn), in_axes=(None, None, 0))

    def one_chunk(chunk):
        flat = flatten_per_example(grad_one(trainable, frozen, chunk))
        out = flat if transform is None else transform(flat, *transform_args)
        if out.ndim != 2 or out.shape[0] != chunk_size:
            raise ValueError(
                f"transform must map ({chunk_size}, D) gradients to ({chunk_size}, k); got "
                f"{out.shape}."
            )
        return out

    out = jax.lax.map(one_chunk, chunks)
    return out.reshape(-1, out.shape[-1])[:n]


def gradient_features(
    loss_fn: LossFn,
    trainable: Any,
    frozen: Any,
    examples: Any,
    *,
    transform: Callable[..., jax.Array] | None = None,
    transform_args: tuple[Any, ...] = (),
    chunk_size: int = 256,
) -> jax.Array:
    """Per-example gradient features ``f_i = transform(flat(g_i), *transform_args)``, chunked.

    Each chunk's per-example factor gradients (:func:`per_example_grads`) are flattened to
    ``(c, D)`` and mapped by ``transform`` to ``(c, k)`` inside the same ``lax.map`` step, so peak
    memory is ``O(c·D + N·k)`` whatever ``N``. The computation is jitted once per ``(loss_fn,
    transform, chunk_size, N)`` and shapes: pass module-level (or cached) functions and put the
    arrays they need (projection matrices, Adam moments, keys) in ``transform_args`` so that
    calls at several checkpoints reuse one compilation.

    Args:
      loss_fn: ``(trainable, frozen, example) -> scalar`` for one example (hashable).
      trainable, frozen, examples: as in :func:`per_example_grads`.
      transform: jittable, hashable ``(flat (c, D), *transform_args) -> (c, k)``, e.g.
        ``lambda g, p: g @ p`` with ``transform_args=(basis.projection,)`` (GIST), an Adam
        normalisation followed by :func:`~lowrank_jax.selection.random_projection.jl_project` (LESS); None:
        the flat gradients (``k = D``).
      transform_args: arrays (a pytree) passed to ``transform``; traced, not static.
      chunk_size: examples per chunk ``c``.

    Returns:
      ``(N, k)`` float features, in example order.

    Raises:
      ValueError: for inconsistent leading axes, a bad ``chunk_size`` or a transform that does
        not return ``(c, k)``.
    """
    _check_chunk(chunk_size)
    n = _num_examples(examples)
    chunk_size = min(chunk_size, n)
    return _features(
        trainable,
        frozen,
        _chunked(examples, n, chunk_size),
        tuple(transform_args),
        loss_fn=loss_fn,
        transform=transform,
        chunk_size=chunk_size,
        n=n,
    )


def adam_moments(opt_state: Any) -> tuple[Any, Any, jax.Array]:
    """``(mu, nu, count)`` of the (first) ``optax.scale_by_adam`` state inside ``opt_state``.

    Works for ``optax.adam``/``adamw`` and chains or ``multi_transform``s around them; ``mu`` and
    ``nu`` have the structure of the trained pytree (flatten them with
    ``flatten_per_example(jax.tree.map(lambda x: x[None], mu))[0]``).

    Raises:
      ValueError: if there is no ``ScaleByAdamState`` in ``opt_state``.
    """
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    if not states:
        raise ValueError(
            "opt_state holds no optax.ScaleByAdamState; LESS needs the warm-up run's Adam "
            "moments (train the warm-up with optax.adam or optax.adamw)."
        )
    s = states[0]
    return s.mu, s.nu, s.count


def adam_update_direction(
    grads: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> jax.Array:
    """LESS's Adam-normalised per-example gradient ``Γ(z) = m'/√(v' + ε)``.

    ``m' = b1·m + (1 - b1)·g`` and ``v' = b2·v + (1 - b2)·g²`` are the warm-up optimizer's
    moments after one more Adam step on example ``z`` alone; ``Γ(z)`` is the direction that step
    would move the parameters in. This is the formula of LESS's code (``obtain_gradients_with_adam``:
    no bias correction, ``ε`` inside the square root, ``b1, b2, ε = 0.9, 0.999, 1e-8``); the LESS
    paper writes it with bias-corrected moments ``m̂/(√v̂ + ε)``, which (ε aside) rescales ``Γ`` by
    one global constant and so leaves every cosine, hence every LESS score, unchanged.

    Args:
      grads: ``(N, D)`` flat per-example gradients (or ``(D,)``).
      mu: ``(D,)`` first moment of the warm-up Adam state (same flattening as ``grads``).
      nu: ``(D,)`` second moment.
      b1, b2, eps: Adam's constants (LESS's defaults).

    Returns:
      Array shaped like ``grads``.

    Raises:
      ValueError: if the last axes disagree.
    """
    if grads.shape[-1:] != mu.shape or mu.shape != nu.shape:
        raise ValueError(
            f"grads (..., D) and the moments (D,) must agree; got {grads.shape}, {mu.shape}, "
            f"{nu.shape}. Flatten the moments like the gradients (flatten_per_example)."
        )
    m = b1 * mu + (1.0 - b1) * grads
    v = b2 * nu + (1.0 - b2) * grads**2
    return m / jnp.sqrt(v + eps)


def adam_precondition(grads: jax.Array, nu: jax.Array, *, eps: float = 1e-8) -> jax.Array:
    """The diagonal (axis-aligned) Adam preconditioning ``g / (√v + ε)`` of GIST-diag.

    GIST-diag (specs §11 (4): "Adam scaling before the SVD") applies Adam's diagonal scaling from
    the warm-up state to every gradient, validation and training alike, and then runs GIST on the
    scaled gradients. The exact form (``v`` without momentum, ``ε`` outside the root) is a
    reconstruction: the paper's ablation is described, not its code.

    Args:
      grads: ``(N, D)`` flat gradients.
      nu: ``(D,)`` second moment of the warm-up Adam state.

    Returns:
      Array shaped like ``grads``.
    """
    if grads.shape[-1:] != nu.shape:
        raise ValueError(f"grads (..., D) and nu (D,) must agree; got {grads.shape}, {nu.shape}.")
    return grads / (jnp.sqrt(nu) + eps)
