"""One explicit options value per run (``experiments.common.TrainOptions``): every trainer gets it
passed in, an experiment's ``run`` builds it from its config when not given one (so a notebook
trains as the command line does), and ``experiments/common`` stays in modules of at most 400
lines."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from configs import digits_mlp
from experiments import common
from experiments.common import cost

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
# A call of one of these (``common.fit``, ``sweep.train_scan``, ...) trains, or stores cells.
TRAINERS = {"common": {"fit"}, "sweep": {"train_scan", "train_epochs", "CellStore"}}


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in EXPERIMENTS.rglob("*.py") if "bench" not in p.parts)


def _trainer_calls(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, name, passes options=)`` of every trainer call in the module at ``path``."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.attr in TRAINERS.get(node.func.value.id, ())
        ):
            passes = any(k.arg == "options" for k in node.keywords)
            calls.append((node.lineno, f"{node.func.value.id}.{node.func.attr}", passes))
    return calls


def test_every_trainer_call_of_the_experiments_passes_the_runs_options():
    calls = {p: _trainer_calls(p) for p in _sources()}
    assert sum(len(c) for c in calls.values()) > 40  # the check sees the calls
    missing = [
        f"{path.relative_to(REPO)}:{line}: {name}(...) without options="
        for path, found in calls.items()
        for line, name, passes in found
        if not passes
    ]
    assert not missing, "\n".join(missing)


def test_every_experiment_run_takes_the_options_after_the_workdir():
    runs = 0
    for path in sorted(EXPERIMENTS.glob("*.py")):
        module = importlib.import_module(f"experiments.{path.stem}")
        run = getattr(module, "run", None)
        if run is None or path.stem == "train":
            continue
        params = list(inspect.signature(run).parameters.values())
        assert [p.name for p in params[:3]] == ["config", "workdir", "options"], path.name
        assert params[2].default is None, path.name
        runs += 1
    assert runs >= 20


# Imports of one experiment module by another still to move to experiments/common with the
# conversion of that experiment (issue #45 item 1); the test fails once an entry is stale.
SIBLING_IMPORTS_LEFT = {
    "experiments/subspace_diffusion.py": {"subspace_diffusion_mlp", "subspace_diffusion_report"},
}


def _imported_modules(source: str, package: str) -> set[str]:
    """The dotted names of the modules that ``source`` (a module of ``package``) imports:
    ``from experiments import x`` counts as ``experiments`` and ``experiments.x``, relative
    imports are resolved against ``package``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _experiment_imports(path: pathlib.Path, experiments: set[str]) -> set[str]:
    """The experiment modules (names in ``experiments``) that the module at ``path`` imports."""
    package = ".".join(path.relative_to(REPO).parent.parts)
    dotted = [n.split(".") for n in _imported_modules(path.read_text(), package)]
    return {p[1] for p in dotted if len(p) > 1 and p[0] == "experiments"} & experiments


def test_the_import_scan_sees_every_form_of_import():
    source = "import experiments.kge as k\nfrom experiments import sbvi\nfrom . import gist\n"
    source += "from .common import sweep\nfrom experiments.tfft import run\n"
    names = _imported_modules(source, "experiments")
    assert {"experiments.kge", "experiments.sbvi", "experiments.gist"} <= names
    assert {"experiments.common.sweep", "experiments.tfft"} <= names
    assert _imported_modules("from .. import casa\n", "experiments.common") >= {"experiments.casa"}


def test_no_experiment_module_imports_another():
    """What experiments share lives in ``experiments/common`` or the library: no module under
    ``experiments/`` imports an experiment module (``experiments/<name>.py``)."""
    experiments = {p.stem for p in EXPERIMENTS.glob("*.py")} - {"__init__"}
    assert {"casa", "continual", "kge"} <= experiments
    found = {
        str(path.relative_to(REPO)): own
        for path in sorted(EXPERIMENTS.rglob("*.py"))
        if (own := _experiment_imports(path, experiments))
    }
    left = SIBLING_IMPORTS_LEFT
    extra = {k: sorted(v - left.get(k, set())) for k, v in found.items() if v - left.get(k, set())}
    assert not extra, f"import what they share from experiments/common instead: {extra}"
    stale = {k: sorted(v - found.get(k, set())) for k, v in left.items() if v - found.get(k, set())}
    assert not stale, f"drop from SIBLING_IMPORTS_LEFT: {stale}"


def test_no_context_variable_configures_the_experiments():
    found = [
        str(p.relative_to(REPO))
        for p in EXPERIMENTS.rglob("*.py")
        if "contextvars" in p.read_text()
    ]
    assert not found, found


def test_no_module_of_experiments_common_exceeds_400_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in (EXPERIMENTS / "common").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


def test_run_without_options_builds_them_from_its_config(tmp_path, monkeypatch):
    """A notebook's ``lora_finetune.run(config, workdir)`` trains with ``config.train``,
    ``config.hardware`` and ``config.profile``, as ``python -m experiments.train`` does."""
    from experiments import lora_finetune

    config = digits_mlp.get_config("smoke,method=lora")
    config.train.skip_nonfinite, config.train.max_loss = True, 5.0
    config.hardware.peak_tflops = 3.0
    config.profile.start_step, config.profile.num_steps = 4, 2
    seen = []

    class Stop(Exception):
        pass

    def fit(*args, options, **kwargs):
        seen.append(options)
        raise Stop

    monkeypatch.setattr(common, "fit", fit)
    with pytest.raises(Stop):
        lora_finetune.run(config, str(tmp_path))
    (options,) = seen
    assert options == common.TrainOptions(
        skip_nonfinite=True,
        max_loss=5.0,
        peak_tflops=3.0,
        profile_start=4,
        profile_steps=2,
        profile_dir=str(tmp_path / "profile"),
    )
    # Given options are used as they are (the runner's, with its config.json hook).
    given = common.TrainOptions(max_loss=7.0)
    with pytest.raises(Stop):
        lora_finetune.run(config, str(tmp_path), given)
    assert seen[-1] is given


def test_the_log_is_shared_but_not_compared():
    a, b = common.TrainOptions(max_loss=1.0), common.TrainOptions(max_loss=1.0)
    a.log.rows.append({"label": "x"})
    assert a == b and hash(a) == hash(b) and not b.log.rows
    calls = []
    log = common.TrainOptions.from_config({}, on_start=lambda: calls.append(1)).log
    log.started()
    log.started()
    assert calls == [1]


def test_the_runner_appends_the_cost_table_only_to_a_results_file(tmp_path):
    options = common.TrainOptions(peak_tflops=None)
    row = {"label": "fit", "steps": 3, "seconds": 1.0, "examples": 8, "tokens": 0, "flops": 1e3}
    options.log.rows.append(row)
    cost.append_cost_table(tmp_path, options)  # no results.md: nothing written
    assert not (tmp_path / "results.md").exists()
    (tmp_path / "results.md").write_text("# results\n")
    cost.append_cost_table(tmp_path, options)
    text = (tmp_path / "results.md").read_text()
    assert "## Cost" in text and "| fit | 1 | 3 |" in text and "no peak TFLOP/s known" in text
