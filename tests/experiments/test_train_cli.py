"""``python -m experiments.train``: a smoke run end to end, and configs that must fail early."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import digits_mlp, lora_finetune
from configs import saber as saber_config
from experiments import common, continual, train

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = "--config=configs/digits_mlp.py:smoke"


def run_cli(*args: str, workdir: os.PathLike, env: dict | None = None, timeout: float = 300):
    """Runs the entry point in a fresh process (CPU only) and returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "experiments.train", *args, f"--workdir={workdir}"]
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    return subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def final_metrics(stdout: str) -> dict:
    """The JSON dict that ``experiments.train`` prints last on stdout."""
    return json.loads(stdout[stdout.index("{") :])


def test_smoke_run_writes_every_output(tmp_path):
    workdir = tmp_path / "run"
    proc = run_cli(SMOKE, "--config.log.progress=False", workdir=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = final_metrics(proc.stdout)
    assert metrics["steps"] == 40 and not metrics["interrupted"]
    assert metrics["method"] == "full"
    assert (
        metrics["trainable_params"] == metrics["total_params"] == 2 * (64 * 64 + 64) + 64 * 10 + 10
    )
    # 40 steps of Adam on digits: well above chance (0.1); the exact value is pinned by the
    # resume and device tests, which compare runs against each other.
    assert metrics["test/accuracy"] > 0.5

    config = digits_mlp.get_config("smoke")
    config.log.progress = False
    stored = json.loads((workdir / "config.json").read_text())
    assert stored == json.loads(json.dumps(config.to_dict()))

    records = common.read_metrics(workdir)
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == list(range(5, 41, 5))
    evals = [r for r in records if "valid/accuracy" in r]
    assert [r["step"] for r in evals] == [10, 20, 30, 40]
    assert evals[-1]["valid/accuracy"] == pytest.approx(metrics["valid/accuracy"], abs=1e-12)
    # The logged training loss goes down.
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0]

    results = (workdir / "results.md").read_text()
    assert "| test accuracy |" in results
    assert f"{metrics['test/accuracy']:.4f}" in results
    for png in ("loss.png", "accuracy.png"):
        assert (workdir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert (workdir / "checkpoints" / "40").is_dir()


def test_unknown_override_key_fails_before_computation(tmp_path):
    workdir = tmp_path / "run"
    proc = run_cli(SMOKE, "--config.optim.learning_rat=0.1", workdir=workdir, timeout=120)
    assert proc.returncode != 0
    assert "config.optim.learning_rat does not exist" in proc.stderr
    assert "grad_clip, learning_rate, name, weight_decay" in proc.stderr
    assert "Did you mean 'optim.learning_rate'?" in proc.stderr
    assert not workdir.exists()


def test_invalid_value_fails_before_computation(tmp_path):
    workdir = tmp_path / "run"
    proc = run_cli(
        "--config=configs/digits_mlp.py:smoke,method=lora",
        "--config.adapter.rank=-1",
        workdir=workdir,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "config.adapter.rank=-1 is invalid: must be a positive integer" in proc.stderr
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("adapter.rank", 0, "config.adapter.rank=0 is invalid: must be a positive integer"),
        ("adapter.alpha", -2.0, "config.adapter.alpha=-2.0 is invalid: must be a positive"),
        (
            "adapter.method",
            "dora",
            "config.adapter.method='dora' is invalid: allowed values are 'lora', 'full', 'head'",
        ),
        (
            "data.name",
            "imagenet",
            "config.data.name='imagenet' is invalid: allowed values are 'shakespeare_genre', "
            "'digits'",
        ),
        ("model.name", "minilm", "config.data.name='digits' does not fit config.model.name"),
        ("schedule.warmup_steps", 400, "must be < schedule.num_steps=400"),
        ("data.valid_fraction", 1.5, "config.data.valid_fraction=1.5 is invalid: must lie in"),
        ("adapter.targets", ("(",), "config.adapter.targets has an invalid regex '('"),
        ("adapter.targets", (), "config.adapter.targets=() is invalid: must be a non-empty tuple"),
        (
            "model.features",
            (64, 0),
            "config.model.features=(64, 0) is invalid: must be a non-empty",
        ),
        ("model.features", (), "config.model.features=() is invalid: must be a non-empty tuple"),
        ("experiment", "nope", "config.experiment='nope' is invalid: allowed values are"),
    ],
)
def test_bad_values_name_the_key_and_allowed_values(key, value, message):
    config = digits_mlp.get_config("method=lora")
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(common.ConfigError) as err:
        train.load_experiment(config)
    assert message in str(err.value)


