"""Reading safetensors files with errors that name the file and say what to do.

safetensors reports a truncated or corrupt file as ``SafetensorError: Error while deserializing
header: incomplete metadata, file not fully covered``, naming no file. Every loader of the library
that reads safetensors (`models.load_hf_decoder`, `models.load_hf_vit`, `models.load_minilm`,
`adapters.load_peft`) opens its files here instead, so the error names the file and asks for a
fresh copy; `tensor_files` says which file of a (sharded) checkpoint holds each tensor.

Example::

    with open_safetensors("llama/model.safetensors") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

__all__ = ["load_safetensors", "open_safetensors", "tensor_files"]


def _unreadable(file: str, error: Exception) -> Exception:
    if isinstance(error, FileNotFoundError):
        return FileNotFoundError(f"{file} does not exist; check the path or download it again.")
    if isinstance(error, OSError):
        return type(error)(
            f"{file} cannot be read ({error.strerror or error}); check its permissions."
        )
    return ValueError(
        f"{file} is not a readable safetensors file ({error}): it is truncated or corrupt (an "
        "interrupted download or copy?); download or save it again and check its size."
    )


def open_safetensors(file: str | os.PathLike) -> Any:
    """Opens a safetensors file for reading (numpy arrays), as ``safetensors.safe_open`` does.

    Args:
      file: path of a ``.safetensors`` file.

    Returns:
      The ``safe_open`` handle (a context manager; ``keys()``, ``get_slice``, ``get_tensor``).

    Raises:
      FileNotFoundError: the file does not exist.
      OSError: the file cannot be read (the message names it).
      ValueError: the file is truncated or not safetensors (the message names it and says to
        download or save it again).
    """
    file = os.fspath(file)
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from e


def load_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as numpy arrays (``safetensors.numpy.load_file``).

    Args:
      file: path of a ``.safetensors`` file.

    Returns:
      ``{name: array}``.

    Raises:
      FileNotFoundError, OSError, ValueError: as :func:`open_safetensors`.
    """
    file = os.fspath(file)
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from e


def tensor_files(directory: str | os.PathLike) -> dict[str, str]:
    """Which safetensors file of a ``save_pretrained`` directory holds each tensor.

    Reads ``model.safetensors.index.json`` (a sharded checkpoint) when there is one, else the
    names in ``model.safetensors``.

    Args:
      directory: a Hugging Face ``save_pretrained`` directory.

    Returns:
      ``{tensor name: path of its file}``.

    Raises:
      FileNotFoundError: the directory has neither file (``pytorch_model.bin`` is not read).
      ValueError: the index is not valid JSON or has no ``weight_map``; the single file is
        truncated or corrupt (as :func:`open_safetensors`).
    """
    directory = os.fspath(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{index} is not valid JSON ({e.msg} at line {e.lineno}): it is truncated or "
                "corrupt; download or save the checkpoint again."
            ) from e
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object.")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors nor model.safetensors.index.json "
            "(pytorch_model.bin is not read: convert it with save_pretrained(safe_serialization"
            "=True))."
        )
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)
