"""Knowledge-graph triples (Nations, UMLS, Kinships) read from the files PyKEEN ships."""

from __future__ import annotations

import dataclasses

import numpy as np

from lowrank_jax.data._packages import package_file

__all__ = ["KG_DATASETS", "KGData", "load_kg"]

KG_DATASETS = ("nations", "umls", "kinships")
_KG_SPLITS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True, eq=False)
class KGData:
    """A knowledge graph split into train/valid/test triples of integer ids.

    Attributes:
      train: ``(N_train, 3)`` ``int32`` triples ``(head, relation, tail)``.
      valid: ``(N_valid, 3)`` ``int32`` triples.
      test: ``(N_test, 3)`` ``int32`` triples.
      entity_names: ``entity_names[e]`` is the name of entity id ``e``.
      relation_names: ``relation_names[r]`` is the name of relation id ``r``.
    """

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    entity_names: tuple[str, ...]
    relation_names: tuple[str, ...]

    @property
    def num_entities(self) -> int:
        """Number of entities ``|E|``."""
        return len(self.entity_names)

    @property
    def num_relations(self) -> int:
        """Number of relations ``|R|`` (without inverse relations)."""
        return len(self.relation_names)

    def __repr__(self) -> str:
        return (
            f"KGData(train={len(self.train)}, valid={len(self.valid)}, test={len(self.test)}, "
            f"entities={self.num_entities}, relations={self.num_relations})"
        )


def _read_triples(path) -> list[tuple[str, str, str]]:
    triples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 3:
                raise ValueError(
                    f"{path}:{lineno}: expected 3 tab-separated fields (head, relation, tail); "
                    f"got {len(parts)}."
                )
            triples.append((parts[0], parts[1], parts[2]))
    return triples


def load_kg(name: str) -> KGData:
    """Loads the Nations, UMLS or Kinships knowledge graph from PyKEEN's data files.

    The tab-separated ``pykeen/datasets/<name>/{train,valid,test}.txt`` files of
    ``pykeen==1.11.1`` are read directly; PyKEEN (and torch) is never imported. Entity and relation
    ids are positions in the sorted names over all three files, the same mapping for every split;
    every entity and relation of these datasets occurs in training, so this is the training
    vocabulary, and sorting matches the label-to-id mapping of PyKEEN's ``TriplesFactory``.

    =========  ========  ===========  =====  =====  =====
    name       entities  relations    train  valid  test
    =========  ========  ===========  =====  =====  =====
    nations    14        55           1592   199    201
    umls       135       46           5216   652    661
    kinships   104       25           8544   1068   1074
    =========  ========  ===========  =====  =====  =====

    Args:
      name: ``"nations"``, ``"umls"`` or ``"kinships"``.

    Returns:
      ``KGData`` with ``int32`` ``(N, 3)`` triples ``(head, relation, tail)``.

    Raises:
      ModuleNotFoundError: if pykeen's files are not installed; the message gives
        ``pip install --no-deps pykeen==1.11.1``.
      ValueError: for an unknown dataset name.

    References:
      Kok & Domingos (2007), Statistical predicate invention, ICML (Nations, UMLS, Kinships as
      relational benchmarks); the train/valid/test splits are those distributed with PyKEEN
      (Ali et al. (2021), PyKEEN 1.0, JMLR).

    Example:
      >>> kg = load_kg("nations"); kg.train.shape, kg.num_entities, kg.num_relations
      ((1592, 3), 14, 55)
    """
    if name not in KG_DATASETS:
        raise ValueError(f"Unknown knowledge graph {name!r}; choose one of {KG_DATASETS}.")
    raw = {
        part: _read_triples(package_file("pykeen", "datasets", name, f"{part}.txt"))
        for part in _KG_SPLITS
    }
    entities = sorted({e for rows in raw.values() for h, _, t in rows for e in (h, t)})
    relations = sorted({r for rows in raw.values() for _, r, _ in rows})
    entity_id = {e: i for i, e in enumerate(entities)}
    relation_id = {r: i for i, r in enumerate(relations)}

    def to_ids(rows):
        ids = [(entity_id[h], relation_id[r], entity_id[t]) for h, r, t in rows]
        return np.asarray(ids, np.int32).reshape(-1, 3)

    return KGData(
        train=to_ids(raw["train"]),
        valid=to_ids(raw["valid"]),
        test=to_ids(raw["test"]),
        entity_names=tuple(entities),
        relation_names=tuple(relations),
    )
