"""Tangents and cotangents of sites with JAX's own transforms (SPEC 3.2)."""

import jax
import jax.numpy as jnp
import numpy as np

import lazyharvest as lh
from helpers import close


def f(x):
    return lh.sow(x ** 3, tag="t", name="x3") + 1


def test_grad_gives_value_and_cotangent():
    d = lh.reap(jax.grad(f), tag="t")(2.)
    assert set(d.keys()) == {"x3", ("vjp", "x3")}
    close(d["x3"], 8.)
    close(d["vjp", "x3"], 1.)


def test_jvp_gives_value_and_tangent():
    d = lh.reap(lambda x: jax.jvp(f, (x,), (1.,)), tag="t")(3.)
    assert set(d.keys()) == {"x3", ("jvp", "x3")}
    close(d["x3"], 27.)
    close(d["jvp", "x3"], 27.)


def test_jvp_tangent_scales_with_input_tangent():
    d = lh.reap(lambda x, t: jax.jvp(f, (x,), (t,)), tag="t")(3., 0.5)
    close(d["jvp", "x3"], 0.5 * 27.)


def test_linearize_law_plain_names():
    _, f_jvp = jax.linearize(f, 3.)
    d = lh.reap(f_jvp, tag="t")(1.)
    assert list(d.keys()) == ["x3"]
    close(d["x3"], 27.)
    close(lh.reap(f_jvp, tag="t")(2.)["x3"], 54.)


def test_linearize_inside_reap_matches_outside():
    def g(x):
        return jnp.sum(lh.sow(jnp.sin(x) * x, tag="t", name="s") ** 2)
    x = jnp.arange(3.)
    t = jnp.array([1., -2., 0.5])
    _, g_jvp = jax.linearize(g, x)
    outside = lh.reap(g_jvp, tag="t")(t)["s"]
    inside = lh.reap(lambda x, t: jax.jvp(g, (x,), (t,)), tag="t")(x, t)["jvp", "s"]
    expected = jax.jvp(lambda x: jnp.sin(x) * x, (x,), (t,))[1]
    close(outside, expected)
    close(inside, expected)


def test_vjp_backward_function_gives_cotangents():
    def g(x):
        h = lh.sow(jnp.tanh(x), tag="t", name="h")
        return jnp.sum(h * 3.)
    x = jnp.array([0.1, -0.4])
    _, g_vjp = jax.vjp(g, x)
    d = lh.reap(g_vjp, tag="t")(2.)
    close(d["h"], jnp.full(2, 6.))


def test_grad_cotangent_equals_grad_wrt_perturbation():
    def g(x):
        h = lh.sow(jnp.sin(x), tag="t", name="h")
        return jnp.sum(jnp.exp(h) * x)
    x = jnp.array([0.3, 1.2, -0.7])
    expected = jax.grad(lambda e: jnp.sum(jnp.exp(jnp.sin(x) + e) * x))(jnp.zeros(3))
    close(lh.reap(jax.grad(g), tag="t")(x)["vjp", "h"], expected)


def test_unused_site_gets_zero_cotangent():
    def g(x):
        lh.sow(x * 2., tag="t", name="unused")
        return jnp.sum(x ** 2)
    d = lh.reap(jax.grad(g), tag="t")(jnp.ones(3))
    close(d["unused"], 2. * jnp.ones(3))
    close(d["vjp", "unused"], jnp.zeros(3))


def test_unused_site_tangent_is_kept():
    def g(x):
        lh.sow(x * 2., tag="t", name="unused")
        return x
    d = lh.reap(lambda x: jax.jvp(g, (x,), (3.,)), tag="t")(1.)
    close(d["jvp", "unused"], 6.)


def test_jacfwd_jacfwd_second_order_key():
    d = lh.reap(jax.jacfwd(jax.jacfwd(f)), tag="t")(1.)
    keys = list(d.keys())
    assert len(keys) == len(set(keys)) == 4
    close(d["x3"], 1.)
    close(jnp.reshape(d["jvp", "jvp", "x3"], ()), 6.)
    close(jnp.reshape(d["jvp", "primal", "x3"], ()), 3.)
    close(jnp.reshape(d["primal", "jvp", "x3"], ()), 3.)


def test_hessian_and_jacfwd_of_grad_have_unique_keys():
    def g(x):
        return jnp.sum(lh.sow(jnp.sin(x) * x[0], tag="t", name="s"))
    x = jnp.array([0.5, 1.5])
    for transform in (jax.hessian, lambda h: jax.jacfwd(jax.grad(h))):
        d = lh.reap(transform(g), tag="t")(x)
        keys = list(d.keys())
        assert len(keys) == len(set(keys))
        d.compute()
        close(d["s"], jnp.sin(x) * x[0])


def test_hessian_second_order_cotangent():
    # vjp-of-jvp: jacfwd(grad(g)) gives, under ("jvp", "vjp", ...), the tangent
    # of the cotangent at the site.
    def g(x):
        s = lh.sow(x ** 2, tag="t", name="s")
        return jnp.sum(s ** 2)
    x = jnp.array([1., 2.])
    d = lh.reap(jax.jacfwd(jax.grad(g)), tag="t")(x)
    # cotangent at s is 2 s = 2 x^2; its derivative w.r.t. x is diag(4 x).
    ct_key = [k for k in d.keys() if isinstance(k, tuple) and "vjp" in k and "jvp" in k]
    assert ct_key, list(d.keys())
    close(d[ct_key[0]], jnp.diag(4 * x))


def test_jacrev_works_on_vector_input():
    d = lh.reap(jax.jacrev(f), tag="t")(jnp.ones(3))
    close(d["x3"], jnp.ones(3))
    close(d["vjp", "x3"], jnp.eye(3))


