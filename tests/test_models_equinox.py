"""`lh.sow_modules` on Equinox models, checked against plain Equinox."""

import os
import subprocess
import sys

import pytest

eqx = pytest.importorskip("equinox")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import lazyharvest as lh  # noqa: E402
from helpers import close  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "act"


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(2, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, 1, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(3, 8, key=ks[0])
        self.blocks = [Block(8, k) for k in ks[1:3]]
        self.head = eqx.nn.Linear(8, 2, key=ks[3])

    def __call__(self, x):
        x = jax.vmap(self.embed)(x)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


def transformer_by_hand(m, x, eps=None):
    """The intermediates of `Transformer`, computed step by step; `eps` adds a
    perturbation to chosen intermediates (the hand-written gradient trick)."""
    out, eps = {}, eps or {}

    def put(key, value):
        out[key] = value + eps.get(key, 0.0)
        return out[key]

    x = put(("embed", "__call__"), jax.vmap(m.embed)(x))
    for i, b in enumerate(m.blocks):
        p = ("blocks", str(i))
        h = put((*p, "norm1", "__call__"), jax.vmap(b.norm1)(x))
        out[(*p, "attn", "query_proj", "__call__")] = jax.vmap(b.attn.query_proj)(h)
        x = x + put((*p, "attn", "__call__"), b.attn(h, h, h))
        h = put((*p, "norm2", "__call__"), jax.vmap(b.norm2)(x))
        h = put((*p, "mlp", "layers", "0", "__call__"), jax.vmap(b.mlp.layers[0])(h))
        h = jax.vmap(b.mlp.layers[1])(jax.nn.relu(h))
        x = put((*p, "__call__"), x + put((*p, "mlp", "__call__"), h))
    put(("head", "__call__"), jax.vmap(m.head)(x))
    return out


class Const(eqx.Module):
    value: jax.Array

    def __call__(self, *args, **kwargs):
        return self.value


class AddEps(eqx.Module):
    inner: eqx.Module
    eps: jax.Array

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs) + self.eps


def at(path):
    """`eqx.tree_at` selector for an attribute path like ("blocks", "0", "attn")."""
    def where(m):
        for part in path:
            m = m[int(part)] if part.isdigit() else getattr(m, part)
        return m
    return where


@pytest.fixture(scope="module")
def tf():
    return Transformer(jax.random.key(0))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (5, 3))


def test_mlp_intermediates_equal_hand_computed():
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    x = jnp.array([0.5, -1.0, 2.0])
    sown = lh.sow_modules(mlp, tag=T)
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    h0 = mlp.layers[0](x)
    h1 = mlp.layers[1](jax.nn.relu(h0))
    h2 = mlp.layers[2](jax.nn.relu(h1))
    assert set(d.keys()) == {("layers", str(i), "__call__") for i in range(3)}
    close(d["layers", "0", "__call__"], h0)
    close(d["layers"]["1"]["__call__"], h1)
    close(d.compute()["layers"]["2"]["__call__"], h2)
    close(sown(x), mlp(x))


def test_transformer_intermediates_equal_hand_computed(tf, x):
    sown = lh.sow_modules(tf, tag=T)
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    for key, value in transformer_by_hand(tf, x).items():
        close(d[key], value)
    assert ("blocks", "1", "attn", "output_proj", "__call__") in d
    close(sown(x), tf(x))


def test_parameters_same_and_model_untouched(tf, x):
    before = jax.tree_util.tree_leaves(eqx.filter(tf, eqx.is_array))
    structure = jax.tree_util.tree_structure(tf)
    sown = lh.sow_modules(tf, tag=T)
    after = jax.tree_util.tree_leaves(eqx.filter(sown, eqx.is_array))
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a is b
    assert jax.tree_util.tree_structure(tf) == structure
    assert type(sown) is Transformer and type(tf.blocks[0].attn) is eqx.nn.MultiheadAttention
    # filter_grad sees the same parameters, in the same order.
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    g_sown = jax.tree_util.tree_leaves(eqx.filter_grad(loss)(sown, x))
    g_plain = jax.tree_util.tree_leaves(eqx.filter_grad(loss)(tf, x))
    close(g_sown, g_plain)
    # The documented way back to the plain structure.
    back = jax.tree_util.tree_unflatten(structure, jax.tree_util.tree_leaves(sown))
    close(back(x), tf(x))


