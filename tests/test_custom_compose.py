"""Plants inside custom_jvp/custom_vjp functions that close over arrays: the
user's rule stays in force, the plant is a constant for it."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.ode import odeint

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax

needs_custom_call_hooks = pytest.mark.skipif(
    not _jax.CUSTOM_CALL_HOOKS, reason="a custom call's functions are hookable on jax >= 0.9")

W = jnp.array([1.5, -2.0])  # closed over by the custom functions below
X = jnp.array([0.3, 0.4])


@jax.custom_vjp
def vjp_fn(x):
    return jnp.sum(lh.sow(jnp.sin(x) * W, tag="t", name="h") ** 2)


vjp_fn.defvjp(lambda x: (vjp_fn(x), x), lambda x, g: (g * 7.0 * jnp.ones_like(x),))


@jax.custom_jvp
def jvp_fn(x):
    return jnp.sum(lh.sow(jnp.sin(x) * W, tag="t", name="h") ** 2)


jvp_fn.defjvp(lambda p, t: (jvp_fn(*p), 5.0 * jnp.sum(t[0])))


def test_plant_in_custom_vjp_closing_over_arrays_under_grad():
    c = jnp.ones(2)
    got = jax.grad(lambda x: lh.plant(vjp_fn, tag="t")({"h": c}, x))(X)
    close(got, jnp.full(2, 7.0))                     # the user's (deliberately odd) rule
    close(lh.plant(vjp_fn, tag="t")({"h": c}, X), 2.0)   # sum(c ** 2)


def test_plant_in_custom_jvp_closing_over_arrays_under_grad():
    c = jnp.ones(2)
    got = jax.grad(lambda x: lh.plant(jvp_fn, tag="t")({"h": c}, x))(X)
    close(got, jnp.full(2, 5.0))
    close(lh.reap(jvp_fn, tag="t")(X)["h"], jnp.sin(X) * W)


K = jnp.float32(0.7)


def dynamics(y, t, a):
    return lh.sow(-a * y * K, tag="t", name="rate", mode="clobber")


def solve(y0, a):
    return odeint(dynamics, y0, jnp.array([0., 1.]), a)[-1]


@needs_custom_call_hooks
def test_plant_in_odeint_dynamics():
    y0, a = jnp.float32(1.0), jnp.float32(2.0)
    planted = lambda a: lh.plant(solve, tag="t")({"rate": jnp.float32(-0.5)}, y0, a)
    close(planted(a), 0.5, rtol=1e-4)                 # dy/dt = -0.5 for one unit of time
    # odeint's adjoint rule differentiates the planted dynamics (SPEC 9):
    # y(1) = y0 - 0.5 no longer depends on a (it once gave the unplanted gradient)
    close(jax.grad(planted)(a), 0., atol=1e-5)


def test_plant_in_equinox_filter_custom_vjp():
    eqx = __import__("pytest").importorskip("equinox")

    @eqx.filter_custom_vjp
    def f(vjp_arg, x):
        return jnp.sum(lh.sow(jnp.sin(x) * vjp_arg, tag="t", name="h"))

    @f.def_fwd
    def f_fwd(perturbed, vjp_arg, x):
        return f(vjp_arg, x), None

    @f.def_bwd
    def f_bwd(res, g, perturbed, vjp_arg, x):
        return jnp.full_like(vjp_arg, 3.)           # the user's rule

    w = jnp.array([1., 2.])
    planted = lambda w: lh.plant(lambda w: f(w, X), tag="t")({"h": jnp.ones(2)}, w)
    close(planted(w), 2.0)
    close(jax.grad(planted)(w), jnp.full(2, 3.))


def test_sites_inside_custom_vmap_are_reaped_and_planted():
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def f(x):
        return lh.sow(jnp.sin(x) * 2, tag="t", name="a") + 1

    @f.def_vmap
    def rule(axis_size, in_batched, x):
        return jnp.sin(x) * 2 + 100., True          # the user's rule: must stay

    close(lh.reap(f, tag="t")(1.)["a"], jnp.sin(1.) * 2)
    close(lh.plant(f, tag="t")({"a": 5.}, 1.), 6.)
    xs = jnp.arange(3.)
    out, _ = lh.call_and_reap(jax.vmap(f), tag="t")(xs)
    close(out, jnp.sin(xs) * 2 + 100.)


def test_sites_inside_sequential_vmap():
    from jax.custom_batching import sequential_vmap
    s = sequential_vmap(lambda x: lh.sow(x * 3, tag="t", name="s", mode="append"))
    close(lh.reap(jax.vmap(s), tag="t")(jnp.arange(3.))["s"], jnp.arange(3.) * 3)


def test_sites_inside_custom_vjp_with_optimize_remat():
    g = jax.custom_vjp(lambda x: lh.sow(jnp.sin(x) * 3, tag="t", name="b"))
    g.defvjp(lambda x: (lh.sow(jnp.sin(x) * 3, tag="t", name="b"), x),
             lambda r, ct: (ct * jnp.cos(r) * 3,), optimize_remat=True)
    out, d = lh.call_and_reap(jax.value_and_grad(g), tag="t")(1.)
    close(d["b"], jnp.sin(1.) * 3)
    close(out[1], jnp.cos(1.) * 3)


def cube(x):
    return lh.sow(x ** 3, tag="t", name="x3") + 1


def test_vmap_with_axis_name_collectives_while_recording():
    f = lambda x: lh.sow(x - jax.lax.pmean(x, "i"), tag="t", name="c")
    x = jnp.arange(4.)
    d = lh.reap(lh.vmap(f, axis_name="i"), tag="t")(x)
    close(d["c"], x - jnp.mean(x))


def test_jax_transform_around_a_recorded_one_is_a_clear_error():
    import pytest
    with pytest.raises(lh.HarvestError, match="lh.jvp, lh.grad, lh.vmap"):
        lh.reap(lambda x: jax.jvp(lh.grad(cube), (x,), (1.,)), tag="t")(2.)
    with pytest.raises(lh.HarvestError, match="jax.vmap"):
        lh.reap(jax.vmap(lh.grad(cube)), tag="t")(jnp.ones(2))
    # outside a harvest, or with recorded transforms all the way, it works
    close(jax.vmap(lh.grad(cube))(jnp.ones(2)), jnp.full(2, 3.))
    d = lh.reap(lh.vmap(lh.grad(cube)), tag="t")(jnp.ones(2))
    close(d["grad", "x3"], jnp.full(2, 3.))


# Rules that do not call the function: JAX's differentiation runs them instead
# of the primal function, whose sites a harvest still reaps.
@jax.custom_jvp
def jvp_rule_only(x):
    return jnp.sum(jnp.tanh(lh.sow(jnp.sin(x) * W, tag="t", name="h")))


jvp_rule_only.defjvp(lambda p, t: (jnp.sum(jnp.tanh(jnp.sin(p[0]) * W)), 5.0 * jnp.sum(t[0])))


@jax.custom_vjp
def vjp_rule_only(x):
    return jnp.sum(jnp.tanh(lh.sow(jnp.sin(x) * W, tag="t", name="h")))


vjp_rule_only.defvjp(lambda x: (jnp.sum(jnp.tanh(jnp.sin(x) * W)), x),
                     lambda x, g: (g * 7.0 * jnp.ones_like(x),))


@needs_custom_call_hooks
def test_site_in_custom_jvp_function_under_jax_jvp_inside_the_harvest():
    t = jnp.array([1.0, -0.5])
    (out, tan), d = lh.call_and_reap(lambda x: jax.jvp(jvp_rule_only, (x,), (t,)), tag="t")(X)
    close(tan, 5.0 * jnp.sum(t))                          # the user's rule
    close(d["h"], jnp.sin(X) * W)
    close(d["jvp", "h"], jax.jvp(lambda x: jnp.sin(x) * W, (X,), (t,))[1])


@needs_custom_call_hooks
def test_site_in_custom_jvp_function_under_jax_grad_inside_the_harvest():
    g, d = lh.call_and_reap(jax.grad(jvp_rule_only), tag="t")(X)
    close(g, jnp.full(2, 5.0))
    close(d["h"], jnp.sin(X) * W)
    # the rule says how the output depends on x; the site is a constant for
    # it, like a plant there (whose gradient is zero)
    close(d["vjp", "h"], jnp.zeros(2))
    planted = jax.grad(lambda p: lh.plant(jvp_rule_only, tag="t")({"h": p}, X))(jnp.sin(X) * W)
    close(planted, jnp.zeros(2))


@needs_custom_call_hooks
def test_site_in_custom_vjp_function_under_jax_grad_inside_the_harvest():
    g, d = lh.call_and_reap(jax.grad(vjp_rule_only), tag="t")(X)
    close(g, jnp.full(2, 7.0))
    close(d["h"], jnp.sin(X) * W)
    assert ("vjp", "h") not in d  # values only (docs/semantics.md)
    _, d = lh.call_and_reap(lambda x: jax.vjp(vjp_rule_only, x)[1](2.0), tag="t")(X)
    close(d["h"], jnp.sin(X) * W)


def test_custom_function_without_sites_is_traced_as_jax_does():
    # jax.nn.relu is a custom_jvp function: no copy of it under a harvest
    f = lambda x: jnp.sum(jax.nn.relu(lh.sow(x, tag="t", name="a")))
    jaxpr = jax.make_jaxpr(lambda x: lh.reap(jax.grad(f), tag="t")(x)["a"])(X)
    plain = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jax.nn.relu(x))))(X)
    assert str(jaxpr).count("max") <= str(plain).count("max") + 1


# Rules that sow: JAX runs them when it differentiates the harvested program,
# after the harvest returned (a jax.jvp / jax.grad around call_and_reap).
@jax.custom_jvp
def jvp_rule_sows(x):
    return jnp.sin(x) * W


@jvp_rule_sows.defjvp
def _jvp_rule_sows_jvp(p, t):
    (x,), (tx,) = p, t
    c = lh.sow(jnp.cos(x) * W, tag="t", name="c", mode="append")
    return jnp.sin(x) * W, c * tx


@jax.custom_vjp
def vjp_fwd_sows(x):
    return jnp.sin(x) * W


def _vjp_fwd_sows_fwd(x):
    return jnp.sin(x) * W, (x, lh.sow(jnp.cos(x) * W, tag="t", name="c", mode="append"))


vjp_fwd_sows.defvjp(_vjp_fwd_sows_fwd, lambda r, g: (r[1] * g,))

RULE_SOWS = {"custom_jvp": jvp_rule_sows, "custom_vjp": vjp_fwd_sows}


def _layers(fn):
    """Two layers, one under jit and one in a scan: the rule runs three times."""
    def f(x):
        x = jax.jit(fn)(x)
        x = jax.lax.scan(lambda c, _: (fn(c) + 0.5, None), x, None, length=2)[0]
        return jnp.sum(x)
    return f


def _rule_inputs(x):
    """What each call of the rule sees, computed with plain JAX."""
    ins = [x]
    for _ in range(2):
        ins.append(jnp.sin(ins[-1]) * W + (0.5 if len(ins) > 1 else 0.0))
    return jnp.stack(ins)


@needs_custom_call_hooks
@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_site_in_a_rule_jax_runs_after_the_harvest_is_reaped(kind):
    f = _layers(RULE_SOWS[kind])
    plain = _layers(lambda x: jnp.sin(x) * W)
    expected = jnp.cos(_rule_inputs(X)) * W

    def h(x):
        out, d = lh.call_and_reap(f, tag="t")(x)
        return out, d["c"]

    g, c = jax.grad(h, has_aux=True)(X)
    close(c, expected)
    close(g, jax.grad(plain)(X))                       # the user's rules: the true derivative
    close(jax.jit(jax.grad(h, has_aux=True))(X)[1], expected)
    out, vjp = jax.vjp(h, X)
    close(out[1], expected)
    close(vjp((1.0, jnp.zeros_like(expected)))[0], jax.grad(plain)(X))
    if kind == "custom_jvp":  # (JAX has no forward mode through a custom_vjp)
        t = jnp.array([1.0, -0.5])
        (_, c), (_, c_dot) = jax.jvp(h, (X,), (t,))
        close(c, expected)
        close(c_dot, jnp.zeros_like(expected))          # no tangent of its own
        close(jax.linearize(h, X)[0][1], expected)
    xs = jnp.stack([X, 2 * X])
    close(jax.vmap(lambda x: jax.grad(h, has_aux=True)(x)[1])(xs),
          jax.vmap(lambda x: jnp.cos(_rule_inputs(x)) * W)(xs))


@needs_custom_call_hooks
@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_site_in_a_rule_jax_does_not_run_is_zeros(kind):
    f = _layers(RULE_SOWS[kind])
    d = lh.reap(f, tag="t")(X)
    assert list(d.keys()) == ["c"]
    close(d["c"], jnp.zeros((3, 2)))


@needs_custom_call_hooks
def test_site_in_a_rule_jax_runs_after_the_harvest_is_consumed_by_it():
    f = _layers(jvp_rule_sows)

    def h(x):
        out, d = lh.call_and_reap(f, tag="t")(x)
        return out + 0.0 * jnp.sum(d["c"])

    outer = lh.reap(lambda x: jax.grad(h)(x), tag="t")(X)
    assert "c" not in outer
    close(jax.grad(h)(X), jax.grad(_layers(lambda x: jnp.sin(x) * W))(X))


@needs_custom_call_hooks
def test_rule_that_calls_its_function_adds_no_site():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(lh.sow(2 * x, tag="t", name="a", mode="clobber"))

    f.defjvp(lambda p, t: (f(p[0]), 2 * jnp.cos(2 * p[0]) * t[0]))
    h = lambda x: lh.call_and_reap(f, tag="t")(x)[1].compute()
    assert list(lh.reap(f, tag="t")(0.3).keys()) == ["a"]
    primal, _ = jax.jvp(h, (0.3,), (1.0,))
    close(primal, {"a": 0.6})
