"""Internal helpers shared by the continual methods' factories (not public API; optax-style)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax import adapters
from lowrank_jax.adapters.paths import drop_path, get_path, set_path
from lowrank_jax.continual.capture import head_features, layer_inputs
from lowrank_jax.continual.protocol import ContinualState, kernel_paths
from lowrank_jax.optim.orthogonal_projection import init_memories
from lowrank_jax.optim.subspace_memory import SubspaceMemory


def lora_set(
    key: jax.Array,
    variables: Any,
    targets: Sequence[str],
    rank: int,
    *,
    full_rank: int,
    alpha: float,
) -> dict[str, Any]:
    """LoRA adapters of ``rank`` on ``targets``, scaled as a slice of a rank-``full_rank`` LoRA.

    A kernel ``(n, m)`` is one matrix; one with more axes ``(*L, n, m)`` is a stack of layers
    (``nn.scan``, e.g. ``models.DecoderLM``) and gets factors stacked on those axes.
    """
    lora = adapters.lora(rank, alpha=alpha * rank / full_rank, in_ndim=1, out_ndim=1)
    return adapters.init(key, variables, [(t, lora) for t in targets])


def replace_a(lora_set: Mapping[str, Any], new_a: Mapping[str, jax.Array]) -> dict[str, Any]:
    return {
        p: ad.replace(factors={**ad.factors, "a": new_a[p].astype(ad.factors["a"].dtype)})
        for p, ad in lora_set.items()
    }


def optimizer(
    learning_rate: float, grad_clip: float, extra: Sequence[optax.GradientTransformation] = ()
) -> optax.GradientTransformation:
    """Clip (``grad_clip > 0``), Adam, the ``extra`` transforms, then ``−learning_rate``.

    The extras sit after Adam's moment estimates (a projection before them would be undone by
    Adam's element-wise scaling; see :func:`lowrank_jax.optim.scale_by_orthogonal_projection`).
    """
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    parts += [optax.scale_by_adam(), *extra, optax.scale(-learning_rate)]
    return optax.chain(*parts)


def per_layer(fn: Callable[..., Any], like: Any, in_axes: Any = 0) -> Callable[..., Any]:
    """``fn`` of one layer's matrices lifted by ``vmap`` over the stack axes of ``like``.

    ``like`` is any array ``(*L, ·, ·)`` of the kernel (the kernel, a factor, layer inputs): a
    kernel ``(*L, n, m)`` (``nn.scan``) is ``prod(L)`` layers, each treated as a separate 2-D
    kernel would be; for a 2-D one ``fn`` is returned unchanged. ``in_axes`` as ``vmap``'s (e.g.
    ``1`` for per-task records ``(T, *L, n, m)``); outputs get the stack axes first.
    """
    for _ in range(jnp.ndim(like) - 2):
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


def check_common(*, rank: int, alpha: float, learning_rate: float, grad_clip: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}.")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}.")
    if not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 (0: no clipping), got {grad_clip!r}.")


def check_threshold(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}.")


def check_head_path(variables: Any, head_path: str) -> None:
    """Raises a ValueError naming the paths there are if ``head_path`` is not a subtree."""
    tree, walked = variables, []
    for part in head_path.split("/"):
        if not isinstance(tree, Mapping) or part not in tree:
            where = "/".join(walked) or "the model's variables"
            there = sorted(tree) if isinstance(tree, Mapping) else []
            raise ValueError(
                f"head_path={head_path!r} is not in the model: {where} holds "
                f"{', '.join(repr('/'.join([*walked, k])) for k in there) or 'no subtree'}; "
                "pass head_path= the path of the classifier head's parameters."
            )
        tree = tree[part]
        walked.append(part)


def check_rank(rank: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raises a ValueError if ``rank`` exceeds ``min(n, m)`` of a targeted ``(*L, n, m)`` kernel."""
    for path, shape in shapes.items():
        n, m = shape[-2], shape[-1]
        if rank > min(n, m):
            raise ValueError(
                f"rank={rank} exceeds min(n, m) = {min(n, m)} of the targeted kernel {path!r} "
                f"(a {n}x{m} matrix): use a rank of at most {min(n, m)}, or target larger "
                "kernels."
            )


