"""Attempts at the per-iteration bytes of the scanned LoRA step (docs/guides/decoder.md).

    python docs/notes/scripts/scan_lora_mem_attempts.py VARIANT [LAYERS] [llm_lora flags...]

VARIANT ``base`` measures ``scan_lora_extra_over_adapter_bytes`` exactly as
``experiments.bench.llm_lora`` does (AOT-compiled steps, XLA ``memory_analysis``, 4 tokens);
``nocast`` first re-registers quax's ``convert_element_type`` rule for adapted kernels so that
the LoRA factors stay float32 under bf16 compute (no bf16 round-trip of the per-layer slice).
Extra flags go to the benchmark's parser (e.g. ``--remat none``). Prints the ratio, the bytes
beyond the stacked factor gradients and one layer's factor bytes.
"""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout first

import jax.numpy as jnp
import quax
from jax import lax

from experiments.bench import llm_lora
from lowrank_jax.adapters import quax_backend


def keep_factors_float32() -> None:
    @quax.register(lax.convert_element_type_p)
    def _(x: quax_backend.AdaptedArray, *, new_dtype, **params):
        if not jnp.issubdtype(new_dtype, jnp.floating):
            return lax.convert_element_type_p.bind(x.materialise(), new_dtype=new_dtype, **params)
        return dataclasses.replace(x, dtype_=jnp.dtype(new_dtype).name)


def main() -> None:
    variant = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    if variant == "nocast":
        keep_factors_float32()
    elif variant != "base":
        raise SystemExit(f"VARIANT must be 'base' or 'nocast', got {variant!r}.")
    argv = ["--layers", str(layers), "--tokens", "4", "--depth-curve", "", *sys.argv[3:]]
    args = llm_lora.parse_args(argv)
    mem = llm_lora.memory(args, layers, [4])
    row = mem["rows"][0]
    print(
        f"{variant} L={layers} {' '.join(sys.argv[3:])}: ratio {mem['ratio']:.4f}, "
        f"extra {row['extra']} B, beyond the gradients {row['extra'] - mem['adapter_bytes']} B, "
        f"one layer's factors {mem['adapter_bytes'] // layers} B"
    )


if __name__ == "__main__":
    main()
