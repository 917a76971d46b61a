"""Attention maps of a 2-layer transformer, their gradients, and plots.

Run: python examples/attention_gradients.py [--out DIR]   (plots need matplotlib)

Each layer sows its attention map into one `append` site, so the Python loop
over layers stacks them: `d["attn"]` is (layers, batch, heads, T, T). Reaping
`jax.grad(loss)` gives, from the same backward pass, `d["vjp", "attn"]`:
d loss / d attention weight, a common attribution signal. The plots
(`attention.png`, `attention_grads.png`, `site_norms.png`) go to DIR, or to a temporary directory
that is removed afterwards.
"""

import argparse
import importlib.util
import pathlib
import tempfile

import jax
import jax.numpy as jnp

import lazyharvest as lh

LAYERS, HEADS, D, T, BATCH = 2, 2, 8, 5, 2


def init(key):
    keys = jax.random.split(key, LAYERS)
    layer = lambda k: {"qkv": jax.random.normal(k, (D, 3 * D)) / D ** 0.5,
                       "out": jax.random.normal(jax.random.fold_in(k, 1), (D, D)) / D ** 0.5}
    return [layer(k) for k in keys]


def attention(p, h):
    q, k, v = (a.reshape(T, HEADS, D // HEADS) for a in jnp.split(h @ p["qkv"], 3, -1))
    scores = jnp.einsum("thd,shd->hts", q, k) / (D // HEADS) ** 0.5
    causal = jnp.tril(jnp.ones((T, T), bool))
    attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    attn = lh.sow(attn, tag="attn", name="attn", mode="append")       # (heads, T, T)
    return jnp.einsum("hts,shd->thd", attn, v).reshape(T, D) @ p["out"]


def model(params, x):                                   # x: (T, D)
    h = x
    for i, p in enumerate(params):
        h = lh.sow(h + attention(p, h), tag="attn", name=f"resid{i}")
    return h


def loss(params, xs):                                   # xs: (BATCH, T, D)
    out = jax.vmap(model, in_axes=(None, 0))(params, xs)
    return jnp.mean((out[:, -1] - xs[:, 0]) ** 2)       # copy token 0 to the end


def plot(d, out_dir: pathlib.Path) -> None:
    from lazyharvest import plot as lh_plot

    lh_plot.attention_grid(d["attn"], path=out_dir / "attention.png",
                           title="attention, example 0")
    lh_plot.attention_grid(d["vjp", "attn"], path=out_dir / "attention_grads.png",
                           title="d loss / d attention, example 0")
    resid = [f"resid{i}" for i in range(LAYERS)]
    lh_plot.site_norms(d, keys=resid + [("vjp", r) for r in resid],
                       path=out_dir / "site_norms.png")
    for name in ("attention.png", "attention_grads.png", "site_norms.png"):
        print(f"wrote {name}: {(out_dir / name).stat().st_size} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, help="directory for the PNG files")
    args = ap.parse_args()

    params = init(jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (BATCH, T, D))
    d = lh.reap(jax.grad(loss), tag="attn")(params, xs)
    leaves = d.compute("attn", ("vjp", "attn"))          # one program
    attn, ct = leaves["attn"], leaves["vjp"]["attn"]
    print("attention maps:", attn.shape, "(layers, batch, heads, T, T)")
    print("rows sum to 1:", bool(jnp.allclose(attn.sum(-1), 1., atol=1e-5)))
    norms = jnp.sqrt(jnp.sum(ct ** 2, axis=(1, 3, 4)))  # (layers, heads)
    for layer in range(LAYERS):
        print(f"layer {layer}: |d loss / d attention| by head", jnp.round(norms[layer], 4))

    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots")
    elif args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(d, args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            plot(d, pathlib.Path(tmp))


if __name__ == "__main__":
    main()