def test_plant_into_backward_adds_cotangent():
    _, f_vjp = jax.vjp(f, 2.)
    (g,) = lh.plant(f_vjp, tag="t")({"x3": 10.}, 1.)
    close(g, (1. + 10.) * 12.)


def test_plant_cotangent_inside_grad():
    def g(x):
        return jnp.sum(lh.sow(jnp.sin(x), tag="t", name="s") * 2.)
    x = jnp.array([0.1, 0.2])
    ct = jnp.array([1., -1.])
    out = lh.plant(jax.grad(g), tag="t")({("vjp", "s"): ct}, x)
    close(out, (2. + ct) * jnp.cos(x))


def test_reap_vjp_law_through_planting():
    # VJP of call_and_reap fed (ct_out, ct_sites) == backward fn with ct planted.
    def g(x):
        h = lh.sow(jnp.sin(x) * x, tag="t", name="h")
        return jnp.sum(h ** 2)
    x = jnp.array([0.3, -1.1])
    ct_h = jnp.array([0.5, 2.])

    def out_and_sites(x):
        out, d = lh.call_and_reap(g, tag="t")(x)
        return out, d.compute()
    _, full_vjp = jax.vjp(out_and_sites, x)
    expected = full_vjp((1., {"h": ct_h}))
    _, g_vjp = jax.vjp(g, x)
    got = lh.plant(g_vjp, tag="t")({"h": ct_h}, 1.)
    close(got, expected)


def test_custom_jvp_rule_stays_in_force():
    @jax.custom_jvp
    def c(x):
        return lh.sow(jnp.sin(x), tag="t", name="in") * 2

    @c.defjvp
    def c_jvp(p, t):
        return c(p[0]), 100. * t[0]  # deliberately wrong

    close(jax.grad(lambda x: lh.call_and_reap(c, tag="t")(x)[0])(0.5), 100.)
    close(jax.grad(lambda x: lh.plant(c, tag="t")({"in": 3.}, x))(0.5), 100.)
    close(lh.plant(c, tag="t")({"in": 3.}, 0.5), 6.)
    close(lh.reap(c, tag="t")(0.5)["in"], np.sin(0.5))
    out, tan = jax.jvp(lambda x: lh.plant(c, tag="t")({"in": 3.}, x), (0.5,), (1.,))
    close((out, tan), (6., 100.))


def test_custom_vjp_rule_stays_in_force():
    @jax.custom_vjp
    def c(x):
        return lh.sow(jnp.cos(x), tag="t", name="in") * 3

    c.defvjp(lambda x: (c(x), x), lambda x, g: (g * 7.,))
    close(jax.grad(lambda x: lh.call_and_reap(c, tag="t")(x)[0])(0.5), 7.)
    close(jax.grad(lambda x: lh.plant(c, tag="t")({"in": 2.}, x))(0.5), 7.)
    close(lh.plant(c, tag="t")({"in": 2.}, 0.5), 6.)
    close(lh.reap(c, tag="t")(0.5)["in"], np.cos(0.5))
    close(lh.reap(jax.grad(c), tag="t")(0.5)["in"], np.cos(0.5))


def test_tangent_of_append_site_in_scan():
    def g(x):
        def body(c, xi):
            return c + lh.sow(xi * c, tag="t", name="p", mode="append"), None
        return jax.lax.scan(body, x, jnp.arange(1., 4.))[0]
    d = lh.reap(lambda x: jax.jvp(g, (x,), (1.,)), tag="t")(2.)
    # hand-written: c0 = x, p_i = i * c_{i-1}, c_i = c_{i-1} (1 + i)
    def hand(x):
        c, ps = x, []
        for i in (1., 2., 3.):
            ps.append(i * c)
            c = c * (1 + i)
        return jnp.stack(ps)
    close(d["p"], hand(2.))
    close(d["jvp", "p"], jax.jvp(hand, (2.,), (1.,))[1])
    dg = lh.reap(jax.grad(g), tag="t")(2.)
    # cotangent at p_i: d out / d p_i = prod_{j>i} (1 + j)
    close(dg["vjp", "p"], jnp.array([12., 4., 1.]))


def test_cotangent_inside_cond_and_checkpoint():
    def g(x):
        y = jax.lax.cond(x > 0, lambda v: lh.sow(v * 2, tag="t", name="b"),
                         lambda v: lh.sow(-v, tag="t", name="b"), x)
        z = jax.checkpoint(lambda v: lh.sow(jnp.sin(v), tag="t", name="k"))(y)
        return z * 5.
    d = lh.reap(jax.grad(g), tag="t")(0.3)
    close(d["b"], 0.6)
    close(d["k"], np.sin(0.6))
    close(d["vjp", "k"], 5.)
    close(d["vjp", "b"], 5. * np.cos(0.6))


def test_cotangent_planted_at_clobber_scan_site_goes_to_last_index():
    def g(x):
        def body(c, xi):
            return lh.sow(c * xi, tag="t", name="c", mode="clobber"), None
        return jax.lax.scan(body, 1., x)[0]
    x = jnp.array([2., 3., 4.])
    ct = 5.
    _, g_vjp = jax.vjp(g, x)
    got = lh.plant(g_vjp, tag="t")({"c": ct}, 1.)

    def out_and_sites(x):
        out, d = lh.call_and_reap(g, tag="t")(x)
        return out, d.compute()
    expected = jax.vjp(out_and_sites, x)[1]((1., {"c": ct}))
    close(got, expected)
    close(got, ((1. + ct) * jnp.array([12., 8., 6.]),))
