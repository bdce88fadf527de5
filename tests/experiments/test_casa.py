"""The CASA experiment's config checks (the run itself is exercised by the full command)."""

from __future__ import annotations

import pytest

from configs import casa as casa_config
from experiments import casa, common


def test_configs_pass_their_checks():
    for arg in (None, "smoke"):
        casa.check_config(casa_config.get_config(arg))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("data.lora_plays", ("hamlet", "not_a_play"), "lora_plays"),
        ("model.first_layer", 6, "first_layer"),
        ("merge.ties", ((0.0, 1.0),), "merge.ties"),
        ("merge.casa", ((0.5, -1.0),), "merge.casa"),
        ("merge.rank", 0, "merge.rank"),
    ],
)
def test_bad_values_are_named(key, value, match):
    config = casa_config.get_config("smoke")
    section, name = key.split(".")
    with config.unlocked():
        config[section][name] = value
    with pytest.raises(common.ConfigError, match=match):
        casa.check_config(config)
