"""`python -m lazyharvest`: reap values, tangents and cotangents of a small MLP."""

import jax
import jax.numpy as jnp
import numpy as np

import lazyharvest as lh


def mlp(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = lh.sow(jnp.tanh(h @ w + b), tag="act", name=f"layer{i}")
    return jnp.sum(h ** 2)


def main() -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [(jax.random.normal(k, (4, 4)) * 0.5, jnp.zeros(4)) for k in keys]
    x = jnp.linspace(-1., 1., 4)
    show = lambda v: np.array2string(np.asarray(v), precision=3)

    print("1. Values: lazy, computed when read")
    d = lh.reap(mlp, tag="act")(params, x)
    print("   keys:", list(d.keys()))
    print("   before reading:", d)
    print("   layer1 =", show(d["layer1"]))
    print("   after reading: ", d)

    print("\n2. Tangents, from jax.jvp inside the reaped function")
    t = jnp.ones(4)
    d = lh.reap(lambda x: jax.jvp(lambda x: mlp(params, x), (x,), (t,)), tag="act")(x)
    print("   ('jvp', 'layer1') =", show(d["jvp", "layer1"]))

    print("\n3. Cotangents, from jax.grad: d loss / d layer output, no extra pass")
    d = lh.reap(jax.grad(mlp, argnums=1), tag="act")(params, x)
    print("   ('vjp', 'layer1') =", show(d["vjp", "layer1"]))

    print("\n4. Recorded transforms: the gradient of a layer's own sub-computation")
    d = lh.reap(lh.grad(mlp, argnums=1), tag="act")(params, x)
    print("   ('grad', 'layer0') shape", d["grad", "layer0"].shape, "(d layer0 / d x)")

    print("\n5. Plant: replace a value and run the rest of the program")
    out = lh.plant(mlp, tag="act")({"layer2": jnp.zeros(4)}, params, x)
    print("   mlp with layer2 := 0 ->", float(out))

    print("\n6. A summary of every leaf: values and cotangents, computed in one program")
    d = lh.reap(jax.grad(mlp, argnums=1), tag="act")(params, x)
    print(d.summary(compute=True))


if __name__ == "__main__":
    main()
