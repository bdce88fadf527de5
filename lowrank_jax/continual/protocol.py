r"""The continual-learning protocol: a method is a value, its memory an explicit pytree.

A :class:`ContinualMethod` is a ``NamedTuple`` of pure functions (as an
``optax.GradientTransformation`` is), returned by a factory whose hyper-parameters are keyword
arguments (:func:`~lowrank_jax.continual.saber`, :func:`~lowrank_jax.continual.gr_lora`,
:func:`~lowrank_jax.continual.sequential_lora`, ...). Everything a method remembers between tasks
is a :class:`ContinualState`; nothing is stored on the method. A user's own loop::

    method = continual.saber(model.apply, targets=(r"params/dense_\d+/kernel",), rank=4,
                             learning_rate=3e-3)
    state = method.init(variables)                        # the pretrained backbone + head
    for t, task in enumerate(tasks):                      # continual.Task(index, classes, x, y, C)
        trainable, frozen, tx = method.begin_task(state, jax.random.key(t), task)
        opt_state = tx.init(trainable)
        for batch in batches(task):                       # {"x", "y", "mask"}
            def loss_fn(tr):
                ce = continual.masked_cross_entropy(method.apply(tr, frozen, batch["x"]),
                                                    batch["y"], batch["mask"])
                return ce + method.loss(tr, frozen, batch, key)
            grads = jax.grad(loss_fn)(trainable)
            updates, opt_state = tx.update(grads, opt_state, trainable)
            trainable = optax.apply_updates(trainable, updates)
        state = method.end_task(state, trainable, frozen, task)
        logits, selected = method.predict(state, x_test)

The objective (cross-entropy over the current task's classes) belongs to the caller; a method
adds only its penalties (:attr:`ContinualMethod.loss`). The classifier head is a separate
component of the state (:attr:`ContinualState.head`, the subtree at ``head_path`` of the model's
variables): methods train it with each task and write it back, but never mix it into
:attr:`ContinualState.params`, so a class-incremental head (classifier alignment from per-class
statistics, a prototype head) can replace or refit ``state.head`` between ``end_task`` and
evaluation for every method alike. What such a head reads is :attr:`ContinualMethod.features`:
the head's inputs under the consolidated model, ``f: (b, d)`` with ``logits = f W + b`` for a
dense head ``state.head = {"kernel": W, "bias": b}``.

A method written by hand must provide ``features`` consistent with its ``predict``: the same
modules, adapters and per-example choices, with the head left out. For a forward whose head (at
``head_path``) is its last layer, its output reaching the logits unchanged up to indexing,
:func:`~lowrank_jax.continual.capture.head_features` computes them in one forward pass with the
head replaced by the identity; every factory of the library builds its ``features`` so from its
``apply_fn`` and ``head_path``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.adapters.paths import named_leaves

__all__ = [
    "ContinualMethod",
    "ContinualState",
    "Task",
    "kernel_paths",
    "masked_cross_entropy",
]


class Task(NamedTuple):
    """What a method may know about the task it learns.

    Attributes:
      index: ``t``, the task's position in the stream (0-based).
      classes: ``(k,)`` the task's global class ids.
      x: ``(N, ...)`` its training inputs (the model's input layout): a host array, or any
        row-sliceable sequence (``len(x)``, ``x[i:j]`` a NumPy array) whose rows are read on
        demand, such as :class:`lowrank_jax.data.ImageRows` for a dataset that does not fit in
        memory. Methods read it a batch at a time (features, class statistics) or a prefix
        (``x[:memory_examples]`` for the subspace memories), never whole.
      y: ``(N,)`` their global labels (a host array).
      num_classes: ``C``, the head's width (all classes of the stream).
    """

    index: int
    classes: np.ndarray
    x: np.ndarray
    y: np.ndarray
    num_classes: int


class ContinualState(NamedTuple):
    """A method's memory between tasks: a pytree (it survives ``jit``, ``device_get`` and orbax).

    Attributes:
      params: the backbone's variables with every consolidated update merged in, without the head.
      head: the classifier head's parameters (the subtree at the method's ``head_path``).
      kernels: ``{path: W₀}`` the adapted kernels as the backbone had them before any task.
      memory: the GPM memories of layer inputs (InfLoRA, GPM-LoRA, GR-LoRA; SABER's shared
        subspace ``U_s``) as a pytree shaped like ``params``: a
        :class:`~lowrank_jax.optim.SubspaceMemory` at each adapted kernel, ``None`` at every other
        leaf (:func:`~lowrank_jax.optim.init_memories`); ``None`` for methods without one.
      update: ``{path: ΔW_t}`` the last task's own update (before consolidation), a diagnostic.
      extra: the method's own record (:class:`~lowrank_jax.continual.saber.SaberState`,
        :class:`~lowrank_jax.continual.gr_lora.GRLoRAState`,
        :class:`~lowrank_jax.continual.methods.SDLoRAState`,
        :class:`~lowrank_jax.continual.methods.OLoRAState`, or ``()``).
    """

    params: Any
    head: Any
    kernels: dict[str, jax.Array]
    memory: Any
    update: dict[str, jax.Array]
    extra: Any


class ContinualMethod(NamedTuple):
    """A continual-learning method as pure functions (see the module docstring for a loop).

    Attributes:
      init: ``(variables) -> ContinualState`` from the pretrained model's variables (head
        included, at ``head_path``).
      begin_task: ``(state, key, task) -> (trainable, frozen, tx)``: the pytree to train for
        ``task`` (adapters and the head), what the forward needs besides it, and the optax
        transformation to train it with.
      apply: ``(trainable, frozen, x) -> logits (b, C)``, the training-time forward.
      loss: ``(trainable, frozen, batch, key) -> scalar``, the method's penalties, added to the
        caller's objective (0 for methods without one); ``batch["x"]`` the inputs.
      end_task: ``(state, trainable, frozen, task) -> state``: consolidates the trained pytree.
      predict: ``(state, x, task_id=None) -> (logits (b, C), selected (b,) int or None)``:
        test-time logits; ``task_id`` when the protocol gives it (task-incremental), ``selected``
        the module a method chose per example when it chooses one (GR-LoRA), else None.
      features: ``(state, x, task_id=None) -> (b, d)``: what ``state.head`` reads in
        ``predict`` (the head's inputs, for the same ``task_id`` and the same per-example
        choice), so that ``predict``'s logits are ``features @ head["kernel"] + head["bias"]``
        for a dense head; the class-incremental heads
        (:func:`~lowrank_jax.continual.with_head`) are fitted to it.
      diagnostics: ``(state) -> dict`` of JSON-able diagnostics of the last consolidation.
    """

    init: Callable[[Any], ContinualState]
    begin_task: Callable[[ContinualState, jax.Array, Task], tuple[Any, Any, Any]]
    apply: Callable[[Any, Any, jax.Array], jax.Array]
    loss: Callable[[Any, Any, Any, jax.Array], jax.Array]
    end_task: Callable[[ContinualState, Any, Any, Task], ContinualState]
    predict: Callable[..., tuple[jax.Array, jax.Array | None]]
    features: Callable[..., jax.Array]
    diagnostics: Callable[[ContinualState], dict[str, Any]]


# ----------------------------------------------------------------------------------------------
# Helpers shared by the methods.


def kernel_paths(variables: Any, targets: Sequence[str]) -> list[str]:
    """Paths of the leaves of ``variables`` that fully match one of the ``targets`` regexes.

    Raises:
      ValueError: no leaf matches (the message lists the paths).
    """
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets must be a non-empty sequence of regexes, got {targets!r}.")
    names = named_leaves(variables)
    out = [n for n in names if any(re.fullmatch(t, n) for t in targets)]
    if not out:
        raise ValueError(f"targets {tuple(targets)!r} match no kernel; the paths are {list(names)}")
    return out


def masked_cross_entropy(
    logits: jax.typing.ArrayLike, labels: jax.typing.ArrayLike, mask: jax.typing.ArrayLike
) -> jax.Array:
    """Mean cross-entropy over the classes where ``mask`` is true (others get logit −1e9).

    Args:
      logits: ``(b, C)``.
      labels: ``(b,)`` integer classes (inside the mask).
      mask: ``(C,)`` or ``(b, C)`` booleans, e.g. the current task's classes.
    """
    z = jnp.where(mask, logits, -1e9)
    return optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()
