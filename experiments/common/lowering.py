"""Accelerator readiness without an accelerator: an experiment's jitted steps, lowered by
``jax.export`` for TPU and GPU on abstract inputs, and checked for CPU-only constructs.

Every experiment module exposes ``steps(config, mesh=None) -> list[Step]``: the programs its run
jits (the ``fit`` train step, evaluation, a sweep's ``train_scan``, a method's jitted update),
built by the same functions the run uses, on ``jax.ShapeDtypeStruct`` arguments made with
``jax.eval_shape`` (no data is loaded, no pretrained weight is read: only a model's config file;
the one exception is ``kge``, which reads its small triple files because the query targets'
shapes are the data's). Sizes that only the data fixes (a character vocabulary, a split's row
count) are nominal where an experiment says so.
``mesh`` may be a ``jax.sharding.AbstractMesh``, so an 8-device data-parallel lowering needs no
devices at all. ``tests/experiments/test_lowering.py`` exports every config's ``:smoke`` steps::

    exported = export_step(step, platforms=("tpu", "cuda"))
    problems = check_exported(exported, step)   # host callbacks, float64, lost shardings

Only a run on the real device proves speed and numerics; lowering proves that the program has a
TPU and a GPU lowering, keeps no host callback and no float64 value, and keeps its shardings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.common import sharding as sharding_lib

__all__ = [
    "Step",
    "abstract",
    "abstract_mesh",
    "abstract_minilm",
    "check_exported",
    "eval_shape_with_static",
    "export_step",
    "host_callbacks",
    "lower_and_check",
    "placed",
    "sharded_batch",
]


class Step(NamedTuple):
    """One jitted program of an experiment, with abstract arguments (lowered, never run).

    Attributes:
      name: what it is (``"train"``, ``"eval"``, ``"train_scan lora"``): failures name it.
      fn: the jitted function the run calls (``jax.jit(...)``, with its shardings).
      args: its positional arguments: pytrees of ``jax.ShapeDtypeStruct`` carrying the shardings
        the run's arrays have (none: unspecified), which the exported module must keep.
      kwargs: its keyword arguments (static ones, e.g. a loss function, and abstract arrays).
    """

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = {}


def abstract_mesh(num_devices: int) -> AbstractMesh:
    """A 1-D ``"data"`` mesh of ``num_devices`` devices that need not exist (for lowering)."""
    return AbstractMesh((num_devices,), (sharding_lib.DATA_AXIS,))


def abstract(tree: Any, sharding: Any = None) -> Any:
    """``tree`` (arrays, numbers or ``ShapeDtypeStruct``) as ``ShapeDtypeStruct`` leaves, with
    ``sharding`` (a sharding or a matching pytree of them; None: unspecified) attached."""

    def one(x, s=None):
        dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
        return jax.ShapeDtypeStruct(jnp.shape(x), dtype, sharding=s)

    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, sharding), tree)
    return jax.tree.map(one, tree, sharding)


def placed(tree: Any, mesh: Any, *, fsdp: bool = False) -> Any:
    """``tree`` abstract, with the shardings ``fit`` gives parameters and state
    (:func:`~experiments.common.sharding.param_sharding`): what an evaluation receives."""
    return abstract(tree, sharding_lib.param_sharding(mesh, tree, fsdp=fsdp))


def sharded_batch(tree: Any, mesh: Any) -> Any:
    """``tree`` abstract, split along its leading axis over ``"data"`` (as ``shard_batch``)."""
    return abstract(tree, sharding_lib.batch_sharding(mesh))


def eval_shape_with_static(fn: Callable[..., tuple[Any, Any]], *args: Any) -> tuple[Any, Any]:
    """``jax.eval_shape`` of ``fn(*args) -> (arrays, static)`` that also returns ``static``.

    For builders that return both arrays (a train state) and functions or modules (the step's
    forward pass, an optimizer): the arrays come back as ``ShapeDtypeStruct`` and nothing is
    computed. ``static`` must not hold traced values.
    """
    box = []

    def arrays_only(*a):
        arrays, static = fn(*a)
        box.append(static)
        return arrays

    arrays = jax.eval_shape(arrays_only, *args)
    return arrays, box[0]


def abstract_minilm() -> tuple[Any, Any]:
    """``(BertConfig, abstract encoder variables)`` of all-MiniLM-L6-v2, as ``load_minilm``
    returns them but from its ``config.json`` alone (the weights are not read)."""
    from lowrank_jax import models

    config = models.BertConfig.from_json(models.minilm_dir() / "config.json")
    ids = jnp.zeros((1, 8), jnp.int32)
    variables = jax.eval_shape(
        lambda key: models.BertEncoder(config).init(key, ids, jnp.ones_like(ids)),
        jax.random.key(0),
    )
    return config, variables


def export_step(step: Step, *, platforms: Sequence[str] = ("tpu", "cuda")) -> jax.export.Exported:
    """``jax.export`` of ``step.fn`` on its abstract arguments for ``platforms`` (no compilation)."""
    return jax.export.export(step.fn, platforms=tuple(platforms))(*step.args, **step.kwargs)


_CUSTOM_CALL = re.compile(r'custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*"([^"]+)"')
_F64 = re.compile(r"\b(?:f64|complex<f64>)\b|xf64>")
_LOC_ALIAS = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_LOC_REF = re.compile(r"#(loc\d*)")
_FILE_LINE = re.compile(r'"([^"<>]+\.py)":(\d+)')
_OP_NAME = re.compile(r'"((?:jit|pjit)\([^"]*)"')


def _where(line: str, aliases: Mapping[str, str]) -> str:
    """The op and the innermost source line of an MLIR line's ``loc(#locN)``, e.g.
    ``jit(wrapped)/dot_general at experiments/x.py:12``; empty when it has none."""
    refs = _LOC_REF.findall(line.rsplit("loc(", 1)[-1]) if "loc(" in line else []
    if not refs:
        return ""
    text, seen = aliases.get(refs[-1], ""), set()
    for _ in range(64):  # expand nested aliases (callsite chains), innermost frame first
        match = _LOC_REF.search(text)
        if match is None or match.group(1) in seen:
            break
        seen.add(match.group(1))
        text = text[: match.start()] + aliases.get(match.group(1), "") + text[match.end() :]
    op = _OP_NAME.search(text)
    files = [
        (f, n)
        for f, n in _FILE_LINE.findall(text)
        if "/jax/" not in f and not f.endswith("common/lowering.py")
    ]
    where = op.group(1) if op else ""
    if files:
        where += f" at {files[0][0]}:{files[0][1]}"
    return where.strip()


def _short(line: str, aliases: Mapping[str, str], limit: int = 200) -> str:
    where = _where(line, aliases)
    line = line.strip()
    line = line if len(line) <= limit else line[:limit] + " ..."
    return f"{where}: {line}" if where else line


def check_exported(
    exported: jax.export.Exported,
    step: Step,
    *,
    mesh: Any = None,
    allow_float64: bool = False,
) -> list[str]:
    """What in ``exported`` would not run as intended on an accelerator; empty when nothing.

    * a host callback: a ``custom_call`` whose target names a callback (``jax.pure_callback``,
      ``jax.debug.print``, ``io_callback``), which on TPU/GPU stops the device for the host;
    * a float64 value (``f64`` in the module), unless ``allow_float64``;
    * with ``mesh``: an input whose sharding (the one its ``ShapeDtypeStruct`` in ``step.args``
      carries) the exported module does not keep, e.g. a batch split over ``"data"`` that
      became replicated.

    Returns:
      One line per problem, naming the construct and the line of the module it is on.
    """
    lines = exported.mlir_module().splitlines()
    aliases = {m.group(1): m.group(2) for m in map(_LOC_ALIAS.match, lines) if m}
    problems = []
    for line in lines:
        if _LOC_ALIAS.match(line):
            continue
        for match in _CUSTOM_CALL.finditer(line):
            target = match.group(1) or match.group(2)
            if "callback" in target.lower():
                problems.append(f"host callback custom_call {target!r}: {_short(line, aliases)}")
        if not allow_float64 and _F64.search(line):
            problems.append(f"float64 value: {_short(line, aliases)}")
    if mesh is not None:
        problems += _lost_shardings(exported, step, mesh)
    return _capped(problems)


def _capped(problems: list[str], per_kind: int = 4) -> list[str]:
    """At most ``per_kind`` problems of each kind (the text before the first ':': host callback,
    float64 value, lost sharding), then a count of the rest."""
    out, counts = [], {}
    for p in problems:
        kind = p.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
        if counts[kind] <= per_kind:
            out.append(p)
    out += [f"{kind}: {n - per_kind} more" for kind, n in counts.items() if n > per_kind]
    return out


def lower_and_check(
    step: Step,
    *,
    mesh: Any = None,
    platforms: Sequence[str] = ("tpu", "cuda"),
    allow_float64: bool = False,
) -> list[str]:
    """:func:`export_step` then :func:`check_exported`; a failed export is a problem too, named
    by the platform(s) that fail (a host callback, for one, has no multi-platform lowering)."""
    callbacks = host_callbacks(step)
    if callbacks:  # (they have no multi-platform lowering: the export would fail obscurely)
        return [f"host callback {c}" for c in callbacks]
    try:
        exported = export_step(step, platforms=platforms)
    except Exception as e:
        failing = []
        for platform in platforms:
            try:
                export_step(step, platforms=(platform,))
            except Exception as e_one:
                failing.append(f"{platform}: {type(e_one).__name__}: {_first_line(e_one)}")
        detail = "; ".join(failing) or f"{type(e).__name__}: {_first_line(e)}"
        return [f"jax.export for {', '.join(platforms)} failed ({detail})"]
    return check_exported(exported, step, mesh=mesh, allow_float64=allow_float64)


# Primitives that call back into Python on the host (besides every "*callback*" primitive).
_HOST_PRIMITIVES = ("debug_print", "debug_callback", "pure_callback", "io_callback")


def host_callbacks(step: Step) -> list[str]:
    """The host callbacks (``jax.pure_callback``, ``io_callback``, ``jax.debug.print``/
    ``callback``) in ``step``'s jaxpr, each as ``"<primitive> at <file>:<line>"``."""
    found: list[str] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _HOST_PRIMITIVES or "callback" in eqn.primitive.name:
                found.append(f"{eqn.primitive.name} at {_user_line(eqn)}")
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(step.fn.trace(*step.args, **step.kwargs).jaxpr.jaxpr)
    return found