def test_filter_by_type_and_by_path(tf, x):
    by_type = lh.sow_modules(tf, tag=T, filter=lambda p, m: isinstance(m, eqx.nn.LayerNorm))
    d = lh.reap(lambda x: by_type(x), tag=T)(x)
    assert set(d.keys()) == {("blocks", i, n, "__call__")
                             for i in "01" for n in ("norm1", "norm2")}
    by_path = lh.sow_modules(tf, tag=T, filter=lambda p, m: p[:2] == ("blocks", "1")
                             and p[-1] in ("attn", "mlp"))
    d = lh.reap(lambda x: by_path(x), tag=T)(x)
    assert set(d.keys()) == {("blocks", "1", "attn", "__call__"),
                             ("blocks", "1", "mlp", "__call__")}
    close(d["blocks", "1", "mlp", "__call__"],
          transformer_by_hand(tf, x)["blocks", "1", "mlp", "__call__"])


def test_plant_replaces_a_submodule_output(tf, x):
    sown = lh.sow_modules(tf, tag=T)
    v = jnp.full((5, 8), 0.25)
    path = ("blocks", "0", "attn")
    out = lh.plant(lambda x: sown(x), tag=T)({(*path, "__call__"): v}, x)
    patched = eqx.tree_at(at(path), tf, Const(v))
    close(out, patched(x))
    # Called under `jax.vmap` over the sequence: the site is batched on axis 0.
    w = jnp.linspace(-1, 1, 16)
    nested = {"blocks": {"1": {"mlp": {"layers": {"0": {"__call__": jnp.tile(w, (5, 1))}}}}}}
    out = lh.plant(lambda x: sown(x), tag=T)(nested, x)
    close(out, eqx.tree_at(at(("blocks", "1", "mlp", "layers", "0")), tf, Const(w))(x))


KEYS = [("embed", "__call__"), ("blocks", "0", "norm1", "__call__"),
        ("blocks", "0", "attn", "__call__"), ("blocks", "1", "mlp", "layers", "0", "__call__"),
        ("blocks", "1", "mlp", "__call__"), ("blocks", "0", "__call__"), ("head", "__call__")]


def loss_by_hand(m, x, eps=None):
    return jnp.sum(jnp.tanh(transformer_by_hand(m, x, eps)["head", "__call__"]))


def perturbation_grads(m, x):
    """d loss / d intermediate: the gradient w.r.t. zeros added by hand."""
    shapes = transformer_by_hand(m, x)
    zeros = {k: jnp.zeros_like(shapes[k]) for k in KEYS}
    return jax.grad(lambda eps: loss_by_hand(m, x, eps))(zeros)


def test_grad_cotangents_equal_perturbation_trick(tf, x):
    sown = lh.sow_modules(tf, tag=T)
    d = lh.reap(jax.grad(lambda x: jnp.sum(jnp.tanh(sown(x)))), tag=T)(x)
    expected = perturbation_grads(tf, x)
    for key in KEYS:
        close(d[("vjp", *key)], expected[key])
    # The perturbation through a submodule swapped in by `eqx.tree_at` agrees.
    path = ("blocks", "0", "attn")
    by_swap = jax.grad(lambda e: jnp.sum(jnp.tanh(
        eqx.tree_at(at(path), tf, AddEps(at(path)(tf), e))(x))))(jnp.zeros((5, 8)))
    close(d[("vjp", *path, "__call__")], by_swap)


def test_lh_vmap_batches_values_and_cotangents(tf, x):
    sown = lh.sow_modules(tf, tag=T)
    xs = jnp.stack([x, 2 * x, x - 1])
    d = lh.reap(lh.vmap(lambda x: sown(x)), tag=T)(xs)
    hand = jax.vmap(lambda x: transformer_by_hand(tf, x))(xs)
    for key in [("embed", "__call__"), ("blocks", "1", "attn", "__call__")]:
        assert d[key].shape == (3,) + hand[key].shape[1:]
        close(d[key], hand[key])
    loss = lambda x: jnp.sum(jnp.tanh(sown(x)))
    g = lh.reap(lh.vmap(jax.grad(loss)), tag=T)(xs)
    expected = jax.vmap(lambda x: perturbation_grads(tf, x))(xs)
    for key in [("embed", "__call__"), ("blocks", "0", "attn", "__call__")]:
        close(g[("vjp", *key)], expected[key])


def test_jit_and_filter_jit_inside_the_reap(tf, x):
    sown = lh.sow_modules(tf, tag=T)
    hand = transformer_by_hand(tf, x)
    key = ("blocks", "0", "mlp", "__call__")
    d = lh.reap(lambda x: eqx.filter_jit(lambda m, x: m(x))(sown, x), tag=T)(x)
    close(d[key], hand[key])
    params, static = eqx.partition(sown, eqx.is_array)
    d = lh.reap(lambda p, x: eqx.combine(p, static)(x), tag=T)(params, x)
    close(d[key], hand[key])


