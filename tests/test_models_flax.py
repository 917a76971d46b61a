"""`lh.sow_modules` on Flax NNX models and linen `apply`, checked against plain Flax."""

import os
import subprocess
import sys

import pytest

flax = pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import lazyharvest as lh  # noqa: E402
from helpers import close  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "act"


# --- NNX ---------------------------------------------------------------------

class Block(nnx.Module):
    def __init__(self, din, dout, rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.norm = nnx.LayerNorm(dout, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.norm(self.linear(x)))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(3, 8, rngs), Block(8, 8, rngs)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net_by_hand(m, x, eps=None):
    """`Net`'s intermediates step by step; `eps` perturbs chosen ones."""
    out, eps = {}, eps or {}

    def put(key, value):
        out[key] = value + eps.get(key, 0.0)
        return out[key]

    for i, b in enumerate(m.blocks):
        p = ("blocks", str(i))
        h = put((*p, "linear", "__call__"), x @ b.linear.kernel[...] + b.linear.bias[...])
        h = put((*p, "norm", "__call__"), b.norm(h))
        x = put((*p, "__call__"), jax.nn.gelu(h))
    put(("head", "__call__"), m.head(x))
    return out


KEYS = [("blocks", "0", "linear", "__call__"), ("blocks", "0", "norm", "__call__"),
        ("blocks", "1", "__call__"), ("head", "__call__")]


def loss_by_hand(m, x, eps=None):
    return jnp.sum(jnp.sin(net_by_hand(m, x, eps)["head", "__call__"]))


def perturbation_grads(m, x):
    shapes = net_by_hand(m, x)
    zeros = {k: jnp.zeros_like(shapes[k]) for k in KEYS}
    return jax.grad(lambda eps: loss_by_hand(m, x, eps))(zeros)


class Const(nnx.Module):
    def __init__(self, value):
        self.value = nnx.data(value)

    def __call__(self, *args):
        return self.value


@pytest.fixture(scope="module")
def net():
    return Net(nnx.Rngs(0))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (4, 3))


def test_nnx_intermediates_equal_hand_computed(net, x):
    sown = lh.sow_modules(net, tag=T)
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    hand = net_by_hand(net, x)
    assert set(d.keys()) == set(hand)
    for key, value in hand.items():
        close(d[key], value)
    close(sown(x), net(x))
    assert isinstance(sown.blocks[0].linear, nnx.Linear)


def test_nnx_state_same_and_model_untouched(net, x):
    graphdef = nnx.graphdef(net)
    sown = lh.sow_modules(net, tag=T)
    s_plain, s_sown = nnx.state(net), nnx.state(sown)
    assert jax.tree_util.tree_structure(s_plain) == jax.tree_util.tree_structure(s_sown)
    close(jax.tree_util.tree_leaves(s_sown), jax.tree_util.tree_leaves(s_plain))
    assert nnx.graphdef(net) == graphdef
    assert type(net.blocks[0].linear) is nnx.Linear
    assert len(lh.reap(lambda x: net(x), tag=T)(x)) == 0
    # The sown clone's parameters update the original as they are.
    nnx.update(net, s_sown)


def test_nnx_filter_by_type_and_by_path(net, x):
    by_type = lh.sow_modules(net, tag=T, filter=lambda p, m: isinstance(m, nnx.LayerNorm))
    d = lh.reap(lambda x: by_type(x), tag=T)(x)
    assert set(d.keys()) == {("blocks", "0", "norm", "__call__"),
                             ("blocks", "1", "norm", "__call__")}
    by_path = lh.sow_modules(net, tag=T, filter=lambda p, m: p[0] == "head" or p == ("blocks", "1"))
    d = lh.reap(lambda x: by_path(x), tag=T)(x)
    assert set(d.keys()) == {("head", "__call__"), ("blocks", "1", "__call__")}
    close(d["blocks", "1", "__call__"], net_by_hand(net, x)["blocks", "1", "__call__"])