def _user_line(eqn: Any) -> str:
    """The innermost frame of ``eqn``'s traceback outside JAX, as ``file:line``."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:
        return "?"
    for frame in frames:
        if "/jax/" not in frame.file_name and not frame.file_name.endswith("common/lowering.py"):
            return f"{frame.file_name}:{frame.line_num}"
    return "?"


def _first_line(e: Exception, limit: int = 400) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= limit else text[:limit] + " ..."


def _spec(sharding: Any, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    spec = spec + (None,) * (ndim - len(spec))
    return tuple(None if s in ((), None) else s for s in spec)


def _lost_shardings(exported: jax.export.Exported, step: Step, mesh: Any) -> list[str]:
    got = exported.in_shardings_jax(mesh)
    leaves = jax.tree_util.tree_flatten_with_path((step.args, dict(step.kwargs)))[0]
    leaves = [(p, x) for p, x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if len(got) != len(leaves):
        return [f"{len(leaves)} abstract inputs but {len(got)} inputs in the exported module"]
    kept = set(exported.module_kept_var_idx)  # inputs the program does not read are dropped
    problems = []
    for i, ((path, x), have, aval) in enumerate(zip(leaves, got, exported.in_avals, strict=True)):
        if i not in kept:
            continue
        path, want = jax.tree_util.keystr(path), x.sharding
        want_spec = _spec(want, len(aval.shape))
        if all(s is None for s in want_spec):
            continue  # replicated or unspecified: nothing to keep
        have_spec = _spec(have, len(aval.shape))
        if have_spec != want_spec:
            problems.append(
                f"lost sharding: input {path} {aval.str_short()} was {P(*want_spec)}, "
                f"is {P(*have_spec)} in the exported module"
            )
    return problems