class MethodBase(NamedTuple):
    """What every factory shares: the model, its targets and the optimiser's knobs."""

    apply_fn: Callable[..., Any]
    adapted: Callable[..., Any]
    targets: tuple[str, ...]
    head_path: str
    rank: int
    alpha: float
    learning_rate: float
    grad_clip: float
    jitted: dict[Any, Callable[..., Any]]  # compiled helpers, one per kernel tuple

    def init(self, variables: Any, *, memory: bool, extra: Callable[[dict], Any]) -> ContinualState:
        check_head_path(variables, self.head_path)
        kernels = kernel_paths(variables, self.targets)
        w0 = {k: jnp.asarray(get_path(variables, k)) for k in kernels}
        check_rank(self.rank, {k: w.shape for k, w in w0.items()})
        params = drop_path(variables, self.head_path)
        # one memory per layer of a stack (*L, n, m): basis (*L, n, n)
        exact = [re.escape(k) for k in kernels]
        return ContinualState(
            params=params,
            head=get_path(variables, self.head_path),
            kernels=w0,
            memory=init_memories(params, exact) if memory else None,
            update={},
            extra=extra(w0),
        )

    def memories(self, state: ContinualState) -> dict[str, SubspaceMemory]:
        """``{kernel path: SubspaceMemory}`` of ``state.memory``, in the order of the kernels."""
        return {k: get_path(state.memory, k) for k in state.kernels}

    def a_memories(self, state: ContinualState, trainable: Mapping[str, Any]) -> dict[str, Any]:
        """The memory tree of an optax projection over ``trainable``: each kernel's memory at the
        ``a`` factor of its adapter in ``trainable["shared"]``, ``None`` elsewhere."""
        memories = self.memories(state)
        shared = {
            k: ad.replace(factors={**jax.tree.map(lambda _: None, ad.factors), "a": memories[k]})
            for k, ad in trainable["shared"].items()
        }
        return {**jax.tree.map(lambda _: None, dict(trainable)), "shared": shared}

    def full(self, params: Any, head: Any) -> Any:
        """The model's variables: ``params`` with ``head`` at ``head_path``."""
        return set_path(params, self.head_path, head)

    def lora(self, key: jax.Array, state: ContinualState, rank: int | None = None) -> dict:
        return lora_set(
            key,
            self.full(state.params, state.head),
            self.targets,
            self.rank if rank is None else rank,
            full_rank=self.rank,
            alpha=self.alpha,
        )

    def tx(self, extra: Sequence[optax.GradientTransformation] = ()) -> Any:
        return optimizer(self.learning_rate, self.grad_clip, extra)

    def layer_inputs(self, state: ContinualState, x: Any) -> dict[str, jax.Array]:
        """The inputs ``(b, n)`` (a stack: ``(*L, b, n)``) of every adapted kernel on ``x`` under
        the consolidated model."""
        kernels = tuple(state.kernels)
        if kernels not in self.jitted:
            self.jitted[kernels] = jax.jit(
                lambda p, x: layer_inputs(self.apply_fn, list(kernels), p, x)
            )
        _, inputs = self.jitted[kernels](self.full(state.params, state.head), jnp.asarray(x))
        return inputs

    def plain_predict(
        self, state: ContinualState, x: Any, task_id: int | None = None
    ) -> tuple[jax.Array, None]:
        """Logits of the consolidated model (no adapters left: everything is merged)."""
        del task_id
        if "plain" not in self.jitted:
            self.jitted["plain"] = jax.jit(lambda p, x: self.adapted(p, {}, x))
        return self.jitted["plain"](self.full(state.params, state.head), jnp.asarray(x)), None

    def features(self, params: Any, adapter_sets: Any, x: Any) -> jax.Array:
        """``(b, d)`` what the head reads in ``adapted(params, adapter_sets, x)``: that forward
        with the head at ``head_path`` replaced by the identity (:func:`head_features`)."""
        return head_features(
            lambda p, x: self.adapted(p, adapter_sets, x), self.head_path, params, x
        )

    def plain_features(
        self, state: ContinualState, x: Any, task_id: int | None = None
    ) -> jax.Array:
        """The features of :meth:`plain_predict`: the consolidated model without its head."""
        del task_id
        if "features" not in self.jitted:
            self.jitted["features"] = jax.jit(lambda p, x: self.features(p, {}, x))
        return self.jitted["features"](self.full(state.params, state.head), jnp.asarray(x))

    def deltas(self, state: ContinualState, adapter_set: Mapping[str, Any]) -> dict[str, Any]:
        return {k: adapters.delta(ad, state.kernels[k].shape) for k, ad in adapter_set.items()}