def test_nnx_plant_replaces_a_submodule_output(net, x):
    sown = lh.sow_modules(net, tag=T)
    v = jnp.linspace(-2, 2, 32).reshape(4, 8)
    out = lh.plant(lambda x: sown(x), tag=T)({"blocks": {"0": {"norm": {"__call__": v}}}}, x)
    patched = nnx.clone(net)
    patched.blocks[0].norm = Const(v)
    close(out, patched(x))


def test_nnx_grad_cotangents_equal_perturbation_trick(net, x):
    sown = lh.sow_modules(net, tag=T)
    d = lh.reap(jax.grad(lambda x: jnp.sum(jnp.sin(sown(x)))), tag=T)(x)
    expected = perturbation_grads(net, x)
    for key in KEYS:
        close(d[("vjp", *key)], expected[key])


def test_nnx_params_as_argument_split_merge(net, x):
    sown = lh.sow_modules(net, tag=T)
    graphdef, state = nnx.split(sown)
    loss = lambda st: jnp.sum(jnp.sin(nnx.merge(graphdef, st)(x)))
    d = lh.reap(jax.grad(loss), tag=T)(state)
    expected = perturbation_grads(net, x)
    close(d["vjp", "blocks", "0", "norm", "__call__"], expected["blocks", "0", "norm", "__call__"])
    g_plain = jax.grad(lambda m: loss_by_hand(m, x))(net)
    close(jax.tree_util.tree_leaves(jax.grad(loss)(state)),
          jax.tree_util.tree_leaves(nnx.state(g_plain)))
    d = lh.reap(nnx.jit(lambda m, x: m(x)), tag=T)(sown, x)
    close(d["head", "__call__"], net(x))


def test_nnx_lh_vmap_batches(net, x):
    sown = lh.sow_modules(net, tag=T)
    xs = jnp.stack([x, -x, x + 1])
    d = lh.reap(lh.vmap(lambda x: sown(x)), tag=T)(xs)
    hand = jax.vmap(lambda x: net_by_hand(net, x))(xs)
    for key in KEYS:
        close(d[key], hand[key])
    g = lh.reap(lh.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(sown(x))))), tag=T)(xs)
    expected = jax.vmap(lambda x: perturbation_grads(net, x))(xs)
    close(g["vjp", "blocks", "1", "__call__"], expected["blocks", "1", "__call__"])


class Loop(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.alias = self.lin  # the same module under a second attribute

    def __call__(self, x):
        x = jnp.tanh(self.lin(x))
        return jnp.tanh(self.alias(x))


def test_nnx_repeated_and_shared_submodule():
    m = Loop(nnx.Rngs(2))
    x = jnp.array([1.0, -0.5, 0.25])
    with pytest.raises(lh.HarvestError, match="append"):
        lh.reap(lambda x: lh.sow_modules(m, tag=T)(x), tag=T)(x)
    sown = lh.sow_modules(m, tag=T, mode="append")
    assert sown.alias is sown.lin  # sharing survives the clone
    d = lh.reap(lambda x: sown(x), tag=T)(x)
    first = m.lin(x)
    second = m.lin(jnp.tanh(first))
    assert list(d.keys()) == [("alias", "__call__")]  # one site, its first path
    close(d["alias", "__call__"], jnp.stack([first, second]))


def test_nnx_two_tags_and_bad_arguments(net, x):
    both = lh.sow_modules(lh.sow_modules(net, tag="a"), tag="b",
                          filter=lambda p, m: p == ("head",))
    assert len(lh.reap(lambda x: both(x), tag="a")(x)) == len(KEYS) + 3
    db = lh.reap(lambda x: both(x), tag="b")(x)
    assert list(db.keys()) == [("head", "__call__")]
    close(db["head", "__call__"], net(x))
    assert type(both.head).__mro__[1] is nnx.Linear  # one subclass level, not two
    with pytest.raises(lh.HarvestError, match="unknown mode"):
        lh.sow_modules(net, tag=T, mode="last")


# --- linen -------------------------------------------------------------------

class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(4)(x))


