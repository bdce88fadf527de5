"""The per-layer factor copy of a scanned LoRA backward, without flax or quax (docs/guides/decoder.md).

    python docs/notes/scripts/scan_slice_copy.py [LAYERS ...]

A plain ``lax.scan`` over ``L`` layers of three projections each (``x @ W + ((x @ A) @ B) / 2``,
``W: (L, 3, 1024, 4096)`` frozen, rank 8, 4 tokens, each layer under ``jax.checkpoint``) is
differentiated with respect to the stacked factors only, and its compiled temp bytes (XLA
``memory_analysis``) are compared with the same scan without the LoRA term, differentiated with
respect to the input. Two ways of giving the body its layer's factors:

* ``xs``: the stacks are scanned over (what ``nn.scan`` does). Extra temp / adapter bytes comes
  out as ``1/L`` (0.275 at L = 4, 0.138 at L = 8 on XLA:CPU, jax 0.10.2): one layer's factor
  slices, copied at each step. The factor gradients are this function's output, so unlike in
  ``experiments.bench.llm_lora`` they are not in temp.
* ``closure``: the body closes over the stacks and slices them by the layer index. Each step's
  gradient is then a full-stack array, and extra temp is about 100× the adapter's bytes.

Shapes only: nothing is allocated or run.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax

TOKENS, N, M, RANK, PROJECTIONS = 4, 1024, 4096, 8, 3


def _layer(x, w, a, b):
    for p in range(PROJECTIONS):
        h = x @ w[p] + ((x @ a[p]) @ b[p]) * 0.5
        x = jnp.tanh(h[:, :N])
    return x


def loss_xs(factors, w, x):
    def body(x, layer):
        return jax.checkpoint(_layer)(x, *layer), None

    x, _ = lax.scan(body, x, (w, *factors))
    return jnp.sum(x**2)


def loss_closure(factors, w, x):
    a, b = factors

    def body(x, i):
        take = lambda stack: lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)
        return jax.checkpoint(_layer)(x, take(w), take(a), take(b)), None

    x, _ = lax.scan(body, x, jnp.arange(w.shape[0]))
    return jnp.sum(x**2)


def loss_frozen(w, x):
    def body(x, w_layer):
        def layer(x, w_layer):
            for p in range(PROJECTIONS):
                x = jnp.tanh((x @ w_layer[p])[:, :N])
            return x

        return jax.checkpoint(layer)(x, w_layer), None

    x, _ = lax.scan(body, x, w)
    return jnp.sum(x**2)


def extra_over_adapter(layers: int) -> dict[str, float]:
    """``{variant: (temp bytes − the frozen scan's) / adapter bytes}`` at ``layers`` layers."""
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    w, x = shape(layers, PROJECTIONS, N, M), shape(TOKENS, N)
    factors = (shape(layers, PROJECTIONS, N, RANK), shape(layers, PROJECTIONS, RANK, M))
    adapter = sum(f.size * 4 for f in factors)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    frozen = temp(jax.jit(jax.grad(loss_frozen, argnums=1)).lower(w, x).compile())
    out = {}
    for name, loss in (("xs", loss_xs), ("closure", loss_closure)):
        out[name] = (
            temp(jax.jit(jax.grad(loss)).lower(factors, w, x).compile()) - frozen
        ) / adapter
    return out


def main() -> None:
    for layers in [int(v) for v in sys.argv[1:]] or [4, 8]:
        ratios = extra_over_adapter(layers)
        print(f"L={layers}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