def common_args(local_vars: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments every factory shares, picked from its ``locals()``."""
    keys = ("targets", "rank", "alpha", "learning_rate", "grad_clip")
    return {k: local_vars[k] for k in keys}


def method_base(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    learning_rate: float,
    grad_clip: float,
    head_path: str,
) -> MethodBase:
    check_common(rank=rank, alpha=alpha, learning_rate=learning_rate, grad_clip=grad_clip)
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets must be a non-empty tuple of regexes, got {targets!r}.")
    return MethodBase(
        apply_fn,
        adapters.adapt(apply_fn),
        tuple(targets),
        head_path,
        rank,
        float(alpha),
        float(learning_rate),
        float(grad_clip),
        {},
    )


def no_penalty(trainable: Any, frozen: Any, batch: Any, key: jax.Array) -> jax.Array:
    del trainable, frozen, batch, key
    return jnp.zeros([], jnp.float32)


def no_diagnostics(state: ContinualState) -> dict[str, Any]:
    del state
    return {}


def check_sizes(**sizes: int) -> None:
    """Raises ``ValueError`` naming the first of ``sizes`` that is not a positive int."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")


FEATURE_BATCH = 256  # rows per forward pass when features are read on the host


def in_batches(
    fn: Callable[[np.ndarray], jax.Array], x: Any, batch_size: int = FEATURE_BATCH
) -> np.ndarray:
    """``concatenate([fn(batch)])`` over equal batches of at most ``batch_size`` rows of ``x`` (one
    compiled shape; the last batch padded with the first rows, whose outputs are dropped), as a
    float32 host array. ``x`` is an array or any row-sliceable sequence (``len``, ``x[i:j]``),
    read one batch at a time."""
    size = -(-len(x) // max(1, -(-len(x) // batch_size))) if len(x) else 1
    out = []
    for i in range(0, len(x), size):
        xb = x[i : i + size]
        pad = np.concatenate([xb, x[: size - len(xb)]]) if len(xb) < size else xb
        out.append(np.asarray(fn(pad), np.float32)[: len(xb)])
    return np.concatenate(out)


def check_dense_head(head: Any) -> tuple[int, int]:
    """``(d, C)`` of a dense head ``{'kernel': (d, C), 'bias': (C,)}``.

    Raises:
      TypeError: ``head`` is not such a dict; ValueError: its shapes disagree.
    """
    if not isinstance(head, dict) or set(head) != {"kernel", "bias"}:
        keys = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise TypeError(
            "the class-incremental heads need a dense head {'kernel': (d, C), 'bias': (C,)} at "
            f"the method's head_path; got {keys}."
        )
    kernel, bias = np.shape(head["kernel"]), np.shape(head["bias"])
    if len(kernel) != 2 or bias != kernel[1:]:
        raise ValueError(f"head kernel {kernel} and bias {bias} must be (d, C) and (C,).")
    return kernel