class LinenNet(nn.Module):
    def setup(self):
        self.layers = [Dense2(), Dense2()]
        self.head = nn.Dense(2)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def linen_by_hand(params, x, eps=None):
    out, eps = {}, eps or {}

    def put(key, value):
        out[key] = value + eps.get(key, 0.0)
        return out[key]

    for i in range(2):
        p = params[f"layers_{i}"]["Dense_0"]
        h = put((f"layers_{i}", "Dense_0", "__call__"), x @ p["kernel"] + p["bias"])
        x = put((f"layers_{i}", "__call__"), jax.nn.relu(h))
    put(("head", "__call__"), x @ params["head"]["kernel"] + params["head"]["bias"])
    return out


@pytest.fixture(scope="module")
def linen():
    model = LinenNet()
    x = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]])
    return model, model.init(jax.random.key(0), x), x


def test_linen_values_match_capture_intermediates(linen):
    model, variables, x = linen
    apply = lh.sow_modules(model.apply, tag=T)
    close(apply(variables, x), model.apply(variables, x))
    d = lh.reap(lambda v, x: apply(v, x), tag=T)(variables, x)
    _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    flax_tree = state["intermediates"]
    for key in d.keys():
        node = flax_tree
        for part in key:
            node = node[part]
        close(d[key], node[0])
    hand = linen_by_hand(variables["params"], x)
    assert set(d.keys()) == set(hand)


def test_linen_plant_grad_filter(linen):
    model, variables, x = linen
    apply = lh.sow_modules(model.apply, tag=T)
    v = jnp.full((2, 4), 0.5)
    out = lh.plant(lambda x: apply(variables, x), tag=T)({("layers_1", "__call__"): v}, x)
    params = variables["params"]
    close(out, v @ params["head"]["kernel"] + params["head"]["bias"])
    key = ("layers_0", "Dense_0", "__call__")
    d = lh.reap(jax.grad(lambda x: jnp.sum(jnp.sin(apply(variables, x)))), tag=T)(x)
    expected = jax.grad(lambda e: jnp.sum(jnp.sin(linen_by_hand(params, x, {key: e})[
        "head", "__call__"])))(jnp.zeros((2, 4)))
    close(d[("vjp", *key)], expected)
    only_dense = lh.sow_modules(model.apply, tag=T, filter=lambda p, m: isinstance(m, nn.Dense))
    d = lh.reap(lambda x: only_dense(variables, x), tag=T)(x)
    assert set(d.keys()) == {("layers_0", "Dense_0", "__call__"),
                             ("layers_1", "Dense_0", "__call__"), ("head", "__call__")}


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        h = jnp.tanh(nn.Dense(3)(c) + x)
        return h, h


class Recurrent(nn.Module):
    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})
        return scan()(jnp.zeros(3), xs)[1]


class SownCell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        h = lh.sow(jnp.tanh(nn.Dense(3)(c) + x), tag="t", name="h", mode="append")
        return h, h


class SownRecurrent(nn.Module):
    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(SownCell, variable_broadcast="params", split_rngs={"params": False})
        return jnp.sum(scan()(jnp.zeros(3), xs)[1] ** 2)


def _recurrent_by_hand(p, xs, e=None):
    """SownRecurrent in plain JAX; `e[t]` added to the site at step t."""
    c, hs = jnp.zeros(3), []
    for t, x in enumerate(xs):
        c = jnp.tanh(c @ p["kernel"] + p["bias"] + x) + (0.0 if e is None else e[t])
        hs.append(c)
    return jnp.sum(jnp.stack(hs) ** 2), jnp.stack(hs)


def test_linen_scan_with_variable_broadcast_and_a_site_in_the_cell():
    # (issue 33, item 4) flax >= 0.12.9 checks that broadcast variables do not
    # depend on the loop by DCE of the body; a site there must not keep its
    # inputs live (lazyharvest.primitive.CHECK_TRACES)
    model, xs = SownRecurrent(), jnp.linspace(-1, 1, 12).reshape(4, 3)
    variables = model.init(jax.random.key(0), xs)
    p = variables["params"]["ScanSownCell_0"]["Dense_0"]
    loss, hs = _recurrent_by_hand(p, xs)
    out, d = lh.call_and_reap(model.apply, tag="t")(variables, xs)
    close(out, loss)
    close(d["h"], hs)  # one row per step
    grads, g = lh.call_and_reap(jax.grad(model.apply), tag="t")(variables, xs)
    close(grads["params"]["ScanSownCell_0"]["Dense_0"]["kernel"],
          jax.grad(lambda k: _recurrent_by_hand(dict(p, kernel=k), xs)[0])(p["kernel"]))
    close(g["h"], hs)
    e = jax.grad(lambda e: _recurrent_by_hand(p, xs, e)[0])(jnp.zeros((4, 3)))
    close(g["vjp", "h"], e)


