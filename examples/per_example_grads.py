"""Per-example gradients and per-example activation gradients of a small MLP.

Run: python examples/per_example_grads.py [--out DIR]

The loss of one example sows its value. Under the recorded transforms
`lh.vmap(lh.grad(loss), in_axes=(None, 0))`, the key `("grad", "loss")` is the
gradient of each example's loss (what DP-SGD clips), and `"loss"` each
example's loss. Under `lh.vmap(jax.grad(loss))` the sites get JAX's
`("vjp", name)` cotangents, one per example. With --out DIR the numbers are
written to DIR/per_example.csv.
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import lazyharvest as lh

SIZES, BATCH, CLIP = (4, 8, 8, 3), 6, 1.0


def init(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [(jax.random.normal(k, (a, b)) / a ** 0.5, jnp.zeros(b))
            for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])]


def loss(params, example):                    # one example: x (4,), label y
    x, y = example
    h = x
    for i, (w, b) in enumerate(params[:-1]):
        h = lh.sow(jnp.tanh(h @ w + b), tag="act", name=f"h{i}")
    w, b = params[-1]
    return lh.sow(-jax.nn.log_softmax(h @ w + b)[y], tag="act", name="loss")


def show(v) -> str:
    return np.array2string(np.asarray(v), precision=3)


def global_norms(tree):
    """The L2 norm of each example's slice of a pytree with a leading batch axis."""
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(tree))
    return jnp.sqrt(sq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, help="write per_example.csv here")
    args = ap.parse_args()

    params = init(jax.random.key(0))
    batch = (jax.random.normal(jax.random.key(1), (BATCH, SIZES[0])), jnp.arange(BATCH) % 3)

    d = lh.reap(lh.vmap(lh.grad(loss), in_axes=(None, 0)), tag="act")(params, batch)
    leaves = d.compute("loss", ("grad", "loss"))                # one program
    losses, grads = leaves["loss"], leaves["grad"]["loss"]
    want = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, batch)
    same = all(np.allclose(a, b, atol=1e-6)
               for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
    norms = global_norms(grads)
    print("per-example losses:        ", show(losses))
    print("per-example gradient norms:", show(norms))
    print("equal to jax.vmap(jax.grad(loss)):", same)

    # DP-SGD's update direction: clip each example's gradient, then average.
    scale = jnp.minimum(1., CLIP / norms)
    update = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1) / BATCH, grads)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(update)))
    print(f"clipped mean gradient norm (clip {CLIP}): {norm:.4f}")

    # d loss_i / d h1_i for each example, from JAX's own backward pass.
    acts = lh.reap(lh.vmap(jax.grad(loss), in_axes=(None, 0)), tag="act")(params, batch)
    act_norms = jnp.linalg.norm(acts["vjp", "h1"], axis=-1)
    print("per-example |d loss / d h1|:", show(act_norms))

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = np.stack([np.arange(BATCH), losses, norms, act_norms], axis=1)
        np.savetxt(args.out / "per_example.csv", rows, delimiter=",", fmt="%.6g",
                   header="example,loss,grad_norm,act_grad_norm_h1", comments="")
        print("wrote", args.out / "per_example.csv")


if __name__ == "__main__":
    main()