class Repeat(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        for _ in range(3):
            x = jnp.sin(self.lin(x))
        return x


def test_repeated_submodule_strict_error_and_append():
    m = Repeat(eqx.nn.Linear(3, 3, key=jax.random.key(2)))
    x = jnp.array([1.0, 0.5, -0.5])
    with pytest.raises(lh.HarvestError, match="append"):
        lh.reap(lambda x: lh.sow_modules(m, tag=T)(x), tag=T)(x)
    sown = lh.sow_modules(m, tag=T, mode="append")
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    calls, h = [], x
    for _ in range(3):
        calls.append(m.lin(h))
        h = jnp.sin(calls[-1])
    close(d["lin", "__call__"], jnp.stack(calls))
    clobber = lh.sow_modules(m, tag=T, mode="clobber")
    close(lh.reap(lambda x: clobber(x), tag=T)(x)["lin", "__call__"], calls[-1])


class Scanned(eqx.Module):
    layers: eqx.nn.Linear  # stacked along a leading axis

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None
        return jax.lax.scan(body, x, params)[0]


def test_scan_over_layers_with_append():
    keys = jax.random.split(jax.random.key(3), 4)
    m = Scanned(eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(keys))
    x = jnp.array([1.0, -1.0, 0.5])
    sown = lh.sow_modules(m, tag=T, mode="append")
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    h, calls = x, []
    for i in range(4):
        calls.append(m.layers.weight[i] @ h + m.layers.bias[i])
        h = jnp.tanh(calls[-1])
    close(d["layers", "__call__"], jnp.stack(calls))
    close(sown(x), m(x))


def test_stateful_layers_in_sequential():
    net, state = eqx.nn.make_with_state(eqx.nn.Sequential)([
        eqx.nn.Linear(3, 4, key=jax.random.key(4)),
        eqx.nn.BatchNorm(4, axis_name="batch", mode="batch", inference=True),
        eqx.nn.Lambda(jnp.tanh)])
    x = jnp.array([1.0, 2.0, -1.0])
    sown = lh.sow_modules(net, tag=T)
    out, new_state = sown(x, state)
    ref_out, ref_state = net(x, state)
    close(out, ref_out)
    close(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(ref_state))
    d = lh.reap(lambda x: sown(x, state)[0], tag=T)(x)
    bn_out, _ = net.layers[1](net.layers[0](x), state)
    close(d["layers", "1", "__call__"], bn_out)  # the layer's output, not the state
    close(d["layers", "2", "__call__"], ref_out)


class Mixed(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.lin(x), "label", 3


class UsesMixed(eqx.Module):
    inner: Mixed

    def __call__(self, x):
        y, label, n = self.inner(x)
        assert label == "label" and n == 3
        return y * n


def test_outputs_with_non_array_leaves_sow_their_arrays():
    m = UsesMixed(Mixed(eqx.nn.Linear(2, 2, key=jax.random.key(5))))
    x = jnp.array([1.0, 2.0])
    sown = lh.sow_modules(m, tag=T)
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    y, label, n = d["inner", "__call__"]
    assert label is None and n is None
    close(y, m.inner.lin(x))
    close(lh.plant(lambda x: sown(x), tag=T)(
        {("inner", "__call__"): (jnp.ones(2), None, None)}, x), 3 * jnp.ones(2))


def test_two_tags_on_one_model():
    mlp = eqx.nn.MLP(2, 2, 3, 1, key=jax.random.key(6))
    x = jnp.array([0.3, -0.7])
    both = lh.sow_modules(lh.sow_modules(mlp, tag="a"), tag="b",
                          filter=lambda p, m: p == ("layers", "1"))
    da = lh.reap(lambda x: both(x), tag="a")(x)
    db = lh.reap(lambda x: both(x), tag="b")(x)
    assert set(da.keys()) == {("layers", "0", "__call__"), ("layers", "1", "__call__")}
    assert list(db.keys()) == [("layers", "1", "__call__")]
    close(db["layers", "1", "__call__"], mlp(x))
    assert len(jax.tree_util.tree_leaves(eqx.filter(both, eqx.is_array))) == 4


def test_bad_arguments():
    mlp = eqx.nn.MLP(2, 2, 3, 1, key=jax.random.key(6))
    with pytest.raises(lh.HarvestError, match="unknown mode"):
        lh.sow_modules(mlp, tag=T, mode="stack")
    with pytest.raises(TypeError, match="filter must be callable"):
        lh.sow_modules(mlp, tag=T, filter="layers")
    with pytest.raises(TypeError, match="equinox.Module"):
        lh.sow_modules(lambda x: x, tag=T)


def _run(args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_importing_lazyharvest_imports_no_model_library():
    r = _run(["-c", "import sys, lazyharvest; print(sorted(m for m in sys.modules "
                    "if m.split('.')[0] in ('equinox', 'flax')))"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_example_runs():
    r = _run([os.path.join("examples", "equinox_mlp.py")])
    assert r.returncode == 0, r.stderr
    assert "__call__" in r.stdout and "norm" in r.stdout
