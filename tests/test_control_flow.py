"""Reap, plant and harvest through every higher-order primitive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax

sow = lh.sow


# --- scan ----------------------------------------------------------------------

def scan_fn(x):
    def body(c, xi):
        y = sow(jnp.sin(xi) * c, tag="t", name="ys", mode="append")
        c = sow(c + y, tag="t", name="c", mode="clobber")
        return c, y * 2
    c, ys = lax.scan(body, 1.0, x)
    return c + ys.sum()


def scan_hand(x, plant_ys=None, plant_c=None):
    c, ys = 1.0, []
    for i, xi in enumerate(x):
        y = jnp.sin(xi) * c if plant_ys is None else plant_ys[i]
        ys.append(y)
        c = c + y if plant_c is None else plant_c
    ys = jnp.stack(ys)
    return c + (2 * ys).sum(), ys, c


X = jnp.array([0.3, -0.2, 1.1, 0.7])


def test_scan_append_and_clobber():
    out, d = lh.call_and_reap(scan_fn, tag="t")(X)
    h_out, h_ys, h_c = scan_hand(X)
    close(out, h_out)
    close(d["ys"], h_ys)
    close(d["c"], h_c)


def test_scan_plant_append_and_clobber():
    p = jnp.array([1., 2., 3., 4.])
    close(lh.plant(scan_fn, tag="t")({"ys": p}, X), scan_hand(X, plant_ys=p)[0])
    close(lh.plant(scan_fn, tag="t")({"c": 0.5}, X), scan_hand(X, plant_c=0.5)[0])


def test_scan_harvest_excludes_planted():
    out, d = lh.harvest(scan_fn, tag="t")({"c": 0.5}, X)
    assert list(d.keys()) == ["ys"]
    h_out, h_ys, _ = scan_hand(X, plant_c=0.5)
    close(out, h_out)
    close(d["ys"], h_ys)


def test_scan_zero_length_clobber_gives_zeros():
    def g(x):
        return lax.scan(lambda c, xi: (sow(c + xi, tag="t", name="c", mode="clobber"),
                                       None), 0., x)[0]
    close(lh.reap(g, tag="t")(jnp.zeros(0))["c"], 0.)


def test_nested_scan_append_flattens_in_order():
    def g(x):
        def outer(c, xi):
            def inner(c2, k):
                return c2, sow(xi * k, tag="t", name="p", mode="append")
            return c, lax.scan(inner, 0., jnp.arange(3.))[1]
        return lax.scan(outer, 0., x)[1].sum()
    x = jnp.array([1., 10.])
    close(lh.reap(g, tag="t")(x)["p"], jnp.array([0., 1., 2., 0., 10., 20.]))


def test_reverse_scan_append_stacks_by_index():
    def g(x):
        return lax.scan(lambda c, xi: (c + xi, sow(c, tag="t", name="c", mode="append")),
                        0., x, reverse=True)[1]
    x = jnp.array([1., 2., 3.])
    # row i: the carry before step i, the sum of the later elements (by hand:
    # jax 0.12's Scan3, under jax_scan3, runs a reverse scan forward)
    close(lh.reap(g, tag="t")(x)["c"], jnp.array([5., 3., 0.]))


def test_fori_loop_is_a_scan_with_static_bounds():
    def g(x):
        return lax.fori_loop(0, 3, lambda i, c: sow(c * 2, tag="t", name="c",
                                                    mode="append"), x)
    close(lh.reap(g, tag="t")(1.)["c"], jnp.array([2., 4., 8.]))


# --- cond / switch ---------------------------------------------------------------

def cond_fn(x):
    return lax.cond(x.sum() > 0,
                    lambda v: sow(v * 2, tag="t", name="b") + 1,
                    lambda v: sow(v - 1, tag="t", name="b") * 3, x)


@pytest.mark.parametrize("x", [jnp.array([1., 2.]), jnp.array([-1., -2.])])
def test_cond_reaps_taken_branch(x):
    pos = bool(x.sum() > 0)
    expected = x * 2 if pos else x - 1
    close(lh.reap(cond_fn, tag="t")(x)["b"], expected)
    p = jnp.array([5., 6.])
    close(lh.plant(cond_fn, tag="t")({"b": p}, x), p + 1 if pos else p * 3)


def test_switch_three_branches():
    def g(i, x):
        return lax.switch(i, [lambda v: sow(v, tag="t", name="s"),
                              lambda v: sow(v * 2, tag="t", name="s"),
                              lambda v: sow(v * 3, tag="t", name="s")], x)
    for i in range(3):
        close(lh.reap(g, tag="t")(i, 2.)["s"], 2. * (i + 1))


# --- while ---------------------------------------------------------------------

def while_fn(x):
    return lax.while_loop(lambda s: s[0] < 3,
                          lambda s: (s[0] + 1, sow(s[1] * 1.5, tag="t", name="w",
                                                   mode="clobber")), (0, x))[1]


def test_while_clobber_last_value():
    close(lh.reap(while_fn, tag="t")(2.)["w"], 2. * 1.5 ** 3)


def test_while_never_runs_gives_zeros():
    def g(x):
        return lax.while_loop(lambda c: c < 0., lambda c: sow(c + 1, tag="t",
                                                               name="w", mode="clobber"), x)
    close(lh.reap(g, tag="t")(1.)["w"], 0.)


def test_while_plant_injects_every_iteration():
    close(lh.plant(while_fn, tag="t")({"w": 7.}, 2.), 7.)


def test_while_under_jit_and_vmap():
    close(lh.reap(jax.jit(while_fn), tag="t")(2.)["w"], 6.75)
    close(lh.reap(jax.vmap(while_fn), tag="t")(jnp.array([2., 4.]))["w"],
          jnp.array([6.75, 13.5]))


# --- jit / closed_call / remat ---------------------------------------------------

def test_jit_boundary_kept_and_plant():
    inner = jax.jit(lambda q: sow(q * 3, tag="t", name="j") + 1)
    def g(x):
        return inner(x) * 2
    close(lh.reap(g, tag="t")(2.)["j"], 6.)
    close(lh.plant(g, tag="t")({"j": 1.}, 2.), 4.)
    # The planted program still calls the user's jit.
    flat_prog = lh.plant(g, tag="t")
    jaxpr = jax.make_jaxpr(lambda x: flat_prog({"j": 1.}, x))(2.)
    assert "jit" in str(jaxpr)


def test_checkpoint_reap_plant():
    def g(x):
        return jax.checkpoint(lambda v: jnp.sin(sow(jnp.cos(v), tag="t", name="k")))(x)
    close(lh.reap(g, tag="t")(0.4)["k"], np.cos(0.4))
    close(lh.plant(g, tag="t")({"k": 0.2}, 0.4), np.sin(0.2))
    # grad of the planted program: the site is a constant
    close(jax.grad(lambda x: lh.plant(g, tag="t")({"k": 0.2}, x))(0.4), 0.)
    # planting into a program that differentiates replaces the primal value
    # only; the derivative still flows through the site (documented)
    close(lh.plant(jax.grad(g), tag="t")({"k": 0.2}, 0.4), np.cos(0.2) * -np.sin(0.4))
    d = lh.reap(jax.grad(g), tag="t")(0.4)
    close(d["vjp", "k"], np.cos(np.cos(0.4)))


def test_closed_call():
    from lazyharvest._jax import closed_call

    def g(x):
        return closed_call(lambda v: [sow(v * 4, tag="t", name="n") + 1], x)[0]
    assert _jax.closed_call_p.name in str(jax.make_jaxpr(g)(1.5))
    close(lh.reap(g, tag="t")(1.5)["n"], 6.)
    close(lh.plant(g, tag="t")({"n": 2.}, 1.5), 3.)
    close(lh.reap(jax.grad(g), tag="t")(1.5)["vjp", "n"], 1.)


def test_named_call():
    def g(x):
        return jax.named_call(lambda v: sow(v * 4, tag="t", name="n"), name="blk")(x)
    close(lh.reap(g, tag="t")(1.5)["n"], 6.)


# --- composition with JAX transforms around the harvested function -------------------

def big(x):
    y = jax.jit(lambda v: sow(jnp.tanh(v), tag="t", name="a"))(x)
    z = lax.cond(y.sum() > -10, lambda v: sow(v * 2, tag="t", name="b"),
                 lambda v: sow(v, tag="t", name="b"), y)
    c, ys = lax.scan(lambda c, v: (c + v, sow(c * v, tag="t", name="s", mode="append")),
                     0., z)
    k = jax.checkpoint(lambda v: sow(jnp.exp(v), tag="t", name="k"))(c)
    sow(jnp.ones(2) * 7., tag="t", name="const")
    sow(x * 0. + 3., tag="t", name="unused")
    return k + ys.sum()


def big_hand(x):
    a = jnp.tanh(x)
    b = a * 2
    c, ss = 0., []
    for v in b:
        ss.append(c * v)
        c = c + v
    ss = jnp.stack(ss)
    k = jnp.exp(c)
    return {"a": a, "b": b, "s": ss, "k": k, "const": jnp.ones(2) * 7.,
            "unused": x * 0. + 3.}, k + ss.sum()


XS = jnp.array([0.1, -0.5, 0.3])


def test_big_reap_all():
    out, d = lh.call_and_reap(big, tag="t")(XS)
    sites, h_out = big_hand(XS)
    close(out, h_out)
    close(d.compute(), sites)


def test_big_under_jit_vmap():
    for wrap in (jax.jit, lambda h: jax.jit(jax.jit(h))):
        close(lh.reap(wrap(big), tag="t")(XS).compute(), big_hand(XS)[0])
    xb = jnp.stack([XS, XS * 2])
    got = lh.reap(jax.vmap(big), tag="t")(xb).compute()
    exp = jax.vmap(lambda x: big_hand(x)[0])(xb)
    exp["const"] = jnp.ones(2) * 7.  # unbatched: does not depend on the input
    # plain jax.vmap batches a site at axis 0 where it is sown; the scan then
    # stacks iterations in front (lh.vmap honours out_axes instead)
    exp["s"] = exp["s"].T
    close(got, exp)


def test_big_under_grad_and_jvp():
    d = lh.reap(jax.grad(big), tag="t")(XS)
    close({k: d[k] for k in ("a", "b", "s", "k")},
          {k: v for k, v in big_hand(XS)[0].items() if k in "absk"})
    # cotangent of each site: gradient of the output w.r.t. a perturbation there
    def perturbed(e):
        a = jnp.tanh(XS) + e
        b = a * 2
        c, ss = 0., []
        for v in b:
            ss.append(c * v)
            c = c + v
        return jnp.exp(c) + jnp.stack(ss).sum()
    close(d["vjp", "a"], jax.grad(perturbed)(jnp.zeros(3)), rtol=1e-4)
    close(d["vjp", "unused"], jnp.zeros(3))
    t = jnp.array([1., 0., -1.])
    dj = lh.reap(lambda x: jax.jvp(big, (x,), (t,)), tag="t")(XS)
    close(dj["jvp", "s"], jax.jvp(lambda x: big_hand(x)[0]["s"], (XS,), (t,))[1],
          rtol=1e-4)


def test_jit_around_reap_stages_leaves():
    @jax.jit
    def g(x):
        return lh.reap(big, tag="t")(x).compute()
    close(g(XS), big_hand(XS)[0])


def test_grad_around_plant():
    def loss(p):
        return lh.plant(big, tag="t")({"k": p}, XS)
    close(jax.grad(loss)(2.), 1.)


# --- nested harvests --------------------------------------------------------------

def two_tags(x):
    a = sow(x * 2, tag="a", name="v")
    b = sow(a + 1, tag="b", name="v")
    return b * 3


def test_nested_harvests_of_different_tags():
    def inner(x):
        out, d = lh.call_and_reap(two_tags, tag="a")(x)
        return out, d.compute()
    d = lh.reap(inner, tag="b")(1.)
    close(d["v"], 3.)
    out, da = lh.call_and_reap(lambda x: lh.call_and_reap(two_tags, tag="b")(x)[0],
                               tag="a")(1.)
    close(out, 9.)
    close(da["v"], 2.)


def test_exclusive_hides_other_tags():
    d = lh.reap(lambda x: lh.call_and_reap(two_tags, tag="a", exclusive=True)(x)[0],
                tag="b")(1.)
    assert len(d) == 0
    d = lh.reap(lambda x: lh.call_and_reap(two_tags, tag="a")(x)[0], tag="b")(1.)
    close(d["v"], 3.)


def test_nested_harvest_same_tag_consumes_sites():
    d = lh.reap(lambda x: lh.plant(two_tags, tag="a")({"v": 5.}, x), tag="a")(1.)
    assert len(d) == 0
    d = lh.reap(lambda x: lh.reap(two_tags, tag="a")(x).compute()["v"] + 0., tag="a")(1.)
    assert len(d) == 0


def test_allowlist_blocklist():
    def g(x):
        return sow(x, tag="t", name="p") + sow(x * 2, tag="t", name="q")
    assert list(lh.reap(g, tag="t", allowlist=["p"])(1.).keys()) == ["p"]
    assert list(lh.reap(g, tag="t", blocklist=["p"])(1.).keys()) == ["q"]
    # a plant for a filtered-out site is ignored silently
    close(lh.plant(g, tag="t", allowlist=["p"])({"q": 100.}, 1.), 3.)


def test_nest_prepends_scope():
    def g(x):
        return sow(x * 2, tag="t", name="v")
    d = lh.reap(lh.nest(g, scope="blk"), tag="t")(1.)
    assert list(d.keys()) == [("blk", "v")]
    close(d["blk"]["v"], 2.)
    d2 = lh.reap(lh.nest(lh.nest(g, scope="in"), scope="out"), tag="t")(1.)
    assert list(d2.keys()) == [("out", "in", "v")]
    close(lh.plant(lh.nest(g, scope="blk"), tag="t")({"blk": {"v": 9.}}, 1.), 9.)


def test_nest_under_jax_jit_retraces_with_scope():
    g = jax.jit(lambda x: sow(x * 2, tag="t", name="v"))
    plain = lh.reap(g, tag="t")(1.)
    nested = lh.reap(lh.nest(g, scope="s"), tag="t")(1.)
    assert list(plain.keys()) == ["v"]
    assert list(nested.keys()) == [("s", "v")]


# --- constants, pytrees, modes ------------------------------------------------------

def test_constants_are_reaped():
    d = lh.reap(lambda x: x + sow(jnp.arange(3.), tag="t", name="c").sum(), tag="t")(1.)
    close(d["c"], jnp.arange(3.))


def test_pytree_sites():
    def g(x):
        v = sow({"a": x, "b": (x * 2, x * 3)}, tag="t", name="tree")
        return v["a"] + v["b"][1]
    d = lh.reap(g, tag="t")(1.)
    close(d["tree"], {"a": 1., "b": (2., 3.)})
    close(lh.plant(g, tag="t")({"tree": {"a": 10., "b": (0., 1.)}}, 1.), 11.)


def test_straight_line_modes():
    def g(x):
        sow(x, tag="t", name="c", mode="clobber")
        sow(x * 2, tag="t", name="c", mode="clobber")
        sow(x, tag="t", name="a", mode="append")
        sow(x * 3, tag="t", name="a", mode="append")
        return x
    d = lh.reap(g, tag="t")(1.)
    close(d["c"], 2.)
    close(d["a"], jnp.array([1., 3.]))


def test_python_loop_append_plant():
    def g(x):
        for _ in range(3):
            x = sow(x + 1, tag="t", name="a", mode="append")
        return x
    close(lh.reap(g, tag="t")(0.)["a"], jnp.array([1., 2., 3.]))
    close(lh.plant(g, tag="t")({"a": jnp.array([5., 6., 7.])}, 0.), 7.)