def test_linen_scan_needs_append_and_stacks():
    model, xs = Recurrent(), jnp.linspace(-1, 1, 12).reshape(4, 3)
    variables = model.init(jax.random.key(0), xs)
    with pytest.raises(lh.HarvestError, match="append"):
        lh.reap(lambda x: lh.sow_modules(model.apply, tag=T)(variables, x), tag=T)(xs)
    apply = lh.sow_modules(model.apply, tag=T, mode="append")
    d = lh.reap(lambda x: apply(variables, x), tag=T)(xs)
    p = variables["params"]["ScanCell_0"]["Dense_0"]
    c, dense = jnp.zeros(3), []
    for x in xs:
        dense.append(c @ p["kernel"] + p["bias"])
        c = jnp.tanh(dense[-1] + x)
    close(d["ScanCell_0", "Dense_0", "__call__"], jnp.stack(dense))


def test_linen_module_instance_gets_a_hint(linen):
    model, _, _ = linen
    with pytest.raises(TypeError, match=r"model\.apply"):
        lh.sow_modules(model, tag=T)


# --- NNX with ref-backed Variables (issue 33, item 6) ---------------------------

class SownMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, e=0.0, sow=True):
        h = jnp.tanh(self.l1(x))
        return self.l2((lh.sow(h, tag="t", name="h") if sow else h) + e)


@pytest.mark.parametrize("kind", ["hijax", "ref"])
def test_nnx_ref_backed_variables(kind):
    if not hasattr(nnx, "var_defaults"):
        pytest.skip(f"flax {flax.__version__} has no nnx.var_defaults")
    with nnx.var_defaults(**{kind: True}):
        m = SownMLP(nnx.Rngs(0))
    x = jnp.array([0.5, -1.0, 0.3])
    kernel1, bias1 = jnp.asarray(m.l1.kernel[...]), jnp.asarray(m.l1.bias[...])
    kernel2, bias2 = jnp.asarray(m.l2.kernel[...]), jnp.asarray(m.l2.bias[...])
    h = jnp.tanh(x @ kernel1 + bias1)

    def loss(x, e=0.0):  # plain JAX
        return jnp.sum(((jnp.tanh(x @ kernel1 + bias1) + e) @ kernel2 + bias2) ** 2)
    out, d = lh.call_and_reap(lambda x: m(x), tag="t")(x)
    close(out, (h @ kernel2 + bias2))
    close(d["h"], h)
    g, dg = lh.call_and_reap(jax.grad(lambda x: jnp.sum(m(x) ** 2)), tag="t")(x)
    close(g, jax.grad(loss)(x))
    close(dg["vjp", "h"], jax.grad(loss, argnums=1)(x, jnp.zeros(4)))
    close(lh.plant(lambda x: m(x), tag="t")({"h": jnp.ones(4)}, x), jnp.ones(4) @ kernel2 + bias2)
    apply = lh.sow_modules(m, tag=T)
    dm = lh.reap(apply, tag=T)(x)
    close(dm["l1", "__call__"], x @ kernel1 + bias1)
    gm = lh.reap(jax.grad(lambda x: jnp.sum(apply(x) ** 2)), tag=T)(x)
    close(gm["vjp", "l2", "__call__"], 2 * (h @ kernel2 + bias2))
    # the model is untouched: its Variables hold what they held
    close(m.l1.kernel[...], kernel1)


# --- example -----------------------------------------------------------------

def test_example_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join("examples", "flax_nnx.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "__call__" in r.stdout and "norm" in r.stdout
