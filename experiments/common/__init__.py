"""Shared training machinery for every experiment family (each module's docstrings are its API).

* :mod:`~experiments.common.loop`: ``fit`` (resumable, data-parallel, functional loop),
  ``FitResult``, ``fit_options``; :mod:`~experiments.common.steps`: the step ``fit`` jits
  (``fit_step`` for lowering, ``NonFiniteError``); :mod:`~experiments.common.batches`:
  ``MapBatches``; :mod:`~experiments.common.evaluation`: ``padded_batches``, ``padded_means``.
* :mod:`~experiments.common.options`: ``TrainOptions``, the run-wide options of every trainer
  (``config.train``, ``config.hardware``, ``config.profile``), one explicit value per run.
* :mod:`~experiments.common.sharding`: ``make_mesh``, ``shard_batch``, ``param_sharding``,
  ``initialize_distributed``.
* :mod:`~experiments.common.cost`: a run's throughput, FLOPs, utilisation, peak memory and
  profiler trace (``config.hardware``, ``config.profile``), used by ``fit`` and the sweeps.
* :mod:`~experiments.common.lowering`: ``Step`` (a jitted program on abstract arguments, what
  every experiment's ``steps(config, mesh)`` returns), ``export_step``,
  ``check_exported`` (host callbacks, float64, lost shardings) for the TPU/GPU lowering test.
* :mod:`~experiments.common.checkpoint`: orbax ``make_manager``, ``save``, ``restore_latest``.
* :mod:`~experiments.common.metrics`: ``MetricWriter`` (``metrics.jsonl`` + TensorBoard),
  ``write_config_json``, ``write_results_md``, ``read_metrics``.
* :mod:`~experiments.common.plots`: ``plot_metrics``, ``plot_curves`` (PNG).
* :mod:`~experiments.common.config_checks`: ``ConfigError`` and one-line ``check_*`` validators.
* :mod:`~experiments.common.sweep` (import it as a module): grids of small cells — ``CellStore``
  (resumable, one JSON per finished cell), ``train_scan`` / ``train_epochs``, ``mean_sd``,
  trend-check tables and ``write_sweep_results``.
* :mod:`~experiments.common.digits_shift`: the rotated-digits domain shift of the FrameFT and
  LoRA-DA studies; :mod:`~experiments.common.kge_report`: the KGE study's checks and tables.
* An experiment's own parts live here too, never in a module another experiment imports:
  ``<experiment>_report`` (its report writer: stored cells to ``results.md``, ``summary.json``,
  tables and plots), :mod:`~experiments.common.continual_setup` (the task streams and backbones
  of ``experiments/continual.py``) and :mod:`~experiments.common.continual_search` (its
  validation search).
* :mod:`~experiments.common.llm_fixture` (import it as a module): a random tiny Llama saved by
  ``transformers`` with a BPE tokenizer and JSONL files, what ``configs/llm_sft.py:smoke`` and
  the language-model data tests read.
"""

from experiments.common.batches import MapBatches, ResumableIterator
from experiments.common.checkpoint import CheckpointError, make_manager, restore_latest, save
from experiments.common.config_checks import (
    ConfigError,
    check_choice,
    check_divisible,
    check_fraction,
    check_nonnegative,
    check_positive,
    check_positive_ints,
    check_regexes,
    config_differences,
    explain_unknown_key,
    get_path,
)
from experiments.common.evaluation import padded_batches
from experiments.common.loop import FitResult, fit, fit_options
from experiments.common.lowering import Step, eval_shape_with_static, placed, sharded_batch
from experiments.common.metrics import (
    MetricWriter,
    json_safe,
    read_metrics,
    to_scalars,
    write_config_json,
    write_json,
    write_results_md,
)
from experiments.common.options import TrainOptions
from experiments.common.plots import plot_curves, plot_metrics
from experiments.common.sharding import (
    batch_sharding,
    initialize_distributed,
    make_mesh,
    param_sharding,
    replicated,
    shard_batch,
)
from experiments.common.steps import NonFiniteError, fit_step
from experiments.common.workdir import WorkdirError, lock_workdir

__all__ = [
    "CheckpointError",
    "ConfigError",
    "FitResult",
    "MapBatches",
    "MetricWriter",
    "NonFiniteError",
    "ResumableIterator",
    "Step",
    "TrainOptions",
    "WorkdirError",
    "batch_sharding",
    "check_choice",
    "check_divisible",
    "check_fraction",
    "check_nonnegative",
    "check_positive",
    "check_positive_ints",
    "check_regexes",
    "config_differences",
    "eval_shape_with_static",
    "explain_unknown_key",
    "fit",
    "fit_options",
    "fit_step",
    "get_path",
    "initialize_distributed",
    "json_safe",
    "lock_workdir",
    "make_manager",
    "make_mesh",
    "padded_batches",
    "param_sharding",
    "placed",
    "plot_curves",
    "plot_metrics",
    "read_metrics",
    "replicated",
    "restore_latest",
    "save",
    "shard_batch",
    "sharded_batch",
    "to_scalars",
    "write_config_json",
    "write_json",
    "write_results_md",
]
