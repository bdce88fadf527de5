"""What configs share: ``parse_arg`` (big_vision-style structural options for ``get_config(arg)``),
``train_section`` (the options of the shared training loop), ``hardware_section`` and
``profile_section`` (what a run's cost is measured against, and a profiler trace) and
``ConfigError``.

Configs import only this module (and ``ml_collections``), so reading a config loads neither the
experiment runner nor orbax or absl flags.

``--config=configs/lora_finetune.py:smoke,method=full`` calls ``get_config("smoke,method=full")``;
a config turns that string into typed options with::

    def get_config(arg=None):
        arg = parse_arg(arg, smoke=False, method="lora")   # arg.smoke -> True, arg.method -> "full"
"""

from __future__ import annotations

import types
from typing import Any

import ml_collections
from ml_collections import config_dict

__all__ = [
    "PEAK_TFLOPS",
    "ConfigError",
    "hardware_section",
    "parse_arg",
    "profile_section",
    "train_section",
]


class ConfigError(ValueError):
    """A config key that does not exist, or a value that cannot work."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _cast(name: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"config arg {name}={text!r}: expected a boolean (true/false)")
    if isinstance(default, int | float):
        try:
            return type(default)(text)
        except ValueError as e:
            raise ConfigError(
                f"config arg {name}={text!r}: expected {type(default).__name__}"
            ) from e
    return text


def parse_arg(arg: str | None, **defaults: Any) -> types.SimpleNamespace:
    """Parses ``"smoke,method=full,rank=4"`` into typed options, starting from ``defaults``.

    A bare name (``smoke``) sets a boolean option to True; ``name=value`` casts ``value`` to the
    type of the default (bool, int, float or str).

    Args:
      arg: the text after ``:`` in ``--config=file.py:<arg>`` (None or "" for no options).
      **defaults: every allowed option with its default value.

    Returns:
      A namespace with one attribute per option.

    Raises:
      ConfigError: for an option not in ``defaults`` (the message lists the allowed ones) or a
        value of the wrong type.

    Example:
      >>> parse_arg("smoke,method=full", smoke=False, method="lora")
      namespace(smoke=True, method='full')
    """
    options = dict(defaults)
    for token in (arg or "").split(","):
        token = token.strip()
        if not token:
            continue
        name, has_value, text = token.partition("=")
        name = name.strip()
        if name not in defaults:
            raise ConfigError(
                f"unknown config arg {name!r} in {arg!r}: allowed are "
                + ", ".join(f"{k}={v!r}" for k, v in defaults.items())
            )
        if not has_value:
            if not isinstance(defaults[name], bool):
                raise ConfigError(f"config arg {name!r} needs a value: write {name}=<value>")
            options[name] = True
        else:
            options[name] = _cast(name, text.strip(), defaults[name])
    return types.SimpleNamespace(**options)


def train_section() -> ml_collections.ConfigDict:
    """``config.train``: options of the shared training loop, in every config that trains through it.

    They become the run's ``experiments.common.TrainOptions`` (built by the runner, ``python -m
    experiments.train``, or by the experiment's ``run(config, workdir)`` when called without
    one), which every ``experiments.common.fit`` call of the experiment is given:

    * ``skip_nonfinite`` (default False): a step whose loss, metrics or new state are NaN/Inf keeps
      the previous state and is counted in ``train/skipped_steps`` (as ``optax.apply_if_finite``),
      instead of stopping the run with a message that names the step and the last good
      checkpoint. It may be switched on to resume a run that stopped that way:
      ``--config.train.skip_nonfinite=True``.
    * ``max_loss`` (default 0: off): a step whose training loss exceeds it is treated as a
      non-finite one (the run stops, or the step is skipped with ``skip_nonfinite``). A finite
      divergence (a learning rate of 1e9 gives a loss of 1e32 and chance accuracy) passes every
      NaN check; ``--config.train.max_loss=1e3`` catches it.
    """
    c = ml_collections.ConfigDict()
    c.skip_nonfinite = False
    c.max_loss = 0.0
    return c


# Peak dense bf16 TFLOP/s of one JAX device (one chip), from the vendors' data sheets: what
# ``hardware.peak_tflops`` is, by accelerator. ``experiments.common.cost.PEAK_TFLOPS`` detects them
# from ``jax.devices()[0].device_kind`` (a test keeps the two tables equal).
PEAK_TFLOPS = {
    "TPU v4": 275.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v6e": 918.0,
    "NVIDIA A100": 312.0,
    "NVIDIA H100 SXM": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H200": 989.0,
}


def hardware_section() -> ml_collections.ConfigDict:
    """``config.hardware``: what a run's cost (``cost/*`` in ``metrics.jsonl``) is measured against.

    * ``peak_tflops`` (default None: detected from ``jax.devices()[0].device_kind``; unknown, so
      no utilisation, on CPU): the peak dense bf16 TFLOP/s of one device, against which
      ``cost/utilisation`` = achieved FLOP/s per device / peak is reported. Defaults
      (:data:`PEAK_TFLOPS`): TPU v4 275, v5e 197, v5p 459, v6e 918; NVIDIA A100 312, H100 SXM
      989 (PCIe 756), H200 989. Set it for other hardware or another precision, e.g.
      ``--config.hardware.peak_tflops=67`` (H100 SXM, float32).
    """
    c = ml_collections.ConfigDict()
    c.peak_tflops = config_dict.placeholder(float)
    return c


def profile_section() -> ml_collections.ConfigDict:
    """``config.profile``: a ``jax.profiler`` trace of some training steps (default off).

    ``--config.profile.start_step=N --config.profile.num_steps=K`` traces steps ``N .. N+K-1`` of
    the run's first ``fit`` that reaches step ``N`` into ``<workdir>/profile``
    (``plugins/profile/<session>/*.xplane.pb``); open it with ``tensorboard --logdir
    <workdir>/profile`` (the profile plugin, ``pip install tensorboard-plugin-profile``).
    ``num_steps = 0`` (the default) takes no trace; step 1 includes compilation, so the default
    start is step 10.
    """
    c = ml_collections.ConfigDict()
    c.start_step = 10
    c.num_steps = 0
    return c
