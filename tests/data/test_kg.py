"""Knowledge graphs read from PyKEEN's files: published counts and a consistent id mapping."""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lowrank_jax.data import KGData, load_kg

PYKEEN = pathlib.Path(importlib.util.find_spec("pykeen").submodule_search_locations[0])

# Published statistics (PyKEEN dataset docs; Kok & Domingos 2007 splits).
PUBLISHED = {
    "nations": (1592, 199, 201, 14, 55),
    "umls": (5216, 652, 661, 135, 46),
    "kinships": (8544, 1068, 1074, 104, 25),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_dtypes_and_id_mapping(name):
    kg = load_kg(name)
    assert isinstance(kg, KGData)
    n_train, n_valid, n_test, n_ent, n_rel = PUBLISHED[name]
    assert (len(kg.train), len(kg.valid), len(kg.test)) == (n_train, n_valid, n_test)
    assert (kg.num_entities, kg.num_relations) == (n_ent, n_rel)
    assert list(kg.entity_names) == sorted(kg.entity_names)
    assert list(kg.relation_names) == sorted(kg.relation_names)
    for part in ("train", "valid", "test"):
        triples = getattr(kg, part)
        assert triples.dtype == np.int32 and triples.shape[1] == 3
        assert triples[:, [0, 2]].min() >= 0 and triples[:, [0, 2]].max() < n_ent
        assert triples[:, 1].min() >= 0 and triples[:, 1].max() < n_rel
        # Mapping the ids back gives the file's lines, in order.
        lines = (PYKEEN / "datasets" / name / f"{part}.txt").read_text().split("\n")
        decoded = [
            f"{kg.entity_names[h]}\t{kg.relation_names[r]}\t{kg.entity_names[t]}"
            for h, r, t in triples
        ]
        assert decoded == [line for line in lines if line.strip()]
    # Every entity and relation occurs in training.
    assert np.unique(kg.train[:, [0, 2]]).size == n_ent
    assert np.unique(kg.train[:, 1]).size == n_rel


def test_unknown_name():
    with pytest.raises(ValueError, match="nations"):
        load_kg("fb15k")


def test_no_pykeen_torch_or_tensorflow_import():
    code = (
        "import sys, tensorflow_datasets as tfds\n"
        "from lowrank_jax.data import load_kg, load_tfds\n"
        "load_kg('umls')\n"
        "with tfds.testing.mock_data(num_examples=2):\n"
        "    load_tfds('mnist', split='train')\n"
        "bad = [m for m in ('pykeen', 'torch', 'tensorflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
