"""Activations and activation gradients of an unmodified Equinox MLP.

Run: python examples/equinox_mlp.py   (needs `pip install lazyharvest[equinox]`)
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import lazyharvest as lh

mlp = eqx.nn.MLP(in_size=4, out_size=2, width_size=16, depth=3, key=jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (4,))
y = jnp.array([1.0, -1.0])

# Every submodule call now sows its output; the MLP's code is untouched.
sown = lh.sow_modules(mlp, tag="act")


def loss(x):
    return jnp.sum((sown(x) - y) ** 2)


# One abstract trace; nothing is computed until a leaf is read.
d = lh.reap(jax.grad(loss), tag="act")(x)
for key, aval in d.avals.items():
    if key[0] != "vjp":
        print("/".join(key), aval.shape)

# The gradient of the loss with respect to the second layer's output,
# from the same backward pass as the gradient with respect to x.
g = d["vjp", "layers", "1", "__call__"]
print("activation gradient norm, layers/1:", float(jnp.linalg.norm(g)))
