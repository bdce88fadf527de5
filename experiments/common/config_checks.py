"""Config validation that fails before any computation, with messages that name the key.

Every experiment family validates its config in a ``check_config(config)`` function that
``experiments/train.py`` calls before ``run``; these helpers make such checks one line each::

    check_choice(config, "adapter.method", ("lora", "full", "head"))
    check_positive(config, "adapter.rank", integer=True)
    check_fraction(config, "data.valid_fraction")

Each raises :class:`ConfigError` (a ``ValueError``) whose message names the dotted key, the bad
value and what is allowed, e.g.
``config.adapter.rank=-1 is invalid: must be a positive integer (e.g. --config.adapter.rank=8)``.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from configs.common import ConfigError

__all__ = [
    "ConfigError",
    "check_choice",
    "check_divisible",
    "check_fit_options",
    "check_fraction",
    "check_nonnegative",
    "check_positive",
    "check_positive_ints",
    "check_regexes",
    "check_warmup",
    "config_differences",
    "explain_unknown_key",
    "get_path",
]


def _keys(node: Any) -> list[str]:
    return sorted(node.keys()) if isinstance(node, Mapping) or hasattr(node, "keys") else []


def get_path(config: Any, path: str) -> Any:
    """Returns ``config.<path>`` for a dotted ``path``.

    Args:
      config: an ``ml_collections.ConfigDict`` (or nested mappings).
      path: dotted key such as ``"adapter.rank"``.

    Returns:
      The value stored at ``path``.

    Raises:
      ConfigError: if a component of ``path`` does not exist; the message lists the keys that do.
    """
    node = config
    for part in path.split("."):
        if part not in _keys(node):
            raise ConfigError(explain_unknown_key(config, path))
        node = node[part]
    return node


def explain_unknown_key(config: Any, path: str) -> str | None:
    """Says why a dotted ``path`` does not exist in ``config``, or None if it does.

    Used for command-line overrides such as ``--config.optim.lrate=0.1``: the message names the
    first missing component, the keys that exist at that level and the closest match.

    Args:
      config: an ``ml_collections.ConfigDict`` (or nested mappings).
      path: dotted key, without the ``config.`` prefix.

    Returns:
      A one-line explanation, or None when ``path`` exists.
    """
    node = config
    parts = path.split(".")
    for i, part in enumerate(parts):
        keys = _keys(node)
        prefix = ".".join(parts[:i])
        where = f"config.{prefix}" if prefix else "config"
        if not keys:
            return f"config.{prefix} is a value ({node!r}), not a section: it has no key {part!r}"
        if part not in keys:
            close = difflib.get_close_matches(part, keys, n=1)
            hint = (
                f" Did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            )
            return (
                f"config.{path} does not exist: {where} has no key {part!r}; "
                f"its keys are {', '.join(keys)}.{hint}"
            )
        node = node[part]
    return None


def check_choice(config: Any, path: str, allowed: Sequence[Any]) -> Any:
    """Checks that ``config.<path>`` is one of ``allowed`` and returns it.

    Raises:
      ConfigError: naming the key, the value and the allowed values.
    """
    value = get_path(config, path)
    if value not in tuple(allowed):
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"config.{path}={value!r} is invalid: allowed values are {choices}")
    return value


def _is_number(value: Any, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    if integer:
        return isinstance(value, numbers.Integral)
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def check_positive(config: Any, path: str, *, integer: bool = False) -> Any:
    """Checks that ``config.<path>`` is a positive (integer) number and returns it.

    Raises:
      ConfigError: naming the key, the value and what is allowed.
    """
    value = get_path(config, path)
    kind = "a positive integer" if integer else "a positive finite number"
    if not _is_number(value, integer) or value <= 0:
        raise ConfigError(f"config.{path}={value!r} is invalid: must be {kind}")
    return value


def check_nonnegative(config: Any, path: str, *, integer: bool = False) -> Any:
    """Checks that ``config.<path>`` is a number >= 0 (0 usually means "off") and returns it.

    Raises:
      ConfigError: naming the key, the value and what is allowed.
    """
    value = get_path(config, path)
    kind = "an integer >= 0" if integer else "a finite number >= 0"
    if not _is_number(value, integer) or value < 0:
        raise ConfigError(f"config.{path}={value!r} is invalid: must be {kind}")
    return value


def check_fraction(config: Any, path: str, *, allow_zero: bool = True) -> float:
    """Checks that ``config.<path>`` lies in [0, 1) (or (0, 1) without ``allow_zero``).

    Raises:
      ConfigError: naming the key, the value and the allowed interval.
    """
    value = get_path(config, path)
    interval = "[0, 1)" if allow_zero else "(0, 1)"
    if not _is_number(value, False) or not (0 <= value < 1) or (value == 0 and not allow_zero):
        raise ConfigError(f"config.{path}={value!r} is invalid: must lie in {interval}")
    return value


def check_positive_ints(config: Any, path: str) -> tuple[int, ...]:
    """Checks that ``config.<path>`` is a non-empty tuple (or list) of positive ints; returns it.

    Raises:
      ConfigError: naming the key, the value and an example of a valid one.
    """
    value = get_path(config, path)
    if (
        not isinstance(value, tuple | list)
        or not value
        or any(not _is_number(v, True) or v < 1 for v in value)
    ):
        raise ConfigError(
            f"config.{path}={value!r} is invalid: must be a non-empty tuple of positive ints, "
            "e.g. (64, 64)"
        )
    return tuple(value)


def check_regexes(config: Any, path: str) -> tuple[str, ...]:
    """Checks that ``config.<path>`` is a non-empty tuple of valid regexes; returns it.

    Raises:
      ConfigError: naming the key and the value, or the first regex that does not compile.
    """
    value = get_path(config, path)
    if (
        not isinstance(value, tuple | list)
        or not value
        or any(not isinstance(v, str) for v in value)
    ):
        raise ConfigError(
            f"config.{path}={value!r} is invalid: must be a non-empty tuple of regexes, "
            "e.g. ('.*attention/(query|value)/kernel',)"
        )
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"config.{path} has an invalid regex {pattern!r}: {e}") from e
    return tuple(value)


def check_divisible(config: Any, path: str, divisor: int, *, why: str) -> int:
    """Checks that the integer ``config.<path>`` is a multiple of ``divisor``.

    Args:
      config: the config.
      path: dotted key of an integer, e.g. ``"data.batch_size"``.
      divisor: e.g. the number of devices.
      why: what ``divisor`` is, for the message (``"the 8 devices"``).

    Raises:
      ConfigError: naming the key, the value and the nearest valid values.
    """
    value = check_positive(config, path, integer=True)
    if value % divisor:
        lower = max(divisor, value - value % divisor)
        raise ConfigError(
            f"config.{path}={value} is invalid: must be a multiple of {divisor} ({why}); "
            f"try {lower} or {lower + divisor}"
        )
    return value


def check_warmup(
    config: Any, steps: str = "schedule.num_steps", warmup: str = "schedule.warmup_steps"
) -> tuple[int, int]:
    """Checks a schedule's length (a positive integer) and its warm-up (an integer below it).

    Args:
      config: the config.
      steps: dotted key of the number of steps.
      warmup: dotted key of the warm-up steps (0: none).

    Returns:
      ``(steps, warmup)``.

    Raises:
      ConfigError: naming the first bad key and its value.
    """
    num_steps = check_positive(config, steps, integer=True)
    num_warmup = check_nonnegative(config, warmup, integer=True)
    if num_warmup >= num_steps:
        raise ConfigError(f"config.{warmup}={num_warmup} is invalid: must be < {steps}={num_steps}")
    return num_steps, num_warmup


def check_fit_options(config: Any) -> None:
    """Checks the keys ``experiments.common.fit_options`` reads that must be positive integers:
    ``ckpt.every``, ``ckpt.max_to_keep``, ``log.every`` (in that order).

    Raises:
      ConfigError: naming the first bad key and its value.
    """
    for path in ("ckpt.every", "ckpt.max_to_keep", "log.every"):
        check_positive(config, path, integer=True)


def config_differences(
    old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = ""
) -> list[str]:
    """Lists the dotted keys whose values differ between two nested dicts (e.g. config.json files).

    Args:
      old: nested dict, e.g. ``json.load`` of a workdir's ``config.json``.
      new: nested dict, e.g. ``config.to_dict()`` after a JSON round trip.
      prefix: used in recursion.

    Returns:
      Sorted dotted keys that exist in only one of them or hold different values.
    """
    out = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        a, b = old.get(key, "<missing>"), new.get(key, "<missing>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(config_differences(a, b, prefix=name + "."))
        elif a != b:
            out.append(name)
    return out