def test_config_args_are_parsed_and_checked():
    config = lora_finetune.get_config("smoke,method=full")
    assert config.adapter.method == "full" and config.schedule.num_steps == 10
    assert config.optim.learning_rate == lora_finetune.LEARNING_RATES["full"]
    with pytest.raises(common.ConfigError, match="unknown config arg 'smok'.*smoke=False"):
        lora_finetune.get_config("smok")
    with pytest.raises(common.ConfigError, match="smoke=.maybe.: expected a boolean"):
        digits_mlp.get_config("smoke=maybe")


def test_default_workdir_and_mismatched_resume(tmp_path):
    assert train.default_workdir("configs/lora_finetune.py") == os.path.join(
        "runs", "lora_finetune"
    )
    assert train.default_workdir("configs/lora_finetune.py:smoke,method=full") == os.path.join(
        "runs", "lora_finetune_smoke_method=full"
    )
    common.write_config_json(tmp_path, digits_mlp.get_config("smoke"))
    train._check_workdir(str(tmp_path), digits_mlp.get_config("smoke"))  # same config: resumable
    relogged = digits_mlp.get_config("smoke")
    relogged.log.progress, relogged.parallel.fsdp = False, True
    relogged.train.skip_nonfinite = True  # a run stopped by a NaN may resume skipping such steps
    train._check_workdir(str(tmp_path), relogged)  # logging and device layout may change
    # Without a checkpoint nothing can be resumed: a failed start's config.json is just replaced.
    train._check_workdir(str(tmp_path), digits_mlp.get_config())
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    with pytest.raises(common.ConfigError, match=r"holds a run of a different config") as err:
        train._check_workdir(str(tmp_path), digits_mlp.get_config())
    assert "schedule.num_steps" in str(err.value) and "--workdir" in str(err.value)
    # A continual run keeps its checkpoints per task, three levels down.
    deep = tmp_path / "continual"
    common.write_config_json(deep, digits_mlp.get_config("smoke"))
    (deep / "saber" / "seed_0" / "task_1" / "checkpoints" / "30").mkdir(parents=True)
    with pytest.raises(common.ConfigError, match=r"holds a run of a different config"):
        train._check_workdir(str(deep), digits_mlp.get_config())


def test_a_continual_workdir_grows_by_appended_seeds_and_methods_only(tmp_path):
    def config(**overrides):
        c = saber_config.get_config("smoke")
        for key, value in {"seeds": (0,), "methods": ("saber", "joint"), **overrides}.items():
            setattr(c, key, value)
        return c

    common.write_config_json(tmp_path, config())
    (tmp_path / "saber" / "seed_0" / "task_0" / "checkpoints" / "30").mkdir(parents=True)
    grows = continual.GROWABLE
    train._check_workdir(str(tmp_path), config(seeds=(0, 1, 2)), grows)
    train._check_workdir(str(tmp_path), config(methods=("saber", "joint", "inflora")), grows)
    refused = [
        config(seeds=(1, 2)),  # the validation search ran on seed 0, the first seed
        config(seeds=(1, 0)),
        config(methods=("joint", "saber")),
        config(seeds=(0, 1), head="masked"),
    ]
    for c in refused:
        with pytest.raises(common.ConfigError, match=r"holds a run of a different config"):
            train._check_workdir(str(tmp_path), c, grows)
    with pytest.raises(common.ConfigError, match=r"seeds may only grow by appending entries"):
        train._check_workdir(str(tmp_path), config(seeds=(1, 2)), grows)
    with pytest.raises(common.ConfigError, match=r"keys seeds differ\)"):
        train._check_workdir(str(tmp_path), config(seeds=(0, 1)))  # growth is opt-in


def test_configs_import_no_experiment_code():
    """Reading a config loads neither the runner nor orbax (configs import only configs.common)."""
    code = (
        "import importlib, pathlib, sys\n"
        "for f in sorted(pathlib.Path('configs').glob('*.py')):\n"
        "    importlib.import_module('configs.' + f.stem)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'experiments', 'orbax'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def test_help_lists_configs_with_options_and_a_missing_config_lists_them(tmp_path):
    proc = run_cli("--help", workdir=tmp_path)
    assert "configs/lora_finetune.py  [smoke=False, method='lora', kind='lora']" in proc.stdout
    proc = run_cli("--config=configs/nope.py", workdir=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "FATAL --config=configs/nope.py: no such file. Available configs:" in proc.stderr
    assert "  configs/saber.py" in proc.stderr
    for path, _ in train.available_configs():  # every listed config loads
        assert os.path.isfile(REPO / path)


def test_an_unknown_config_arg_is_one_line_without_traceback(tmp_path):
    proc = run_cli("--config=configs/saber.py:smoke,bogus=3", workdir=tmp_path / "run")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith(
        "FATAL --config=configs/saber.py:smoke,bogus=3: unknown config arg 'bogus' in "
        "'smoke,bogus=3': allowed are smoke=False, method='all', "
    ), line
    assert not (tmp_path / "run").exists()
