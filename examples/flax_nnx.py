"""Activations and activation gradients of an unmodified Flax NNX model.

Run: python examples/flax_nnx.py   (needs `pip install lazyharvest[flax]`)
"""

import jax
import jax.numpy as jnp
from flax import nnx

import lazyharvest as lh


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.norm = nnx.LayerNorm(dout, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.norm(self.linear(x)))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(4, 16, rngs), Block(16, 16, rngs)])
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = Net(nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (8, 4))

# A clone whose submodule calls sow; `model` itself is left as it is.
sown = lh.sow_modules(model, tag="act")


def loss(x):
    return jnp.mean(sown(x) ** 2)


d = lh.reap(jax.grad(loss), tag="act")(x)
for key, aval in d.avals.items():
    if key[0] != "vjp":
        print("/".join(key), aval.shape)

g = d["vjp", "blocks", "1", "norm", "__call__"]
print("activation gradient norm, blocks/1/norm:", float(jnp.linalg.norm(g)))
