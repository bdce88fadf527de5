"""What enters chosen layers (linen, nnx, plain JAX): kernels' inputs and the head's features.

* :func:`layer_inputs`: the inputs of chosen kernels, for subspace memories;
* :func:`head_features`: the features the classifier head reads (what
  :attr:`~lowrank_jax.continual.ContinualMethod.features` of the library's methods returns).

The GPM memories of :mod:`lowrank_jax.optim` (``extend_subspace_memory``) are built from the
activations that enter a kernel ``W: (n, m)`` (``x @ W``). :func:`layer_inputs` records them for
any model:

* linen: every ``nn.Dense`` / ``nn.DenseGeneral`` call is intercepted (``nn.intercept_methods``);
* anything else — an nnx model (``lambda state, x: nnx.merge(graphdef, state)(x)``), a plain
  function of a parameter pytree, or linen layers that are not ``Dense`` — through the adapter
  machinery: each chosen kernel is wrapped (:func:`lowrank_jax.adapters.adapt`, ``quax``
  backend) with a recording adapter that adds zero and keeps the input of every matmul over the
  kernel's input axes.

**Stacked layers.** A kernel ``(*L, n, m)`` with more than two axes is a stack of layers run
under ``lax.scan``/``nn.scan`` (``models.DecoderLM``): its matmuls happen inside the scanned body,
where a traced value cannot be taken out of the scan by Python. Its inputs leave the body through
autodiff instead: the recording adapter holds a zero *probe* factor ``P: (*L, b, n)`` (the scan
slices it per layer like any adapter factor) and adds ``tap(P, x) = 0`` to the layer's output,
a ``jax.custom_vjp`` whose backward gives ``P`` the cotangent ``x`` whatever reaches it. One
reverse pass (:func:`jax.vjp` of the adapted function at ``P = 0``) then returns every layer's
``x`` stacked as ``(*L, b, n)``, exactly, under ``jit``, ``remat`` and any scan, with no host
callback. ``b`` (the rows one layer's matmul sees) is read from a shape-only trace first. A kernel
of a stack must be used once per layer and its output must reach ``apply_fn``'s output (every
projection of a transformer layer is and does): uses of different sizes in one layer raise, but
two of the same size cannot be told apart (their inputs would be summed), an output that does
not reach ``apply_fn``'s leaves zeros, and an ``apply_fn`` with no floating-point output raises.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["head_features", "layer_inputs"]


def _linen_inputs(apply_fn, wanted, params, args, kwargs):
    """Intercepted ``Dense`` inputs, and the wanted kernels seen sliced (inside a scan)."""
    from lowrank_jax.adapters.paths import named_leaves

    outer = {p: jnp.shape(leaf) for p, leaf in named_leaves(params).items() if p in wanted}
    found: dict[str, list[jax.Array]] = {}
    sliced: set[str] = set()

    def interceptor(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.Dense | nn.DenseGeneral):
            path = "/".join(("params", *module.path, "kernel"))
            if path in wanted:
                kernel_shape = module.variables["params"]["kernel"].shape
                if kernel_shape != outer.get(path, kernel_shape):  # a layer of a scanned stack
                    sliced.add(path)
                else:
                    x = jnp.reshape(jnp.asarray(call_args[0]), (-1, kernel_shape[0]))
                    found.setdefault(path, []).append(x)
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(interceptor):
        out = apply_fn(params, *args, **kwargs)
    return out, found, sorted(sliced)


@dataclasses.dataclass(frozen=True, eq=False)
class _Recorder:
    """An adapter kind that contributes zero and records its (flattened) input in ``sink``.

    ``mode="inputs"``: appends the input (a 2-D kernel, traced outside any scan);
    ``mode="shapes"``: appends only its shape (a stacked kernel's shape-only trace). A
    ``"probe"`` factor (a stacked kernel's second pass) makes it :func:`_tap` instead.
    """

    path: str
    sink: dict = dataclasses.field(repr=False)
    mode: Literal["inputs", "shapes"] = "inputs"
    in_ndim: int | None = None
    out_ndim: int | None = None

    def check_shape(self, n: int, m: int, path: str) -> None:
        del n, m, path

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        del key, kernel
        return {}

    def apply_delta(self, factors, x, *, shape, key=None):
        del key
        if "probe" in factors:  # x leaves the scanned body as the probe's cotangent
            return _tap(factors["probe"], x, shape[1])
        self.sink.setdefault(self.path, []).append(x.shape if self.mode == "shapes" else x)
        return jnp.zeros((x.shape[0], shape[1]), x.dtype)

    def apply_delta_transposed(self, factors, y, *, shape):
        raise NotImplementedError(
            f"{self.path!r} is used transposed (x @ W.T, a tied embedding): its 'inputs' are not "
            "inputs of x @ W; leave it out of kernel_paths."
        )

    def materialize(self, factors, *, shape):
        raise NotImplementedError(
            f"{self.path!r} reached an operation other than a matmul; layer_inputs records "
            "matmul inputs only."
        )

    def factor_specs(self, in_spec, out_spec):
        return {}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tap(probe: jax.Array, x: jax.Array, m: int) -> jax.Array:
    """``zeros (b, m)``, whose backward hands ``x`` to ``probe`` (and nothing to ``x``)."""
    del probe
    return jnp.zeros((x.shape[0], m), x.dtype)


def _tap_fwd(probe, x, m):
    return _tap(probe, x, m), (x, jnp.zeros((), probe.dtype))


def _tap_bwd(m, residual, cotangent):
    del m, cotangent
    x, like = residual
    return x.astype(like.dtype), jnp.zeros_like(x)


_tap.defvjp(_tap_fwd, _tap_bwd)


def _ones_like_output(out: Any) -> Any:
    """The cotangent that pulls the probes back: ones (any nonzero would do), float0 for ints."""

    def one(leaf):
        leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.ones_like(leaf)
        return np.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree.map(one, out)


def _stacked_inputs(apply_fn, stacked, params, args, kwargs):
    """``(output, {path: (*L, b, n)})`` for kernels ``(*L, n, m)`` used inside a scan."""
    from lowrank_jax import adapters
    from lowrank_jax.adapters.paths import named_leaves

    kernels = {p: jnp.shape(leaf) for p, leaf in named_leaves(params).items()}
    shapes: dict[str, list[tuple[int, ...]]] = {}
    rules = [(re.escape(p), _Recorder(p, shapes, "shapes", 1, 1)) for p in stacked]
    recorders = adapters.init(jax.random.key(0), params, rules)
    run = adapters.adapt(apply_fn)
    jax.eval_shape(lambda p: run(p, recorders, *args, **kwargs), params)
    probes = {}
    for path in stacked:
        rows = sorted({s[0] for s in shapes.get(path, [])})
        if len(rows) > 1:
            raise ValueError(
                f"{path!r} (a stack of layers) is used in matmuls of {rows} rows in one layer: "
                "layer_inputs records a stacked kernel used once per layer only."
            )
        if rows:
            probes[path] = jnp.zeros((*kernels[path][:-2], rows[0], kernels[path][-2]))

    def probed(pr):
        tapped = {p: recorders[p].replace(factors={"probe": x}) for p, x in pr.items()}
        return run(params, tapped, *args, **kwargs)

    out, pullback = jax.vjp(probed, probes)
    if not any(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in jax.tree.leaves(out)):
        raise ValueError(
            f"kernels {sorted(probes)} are layers of a stack, whose inputs leave the scan through "
            "autodiff, but apply_fn returns no floating-point output (e.g. argmax predictions): "
            "pass a function that returns the logits."
        )
    (inputs,) = pullback(_ones_like_output(out))
    return out, {p: [x] for p, x in inputs.items()}


def _adapter_inputs(apply_fn, wanted, params, args, kwargs):
    """Recording adapters: a 2-D kernel's inputs directly, a stacked kernel's through probes."""
    from lowrank_jax import adapters  # (adapters imports nothing from continual)
    from lowrank_jax.adapters.paths import named_leaves

    leaves = named_leaves(params)
    present = sorted(wanted & set(leaves))  # the rest: reported missing
    stacked = [p for p in present if jnp.ndim(leaves[p]) > 2]
    flat = [p for p in present if jnp.ndim(leaves[p]) <= 2]
    out, found = None, {}
    if stacked:
        out, found = _stacked_inputs(apply_fn, stacked, params, args, kwargs)
    if flat:
        sink: dict[str, list[jax.Array]] = {}
        recorders = adapters.init(
            jax.random.key(0), params, [(re.escape(p), _Recorder(p, sink)) for p in flat]
        )
        out = adapters.adapt(apply_fn)(params, recorders, *args, **kwargs)
        found.update(sink)
    if out is None:
        out = apply_fn(params, *args, **kwargs)
    return out, found


def layer_inputs(
    apply_fn: Callable[..., Any],
    kernel_paths: Sequence[str],
    params: Any,
    *args: Any,
    capture: Literal["auto", "linen", "adapters"] = "auto",
    **kwargs: Any,
) -> tuple[Any, dict[str, jax.Array]]:
    """Runs ``apply_fn(params, *args, **kwargs)`` and records the inputs of chosen kernels.

    Every matmul of a kernel whose path (the adapter-rule names: ``"params/dense_0/kernel"`` for
    linen variables, the '/'-joined pytree path for an nnx ``State`` or a plain dict) is in
    ``kernel_paths`` has its input ``x: (..., n)`` recorded as ``(b, n)`` with all leading axes
    flattened (tokens and examples alike). A stacked kernel ``(*L, n, m)`` run under
    ``lax.scan``/``nn.scan`` gets its inputs per layer, ``(*L, b, n)`` (through a probe's
    cotangent, see the module docstring). Pure and jittable (the records are returned, never
    stored).

    Args:
      apply_fn: a linen ``model.apply``, ``lambda state, x: nnx.merge(graphdef, state)(x)``, or
        any function of a parameter pytree first.
      kernel_paths: kernel paths to record, e.g. ``("params/dense_0/kernel",)``.
      params: the parameters passed to ``apply_fn`` (merge adapters in first if they should act).
      *args: positional inputs of ``apply_fn``.
      capture: ``"linen"`` (intercept linen ``Dense``/``DenseGeneral`` calls; not inside
        ``nn.scan``), ``"adapters"`` (recording adapters: any function, any scan), or ``"auto"``
        (linen for the kernels it sees whole, adapters for the rest).
      **kwargs: keyword inputs of ``apply_fn``.

    Returns:
      ``(output, {path: (b, n) or (*L, b, n)})``; a 2-D kernel used several times gets its
      inputs concatenated.

    Raises:
      ValueError: a path in ``kernel_paths`` was never used in a matmul, a stacked kernel is
        used in matmuls of different sizes in one layer or ``apply_fn`` has no floating-point
        output to pull the stack's inputs back from, ``capture="linen"`` for a kernel used
        inside ``nn.scan``, or an unknown ``capture``.

    Example:
      >>> _, inputs = layer_inputs(model.apply, ["params/dense_0/kernel"], variables, x)
      >>> memory = optim.extend_subspace_memory(memory, inputs["params/dense_0/kernel"],
      ...                                       threshold=0.97)
    """
    if capture not in ("auto", "linen", "adapters"):
        raise ValueError(f"capture must be 'auto', 'linen' or 'adapters', got {capture!r}.")
    wanted = set(kernel_paths)
    found: dict[str, list[jax.Array]] = {}
    out = None
    if capture in ("auto", "linen"):
        out, found, sliced = _linen_inputs(apply_fn, wanted, params, args, kwargs)
        if capture == "linen" and sliced:
            raise ValueError(
                f"kernels {sliced} are layers of a stack run under nn.scan, where linen capture "
                "cannot record; use capture='adapters' (or 'auto')."
            )
    rest = wanted if capture == "adapters" else wanted - set(found)
    if capture != "linen" and rest:
        out, more = _adapter_inputs(apply_fn, rest, params, args, kwargs)
        found = {**found, **more}
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(
            f"kernels {missing} were never used in a matmul by apply_fn; check the paths (linen: "
            "'params/<module>/kernel'; see lowrank_jax.adapters.paths.named_leaves(params))."
        )
    return out, {k: jnp.concatenate(v, axis=0) for k, v in found.items()}


def head_features(
    apply_fn: Callable[..., Any], head_path: str, params: Any, *args: Any, **kwargs: Any
) -> jax.Array:
    """``apply_fn(params, *args, **kwargs)`` with its head replaced by the identity: the features.

    The head at ``head_path`` (a dense layer ``f ↦ f W + b``, the model's last) is skipped, so
    the output is what the head reads, ``f: (b, d)``, after whatever ``apply_fn`` does to the
    head's output (an LM classifier's ``logits[:, -1]`` gives the last token's features), and
    ``apply_fn``'s logits are ``f W (+ b)`` exactly where the matmul is. One forward pass,
    jittable, no autodiff:

    * linen: the call of the module at ``head_path`` is intercepted (``nn.intercept_methods``)
      and returns its input;
    * anything else (nnx, a plain function of a parameter pytree): the rows that reach the
      kernel ``head_path + "/kernel"`` are recorded (:func:`layer_inputs`); the head must then
      read one row per example.

    Args:
      apply_fn: a linen ``model.apply``, ``lambda state, x: nnx.merge(graphdef, state)(x)``, or
        any function of a parameter pytree first (an :func:`~lowrank_jax.adapters.adapt`-ed one
        too: its adapters act).
      head_path: the '/'-joined path of the head's parameters (``"params/head"``).
      params: the parameters passed to ``apply_fn``.
      *args: positional inputs of ``apply_fn``.
      **kwargs: keyword inputs of ``apply_fn``.

    Returns:
      ``(b, d)`` the features (the head's input, in its dtype).

    Raises:
      ValueError: the linen module at ``head_path`` is called more than once; outside linen, the
        head's kernel is never used in a matmul, or reads another number of rows than
        ``apply_fn`` returns.

    Example:
      >>> f = head_features(model.apply, "params/head", variables, x)
      >>> logits = f @ variables["params"]["head"]["kernel"] + variables["params"]["head"]["bias"]
    """
    where = tuple(head_path.split("/"))
    calls = []

    def skip_head(next_fun, call_args, call_kwargs, context):
        if context.method_name == "__call__" and (where[0], *context.module.path) == where:
            calls.append(call_args[0])
            return call_args[0]
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(skip_head):
        out = apply_fn(params, *args, **kwargs)
    if len(calls) > 1:
        raise ValueError(
            f"the module at head_path={head_path!r} is called {len(calls)} times: the features "
            "are the input of a head called once."
        )
    if calls:
        return out
    kernel = f"{head_path}/kernel"
    out, inputs = layer_inputs(apply_fn, [kernel], params, *args, capture="adapters", **kwargs)
    rows, batch = inputs[kernel].shape[0], jax.tree.leaves(out)[0].shape[0]
    if rows != batch:
        raise ValueError(
            f"the head's kernel {kernel!r} reads {rows} rows for {batch} outputs: outside linen "
            "the head must read one row per example (an LM's logits[:, -1] needs a linen model)."
        )
    return inputs[kernel]
