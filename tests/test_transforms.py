"""Recorded transforms (SPEC 3.3): same results as JAX, and transformed-slice leaves."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

sow = lh.sow


def f(x):
    return sow(x ** 3, tag="t", name="x3") + 1


# --- same arguments, same results as JAX ---------------------------------------

def g2(x, y):
    h = sow(jnp.sin(x) * y["w"], tag="t", name="h")
    return jnp.sum(h ** 2) + jnp.sum(y["b"]), {"aux": h}


X = jnp.array([0.3, -0.7, 1.1])
Y = {"w": jnp.array([1., 2., 3.]), "b": jnp.array(0.5)}


@pytest.mark.parametrize("name,kwargs", [
    ("grad", dict(argnums=0, has_aux=True)),
    ("grad", dict(argnums=(0, 1), has_aux=True)),
    ("value_and_grad", dict(argnums=(1,), has_aux=True)),
    ("jacfwd", dict(argnums=(0, 1), has_aux=True)),
    ("jacrev", dict(argnums=1, has_aux=True)),
    ("hessian", dict(argnums=0, has_aux=True)),
])
def test_differential_transforms_match_jax(name, kwargs):
    expected = getattr(jax, name)(g2, **kwargs)(X, Y)
    close(getattr(lh, name)(g2, **kwargs)(X, Y), expected)
    # and while a harvest records them
    out, _ = lh.call_and_reap(getattr(lh, name)(g2, **kwargs), tag="t")(X, Y)
    close(out, expected)


def test_vmap_matches_jax_with_pytree_axes():
    def h(a, b):
        return {"s": sow(a * b["k"], tag="t", name="s").sum(), "v": a}
    a = jnp.ones((3, 4))
    b = {"k": jnp.arange(3.)}
    kw = dict(in_axes=(1, {"k": None}), out_axes={"s": 0, "v": 1})
    expected = jax.vmap(h, **kw)(a, b)
    close(lh.vmap(h, **kw)(a, b), expected)
    out, d = lh.call_and_reap(lh.vmap(h, **kw), tag="t")(a, b)
    close(out, expected)
    # pytree out_axes: sites are batched along 0
    close(d["s"], jnp.broadcast_to(jnp.arange(3.), (4, 3)))


def test_jit_static_argnums_and_attributes():
    def h(x, n):
        return sow(x * n, tag="t", name="s")
    j = lh.jit(h, static_argnums=1)
    close(j(2., 3), 6.)
    assert "mul" in j.lower(2., 3).as_text() or j.lower(2., 3) is not None
    d = lh.reap(lambda x: j(x, 4), tag="t")(2.)
    close(d["s"], 8.)
    close(d["jit", "s"], 8.)


def test_jvp_linearize_vjp_match_jax():
    def h(x):
        return jnp.sum(sow(jnp.sin(x) * x, tag="t", name="s"))
    t = jnp.array([1., 0., -1.])
    close(lh.jvp(h, (X,), (t,)), jax.jvp(h, (X,), (t,)))
    out, lin = lh.linearize(h, X)
    e_out, e_lin = jax.linearize(h, X)
    close((out, lin(t)), (e_out, e_lin(t)))
    out, back = lh.vjp(h, X)
    e_out, e_back = jax.vjp(h, X)
    close((out, back(2.)), (e_out, e_back(2.)))

    def inside(x):
        o, lin = lh.linearize(h, x)
        o2, back = lh.vjp(h, x)
        return o + lin(t) + back(1.)[0].sum() + lh.jvp(h, (x,), (t,))[1]
    expected = jax.jit(lambda x: (lambda o, lin: o + lin(t))(*jax.linearize(h, x))
                       + jax.vjp(h, x)[1](1.)[0].sum() + jax.jvp(h, (x,), (t,))[1])(X)
    out, d = lh.call_and_reap(inside, tag="t")(X)
    close(out, expected)
    close(d["jvp", "s"], jax.jvp(lambda x: jnp.sin(x) * x, (X,), (t,))[1])
    jac = jax.jacfwd(lambda x: jnp.sin(x) * x)(X)
    close(d["linearize", "s"], jac)
    close(d["vjp", "s"], jac)


# --- SPEC 3.3 normative examples -------------------------------------------------

def test_normative_grad():
    d = lh.reap(lh.grad(f), tag="t")(2.)
    close(d["x3"], 8.)
    close(d["grad", "x3"], 12.)
    close(d.fn("grad", "x3")(3.), 27.)


def test_normative_jit_vmap_grad_and_alias():
    d = lh.reap(lh.jit(lh.vmap(lh.grad(f))), tag="t")(jnp.array([2., 2.]))
    close(d["grad", "vmap", "x3"], [12., 12.])
    assert d["grad", "vmap", "x3"] is d["grad", "vmap", "jit", "x3"]
    assert d["grad", "x3"] is d["grad", "vmap", "x3"]
    close(d["x3"], [8., 8.])


def test_normative_vmap_out_axes():
    x = jnp.arange(21.).reshape(3, 7)
    d = lh.reap(lh.vmap(f, in_axes=0, out_axes=-1), tag="t")(x)
    assert d["x3"].shape == (7, 3)
    close(d["x3"], (x ** 3).T)


def test_normative_jacrev():
    d = lh.reap(lh.jacrev(f), tag="t")(jnp.ones(3))
    close(d["jacrev", "x3"], 3 * jnp.eye(3))


def test_transforms_inside_helpers_lambdas_and_jax_jit():
    def helper(x):
        return lh.grad(lambda y: f(y) * 2)(x)

    d = lh.reap(lambda x: helper(x) + 1, tag="t")(2.)
    close(d["grad", "x3"], 12.)
    d = lh.reap(jax.jit(lambda x: lh.vmap(lh.grad(f))(x).sum()), tag="t")(jnp.ones(2) * 2)
    close(d["grad", "vmap", "x3"], [12., 12.])


def test_nest_scopes_come_after_labels():
    d = lh.reap(lh.grad(lh.nest(f, scope="blk")), tag="t")(2.)
    assert ("grad", "blk", "x3") in d
    close(d["grad"]["blk"]["x3"], 12.)
    close(d["blk", "x3"], 8.)


# --- leaves equal their direct definition (T applied to a hand-written slice) ------

def model(x, w):
    h1 = sow(jnp.tanh(x * w[0]), tag="t", name="h1")
    h2 = sow(jnp.sin(h1) * w[1] + x, tag="t", name="h2")
    return jnp.sum(h2 ** 2) + w[2]


def slice_h1(x, w):
    return jnp.tanh(x * w[0])


def slice_h2(x, w):
    return jnp.sin(slice_h1(x, w)) * w[1] + x


XM = jnp.array([0.2, -0.4, 0.9])
WM = jnp.array([1.5, -0.5, 0.3])

SINGLE = [
    ("grad", {}, lambda s, **k: jax.jacrev(s, **k)),
    ("grad", {"argnums": 1}, lambda s, **k: jax.jacrev(s, **k)),
    ("grad", {"argnums": (0, 1)}, lambda s, **k: jax.jacrev(s, **k)),
    ("jacfwd", {"argnums": 1}, lambda s, **k: jax.jacfwd(s, **k)),
    ("jacrev", {}, lambda s, **k: jax.jacrev(s, **k)),
    ("hessian", {"argnums": 1}, lambda s, **k: jax.hessian(s, **k)),
]


@pytest.mark.parametrize("name,kwargs,direct", SINGLE)
@pytest.mark.parametrize("site,slice_fn", [("h1", slice_h1), ("h2", slice_h2)])
def test_single_differential_leaf(name, kwargs, direct, site, slice_fn):
    fn = model if name != "jacfwd" and name != "jacrev" else (
        lambda x, w: (lambda m: jnp.stack([m, m * 2]))(model(x, w)))
    d = lh.reap(getattr(lh, name)(fn, **kwargs), tag="t")(XM, WM)
    close(d[name, site], direct(slice_fn, **kwargs)(XM, WM), rtol=1e-4)
    close(d[site], slice_fn(XM, WM))


def test_jvp_leaf_and_vmap_leaf():
    t = (jnp.ones(3), jnp.zeros(3))
    d = lh.reap(lambda x, w: lh.jvp(model, (x, w), t), tag="t")(XM, WM)
    close(d["jvp", "h2"], jax.jvp(slice_h2, (XM, WM), t)[1])
    xs = jnp.stack([XM, XM * 2])
    d = lh.reap(lh.vmap(model, in_axes=(0, None)), tag="t")(xs, WM)
    close(d["vmap", "h2"], jax.vmap(slice_h2, in_axes=(0, None))(xs, WM))
    assert d["h2"] is d["vmap", "h2"]


def test_compositions_of_two_and_three():
    xs = jnp.stack([XM, XM * 2, -XM])
    d = lh.reap(lh.jit(lh.vmap(lh.grad(model), in_axes=(0, None))), tag="t")(xs, WM)
    close(d["grad", "vmap", "jit", "h2"],
          jax.vmap(jax.jacrev(slice_h2), in_axes=(0, None))(xs, WM), rtol=1e-4)
    close(d["vmap", "h1"], jax.vmap(slice_h1, in_axes=(0, None))(xs, WM))
    # grad of grad: the second derivative of the slice
    scalar = lambda x, w: jnp.sum(model(x, w))
    inner = lambda x: lh.grad(scalar, argnums=1)(x, WM).sum()
    d = lh.reap(lh.grad(inner), tag="t")(XM)
    direct = jax.jacrev(lambda x: jax.jacrev(slice_h1, argnums=1)(x, WM))(XM)
    close(d["grad", "grad", "h1"], direct, rtol=1e-4)
    # ("grad", "h1") would be ambiguous (which grad?): both spell every level
    assert ("grad", "h1") not in d
    close(d["grad", "~grad", "h1"], jax.jacrev(slice_h1, argnums=1)(XM, WM), rtol=1e-4)
    close(d["~grad", "grad", "h1"], jax.jacrev(slice_h1)(XM, WM), rtol=1e-4)
    # hessian inside vmap
    d = lh.reap(lh.vmap(lh.hessian(lambda x: model(x, WM))), tag="t")(xs)
    close(d["hessian", "vmap", "h1"],
          jax.vmap(jax.hessian(lambda x: slice_h1(x, WM)))(xs), rtol=1e-4)


def test_vmap_reap_commutes_with_append_scan_and_broadcast():
    def h(x):
        c, ys = lax.scan(lambda c, v: (c + v, sow(c * v, tag="t", name="p",
                                                   mode="append")), 0., x)
        sow(jnp.ones(2), tag="t", name="const")
        return c * jnp.ones(2)
    xs = jnp.arange(12.).reshape(3, 4)
    for out_axes in (0, 1, -1):
        d = lh.reap(lh.vmap(h, out_axes=out_axes), tag="t")(xs)
        per = [lh.reap(h, tag="t")(x).compute() for x in xs]
        close(d["p"], jnp.stack([p["p"] for p in per], axis=out_axes))
        close(d["const"], jnp.stack([p["const"] for p in per], axis=out_axes))
    assert lh.reap(lh.vmap(h), tag="t")(xs)["p"].shape == (3, 4)


def test_derivative_of_independent_site_is_zero():
    def h(x):
        sow(jnp.ones(3) * 2., tag="t", name="c")
        return jnp.sum(x ** 2)
    d = lh.reap(lh.grad(h), tag="t")(jnp.ones(4))
    close(d["grad", "c"], jnp.zeros((3, 4)))


def test_plant_under_recorded_transforms():
    close(lh.plant(lh.grad(f), tag="t")({"x3": 5.}, 2.), 0.)
    xs = jnp.array([1., 2.])
    close(lh.plant(lh.vmap(f), tag="t")({"x3": jnp.array([10., 20.])}, xs), [11., 21.])
    with pytest.raises(lh.HarvestError):
        lh.plant(lh.grad(f), tag="t")({("grad", "x3"): 5.}, 2.)


def test_zero_derivative_leaf_has_no_arithmetic():
    def h(x):
        sow(jnp.ones(3) * 2., tag="t", name="c")
        return jnp.sum(x ** 2)
    d = lh.reap(lh.grad(h), tag="t")(jnp.ones(4))
    text = d.lower(("grad", "c")).as_text()
    for op in ("multiply", "add", "dot_general", "subtract"):
        assert op not in text, op


def test_jacobian_leaf_picks_mode_by_size():
    w = jnp.linspace(-1, 1, 100).reshape(50, 2)

    def h(x):
        return jnp.sum(sow(jnp.sin(w @ x), tag="t", name="wide"))
    d = lh.reap(lh.grad(h), tag="t")(jnp.ones(2))
    close(d["grad", "wide"], jax.jacfwd(lambda x: jnp.sin(w @ x))(jnp.ones(2)), rtol=1e-5)
    # forward mode: 2 tangent directions, no 50x50 cotangent basis
    assert "50x50" not in d.lower(("grad", "wide")).as_text()


def test_jit_around_transform_around_jit_keeps_every_level():
    g = lambda x: jnp.sum(sow(x ** 3, tag="t", name="x3"))
    x = jnp.array([1., 2.])
    d = lh.reap(lh.jit(lh.grad(lh.jit(g))), tag="t")(x)
    assert ("jit", "grad", "jit", "x3") in d
    close(d["grad", "x3"], jax.jacrev(lambda v: v ** 3)(x))
    d = lh.reap(lh.jit(lh.vmap(lh.jit(lambda v: sow(v * 2, tag="t", name="s")),
                              out_axes=1)), tag="t")(jnp.ones((3, 2)))
    assert d["s"].shape == (2, 3)


@pytest.mark.parametrize("transform", [
    lambda g: lh.grad(g, argnums=(0, 1)),
    lambda g: lh.jacrev(lh.jacrev(g)),
    lambda g: lh.hessian(g, argnums=1),
    lambda g: lh.jacfwd(g, argnums=1),
    lambda g: lh.vmap(lh.grad(g), in_axes=(0, None)),
    lambda g: (lambda x, w: lh.jvp(g, (x, w), (x, w))),
])
def test_avals_without_computation_match_computed_leaves(transform):
    # keys()/avals come from an abstract trace that never differentiates:
    # derivative leaves get their avals from the primal's
    def g(x, w):
        h = sow(jnp.tanh(x * w["a"]), tag="t", name="h")
        return jnp.sum(h ** 2) * w["b"]
    x = jnp.array([0.1, 0.2, 0.3])
    w = {"a": jnp.ones(3), "b": jnp.array(2.)}
    d = lh.reap(transform(g), tag="t")(x, w)
    avals = d.avals
    for k in d.keys():
        shape = lambda t: jax.tree_util.tree_map(lambda v: (v.shape, v.dtype), t)
        assert shape(d[k]) == shape(avals[k]), k


def test_a_rebuilt_grad_wrapper_checks_its_function_and_runs_outside_a_harvest():
    # (built when first called outside a harvest: a loop rebuilding it pays little)
    with pytest.raises(TypeError, match="callable"):
        lh.grad(3)
    f = lambda x: jnp.sum(jnp.sin(x) ** 2)  # noqa: E731
    x = jnp.arange(3.0)
    for _ in range(2):
        g = lh.grad(f)
        np.testing.assert_allclose(g(x), jax.grad(f)(x), rtol=1e-6)
        np.testing.assert_allclose(g(x), jax.grad(f)(x), rtol=1e-6)
    v, gv = lh.value_and_grad(f)(x)
    np.testing.assert_allclose(gv, jax.grad(f)(x), rtol=1e-6)


# --- a reap traces no transformation of the function ---------------------------------

def _counted_tanh():
    """tanh whose JVP rule counts its calls: one per differentiation traced."""
    calls = []

    @jax.custom_jvp
    def tanh(x):
        return jnp.tanh(x)

    @tanh.defjvp
    def _(primals, tangents):
        calls.append(1)
        y = jnp.tanh(primals[0])
        return y, (1 - y ** 2) * tangents[0]
    return tanh, calls


def test_a_reap_of_recorded_vmap_of_grad_differentiates_nothing_until_a_leaf_is_read():
    # The output types of lh.grad and lh.vmap follow from the function's
    # types; a reap used to trace each recorded level's transformation to
    # learn them (the JVP rule ran twice for vmap of grad).
    def make_loss(tanh):
        def loss(w, x):
            return sow(jnp.mean(tanh(x @ w) ** 2), tag="t", name="loss")
        return loss
    w = jnp.linspace(-1., 1., 12).reshape(4, 3)
    xs = jnp.linspace(0., 1., 20).reshape(5, 4)
    # (a harvest traces a custom rule once to look for sites in it: the
    # same number of calls for an untransformed reap)
    tanh, searched = _counted_tanh()
    lh.reap(make_loss(tanh), tag="t")(w, xs[0])
    tanh, calls = _counted_tanh()
    d = lh.reap(lh.vmap(lh.grad(make_loss(tanh)), in_axes=(None, 0)), tag="t")(w, xs)
    assert len(calls) == len(searched)
    want = jax.vmap(jax.grad(make_loss(jnp.tanh)), in_axes=(None, 0))(w, xs)
    close(d["grad", "loss"], want)
    assert len(calls) > len(searched), "the leaf differentiates"


def _typed(tree):
    return jax.tree_util.tree_map(lambda a: (a.shape, a.dtype, a.weak_type), tree)


@pytest.mark.parametrize("name,kwargs,args", [
    ("grad", {}, (2.0, jnp.ones(3))),  # a weak-typed argument
    ("grad", dict(argnums=(0, 1)), (jnp.float16(1.5), jnp.ones(3, jnp.bfloat16))),
    ("grad", dict(argnums=1, has_aux=True), (2.0, {"a": jnp.ones(3), "b": (jnp.ones(2),)})),
    ("value_and_grad", {}, (2.0, jnp.ones(3))),
    ("value_and_grad", dict(argnums=(1,), has_aux=True), (jnp.ones(2), {"a": jnp.ones(3)})),
    ("vmap", {}, (jnp.ones((4, 2)), jnp.ones((4, 3)))),
    ("vmap", dict(in_axes=(None, 1), out_axes=-1), (jnp.ones(2), jnp.ones((3, 4)))),
    ("vmap", dict(in_axes=(0, None)), (jnp.ones((4, 2)), 3.0)),
    ("jit", {}, (2.0, jnp.ones(3, jnp.int32))),
])
def test_recorded_transforms_give_the_output_types_jax_gives(name, kwargs, args):
    def fn(a, b):
        a_sum = sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(a))
        b_sum = sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(b))
        value = sow(jnp.sin(a_sum) * b_sum, tag="t", name="v").astype(
            jnp.result_type(jax.tree_util.tree_leaves(a)[0]))
        if kwargs.get("has_aux"):
            return value, {"aux": b_sum * 2, "w": 3.0}
        return (value, 2.0) if name in ("vmap", "jit") else value
    want = jax.eval_shape(getattr(jax, name)(fn, **kwargs), *args)
    got = jax.eval_shape(lambda *a: lh.call_and_reap(getattr(lh, name)(fn, **kwargs),
                                                      tag="t")(*a)[0], *args)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert _typed(got) == _typed(want)
    out, _ = lh.call_and_reap(getattr(lh, name)(fn, **kwargs), tag="t")(*args)
    expected = getattr(jax, name)(fn, **kwargs)(*args)
    close(out, expected)
    assert _typed(jax.tree_util.tree_map(jnp.asarray, out)) == _typed(
        jax.tree_util.tree_map(jnp.asarray, expected))
