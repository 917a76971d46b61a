"""Recomputation is not a new occurrence (SPEC 9).

A `custom_vjp` whose backward rule re-runs the forward body (checkpointing, as
in Equinox's checkpointed loops and diffrax's default adjoint) sows the body's
names again. Those values are not reaped again; the cotangents the rule's own
differentiation gives them go to the forward occurrences. Every expected value
is plain JAX: the loop written out, a zero `eps` added at each occurrence.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import (
    close,
    skip_where_jax_cannot_differentiate_diffrax,
    skip_where_jax_ignores_scan3_reverse,
)
from lazyharvest import _jax

# a rule's functions are replaced through the custom call's hook (docs/compat.md)
pytestmark = pytest.mark.skipif(
    not _jax.CUSTOM_CALL_HOOKS, reason="a custom call's functions are hookable on jax >= 0.9")

WS = jnp.array([0.5, 1.1, -0.8, 1.3])
C0 = 0.7


def _layer(w, c, mode):
    return lh.sow(jnp.sin(w * c), tag="t", name="h", mode=mode)


def checkpointed(mode, backward_loop):
    """A scan over layers that saves only the carries; the backward rule
    recomputes each layer under `jax.vjp`, walking back with a reverse scan
    or a while loop (which counts down, as Equinox's does)."""
    @jax.custom_vjp
    def run(ws, c0):
        return lax.scan(lambda c, w: (_layer(w, c, mode), None), c0, ws)[0]

    def fwd(ws, c0):
        last, cs = lax.scan(lambda c, w: (_layer(w, c, mode), c), c0, ws)
        return last, (ws, cs)

    def bwd(res, g):
        ws, cs = res
        if backward_loop == "scan":
            def step(gc, wc):
                _, vjp = jax.vjp(lambda w, c: _layer(w, c, mode), *wc)
                gw, gc = vjp(gc)
                return gc, gw
            gc, gws = lax.scan(step, g, (ws, cs), reverse=True)
            return gws, gc

        def body(s):
            i, gc, gws = s
            _, vjp = jax.vjp(lambda w, c: _layer(w, c, mode), ws[i], cs[i])
            gw, gc = vjp(gc)
            return i - 1, gc, gws.at[i].set(gw)
        _, gc, gws = lax.while_loop(lambda s: s[0] >= 0, body,
                                    (len(ws) - 1, g, jnp.zeros_like(ws)))
        return gws, gc
    run.defvjp(fwd, bwd)
    return lambda ws: jnp.sum(run(ws, C0) ** 2)


def _plain(ws, eps):
    c = C0
    for i in range(len(ws)):
        c = jnp.sin(ws[i] * c) + eps[i]
    return jnp.sum(c ** 2)


def _values(ws):
    c, out = C0, []
    for w in ws:
        c = jnp.sin(w * c)
        out.append(c)
    return jnp.stack(out)


def _cotangents(ws):
    return jax.grad(_plain, argnums=1)(ws, jnp.zeros(len(ws)))


@pytest.mark.parametrize("backward_loop", ["scan", "while"])
@pytest.mark.parametrize("mode", ["append", "clobber"])
def test_a_checkpointing_rule_adds_no_occurrence(mode, backward_loop):
    if mode == "append" and backward_loop == "while":
        pytest.skip("append sites are refused in a while loop")
    loss = checkpointed(mode, backward_loop)
    d = lh.reap(jax.grad(loss), tag="t")(WS)
    assert set(d.keys()) == {"h", ("vjp", "h")}  # no ("primal", "h") from the rule
    vals, cts = _values(WS), _cotangents(WS)
    if mode == "clobber":
        vals, cts = vals[-1], cts[-1]  # the last forward occurrence, and its cotangent
    close(d["h"], vals)
    close(d["vjp", "h"], cts)


@pytest.mark.parametrize("backward_loop", [  # (the rule's reverse scan)
    pytest.param("scan", marks=skip_where_jax_ignores_scan3_reverse()), "while"])
@pytest.mark.parametrize("mode", ["append", "clobber"])
def test_the_checkpointing_rule_gives_the_gradient_of_the_loop(mode, backward_loop):
    loss = checkpointed(mode, backward_loop)
    close(jax.grad(loss)(WS), jax.grad(_plain)(WS, jnp.zeros(4)))


def test_a_python_loop_of_steps_through_a_checkpointing_rule():
    # each step's forward occurrences begin its backward pass
    loss = checkpointed("append", "scan")

    def train(ws):
        for _ in range(2):
            ws = ws - 0.5 * jax.grad(loss)(ws)
        return ws
    d = lh.reap(train, tag="t")(WS)
    want, ws = [], WS
    for _ in range(2):
        want.append(_cotangents(ws))
        ws = ws - 0.5 * jax.grad(_plain)(ws, jnp.zeros(4))
    close(d["vjp", "h"], jnp.concatenate(want))


def test_a_name_only_the_backward_rule_sows_is_a_site():
    # the seed discussion's `sow_with_vjp`: the rule sows the cotangent
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), x

    def bwd(x, g):
        return (lh.sow(g, tag="t", name="g_in") * jnp.cos(x),)
    f.defvjp(fwd, bwd)
    d = lh.reap(jax.grad(lambda x: 3. * f(x)), tag="t")(0.4)
    close(d["g_in"], 3.)


def test_a_rule_inside_a_nest_scope_recomputes_under_the_scope():
    loss = checkpointed("clobber", "while")
    d = lh.reap(jax.grad(lh.nest(loss, scope="s")), tag="t")(WS)
    assert set(d.keys()) == {("s", "h"), ("vjp", "s", "h")}
    close(d["vjp", "s", "h"], _cotangents(WS)[-1])


def test_planting_a_recomputed_site_plants_its_recomputation():
    # jax.grad inside the plant: the rule's recomputation takes the planted
    # value, as the forward occurrences do, so the gradient is that of the
    # same program without the rule, planted alike (the values change, the
    # derivative of each site's own computation stays: section 9)
    plain = lambda ws: jnp.sum(lax.scan(
        lambda c, w: (_layer(w, c, "clobber"), None), C0, ws)[0] ** 2)
    plants = {"h": jnp.float32(0.25)}
    want = lh.plant(jax.grad(plain), tag="t")(plants, WS)
    close(lh.plant(jax.grad(checkpointed("clobber", "scan")), tag="t")(plants, WS), want)
    close(lh.plant(jax.grad(checkpointed("clobber", "while")), tag="t")(plants, WS), want)
    assert not jnp.allclose(want, jax.grad(plain)(WS))


def _eqx():
    return pytest.importorskip("equinox")


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_equinox_checkpointed_while_loop(checkpoints):
    eqx = _eqx()

    def loss(th, sow=True):
        def body(c):
            i, y = c
            y = jnp.sin(y * th)
            return i + 1, lh.sow(y, tag="t", name="h", mode="clobber") if sow else y
        return eqx.internal.while_loop(lambda c: c[0] < 5, body, (0, jnp.float32(0.9)),
                                       max_steps=8, kind="checkpointed",
                                       checkpoints=checkpoints)[1]

    def plain(th, e):
        y = jnp.float32(0.9)
        for i in range(5):
            y = jnp.sin(y * th) + e[i]
        return y * 3.
    th = jnp.float32(1.3)
    d = lh.reap(jax.grad(lambda t: 3. * loss(t)), tag="t")(th)
    assert set(d.keys()) == {"h", ("vjp", "h")}
    close(d["h"], loss(th, sow=False))
    close(d["vjp", "h"], jax.grad(plain, argnums=1)(th, jnp.zeros(5))[-1])


def test_equinox_checkpointed_scan_over_layers():
    eqx = _eqx()
    W = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 3)) * 0.5
    x0 = jnp.array([1., -0.5, 0.3])

    def loss(W, eps, sow):
        def body(c, xs):
            w, e = xs
            return sow(jnp.tanh(w @ c) + e), None
        out, _ = eqx.internal.scan(body, x0, (W, eps), kind="checkpointed",
                                   checkpoints="all")
        return jnp.sum(out ** 2)
    Z = jnp.zeros((4, 3))
    d = lh.reap(jax.grad(lambda W: loss(
        W, Z, lambda h: lh.sow(h, tag="t", name="h", mode="clobber"))), tag="t")(W)
    assert set(d.keys()) == {"h", ("vjp", "h")}
    c = x0
    for i in range(4):
        c = jnp.tanh(W[i] @ c)
    close(d["h"], c)
    close(d["vjp", "h"], jax.grad(lambda W, e: loss(W, e, lambda h: h), argnums=1)(W, Z)[-1])


def test_diffrax_default_adjoint_value_and_cotangent_are_the_last_forward_evaluation():
    diffrax = pytest.importorskip("diffrax")
    skip_where_jax_cannot_differentiate_diffrax()
    y0 = jnp.array([1., 2.])

    def solve(vf, th, solver):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vf), solver, 0., 1., 0.1, y0, args=th,
                                  stepsize_controller=diffrax.ConstantStepSize(),
                                  adjoint=diffrax.RecursiveCheckpointAdjoint())
        return jnp.sum(sol.ys)

    def vf(t, y, th):
        return lh.sow(-y * th, tag="ode", name="h", mode="clobber")
    def logged(t, y, th):  # plain JAX: every evaluation, in the order it runs
        v = -y * th
        jax.debug.callback(lambda v: log.append(np.asarray(v)), v, ordered=True)
        return v
    for solver in (diffrax.Tsit5(), diffrax.Euler()):
        d = lh.reap(jax.grad(lambda th: solve(vf, th, solver)), tag="ode")(0.7)
        assert set(d.keys()) == {"h", ("vjp", "h")}
        close(d["h"], lh.reap(lambda th: solve(vf, th, solver), tag="ode")(0.7)["h"])
        log: list = []
        jax.block_until_ready(solve(logged, 0.7, solver))
        jax.effects_barrier()
        close(d["h"], log[-1])  # the last forward evaluation (t = 1 for Tsit5)
    # Euler: the last evaluation is at t = 0.9, and feeds y(1)
    def perturbed(th, e):
        def vf(t, y, th):
            return -y * th + jnp.where(jnp.abs(t - 0.9) < 0.05, e, 0.)
        return solve(vf, th, diffrax.Euler())
    close(d["h"], -0.7 * y0 * (1 - 0.07) ** 9)
    close(d["vjp", "h"], jax.grad(perturbed, argnums=1)(0.7, jnp.zeros(2)))


X3 = jnp.array([0.5, 1.5, 2.5])


def _checkpointing_rule():
    """tanh(sow(sin(u))) whose backward rule re-runs it, site included."""
    def primal(u):
        return jnp.tanh(lh.sow(jnp.sin(u), tag="t", name="s"))
    g = jax.custom_vjp(primal)
    g.defvjp(lambda u: (primal(u), u), lambda u, ct: jax.vjp(primal, u)[1](ct))
    return g


def _loss_eps(x, e):  # plain JAX: the site perturbed by e
    return jnp.sum(jnp.tanh(jnp.sin(x) + e) * 2.)


def test_a_backward_function_built_before_the_harvest_reaps_the_cotangent_only():
    # (found by the generator's custom_vjp_recompute construct, law 7: the
    # rule's recomputed value was reaped as the site, its cotangent under an
    # extra "vjp" level)
    g = _checkpointing_rule()
    bwd = jax.vjp(lambda x: jnp.sum(g(x) * 2.), X3)[1]
    d = lh.reap(bwd, tag="t")(1.)
    assert set(d.keys()) == {"s"}
    close(d["s"], jax.grad(_loss_eps, argnums=1)(X3, jnp.zeros(3)))


@pytest.mark.parametrize("also_x", [False, True])
def test_regression_plant_gradient_through_a_recomputing_rule_is_the_sites_cotangent(also_x):
    # (construct custom_vjp_recompute, law 5 (b)) A plant reached the rule as
    # a constant: its gradient was zero, while the site's cotangent is the
    # one the rule's own differentiation gives the recomputed site.
    g = _checkpointing_rule()
    f = lambda x: jnp.sum(g(x) * 2.)  # noqa: E731
    p = jnp.sin(X3)
    planted = lambda p, x: lh.plant(f, tag="t")({"s": p}, x)  # noqa: E731
    if also_x:
        got, gx = jax.grad(planted, argnums=(0, 1))(p, X3)
        close(gx, jnp.zeros(3))  # the planted program no longer reads x
    else:
        got = jax.grad(planted)(p, X3)
    close(got, jax.grad(_loss_eps, argnums=1)(X3, jnp.zeros(3)))


def test_regression_a_plant_gradient_through_a_rule_leaves_the_rule_unplanted():
    # (construct custom_vjp_recompute, law 5) JAX caches a custom_vjp's
    # forward jaxpr on the call's eqn. Traced for a planted program, it
    # closed over the planted value; the next program made from the same
    # eqn read it ("No constant handler for type: DynamicJaxprTracer").
    g = _checkpointing_rule()
    f = lambda x: jnp.sum(g(x) * 2.)  # noqa: E731
    jax.vjp(lambda p, x: lh.plant(f, tag="t")({"s": p}, x), jnp.sin(X3), X3)[1](1.)

    def out_and_site(x):
        o, d = lh.call_and_reap(f, tag="t")(x)
        return o, d["s"]
    (o, s), vjp = jax.vjp(out_and_site, X3)
    ct = jnp.array([1.0, -2.0, 0.5])
    # plain JAX: d/dx of f plus <ct, sin(x)>
    want = jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.sin(x)) * 2.) + jnp.dot(ct, jnp.sin(x)))(X3)
    close(vjp((jnp.float32(1.), ct))[0], want)
    close(s, jnp.sin(X3))


def _scoped_rules():
    def prim(u, e=0.0):
        return jnp.tanh(lh.sow(jnp.sin(u) + e, tag="t", name="s0"))

    def d_prim(u):
        return (1 - jnp.tanh(jnp.sin(u)) ** 2) * jnp.cos(u)
    recomputing = jax.custom_vjp(prim)
    recomputing.defvjp(lambda u, e: (prim(u, e), (u, e)),
                       lambda r, ct: jax.vjp(prim, *r)[1](ct))
    cj = jax.custom_jvp(prim)
    cj.defjvp(lambda p, t: (prim(*p), d_prim(p[0]) * t[0]))
    return prim, recomputing, cj


@pytest.mark.parametrize("top", [False, True])
def test_regression_recomputing_rule_in_a_jit_keeps_its_nest_scope(top):
    # (a wide law-7 search) JAX traces the rules of a custom call staged in
    # a jit when it differentiates the jit, after the call's nest scopes have
    # ended: the forward rule's site lost its scope, and the backward rule's
    # recomputation then met a top-level site of the same name ("sown twice").
    prim, rule, _ = _scoped_rules()
    x = jnp.array([0.3, 0.5])

    def f(x, e=0.0, rule=rule):
        if top:
            x = lh.sow(x, tag="t", name="s0")
        return jnp.sum(jax.jit(lh.nest(lambda x: rule(x, e), scope="b"))(x))
    ct = 0.7
    d = lh.reap(lambda x: jax.vjp(f, x)[1](ct), tag="t")(x)
    want = {("b", "s0"), ("vjp", "b", "s0")} | ({"s0", ("vjp", "s0")} if top else set())
    assert set(d.keys()) == want
    close(d["b", "s0"], jnp.sin(x))
    # plain JAX: a zero perturbation at the site, the rule not involved
    close(d["vjp", "b", "s0"], ct * jax.grad(lambda e: f(x, e, rule=prim))(jnp.zeros(2)))
    g = lh.reap(jax.grad(f), tag="t")(x)
    assert set(g.keys()) == want


@pytest.mark.parametrize("which", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("mode", ["jvp", "grad"])
def test_regression_rule_site_in_a_jit_keeps_its_nest_scope_under_differentiation(which, mode):
    # The same for a site in a custom function's rule: it was reaped as "s0".
    _, _, cj = _scoped_rules()
    d_prim = jax.custom_vjp(lambda u: jnp.tanh(lh.sow(jnp.sin(u), tag="t", name="s0")))
    d_prim.defvjp(lambda u: (d_prim(u), u),
                  lambda u, ct: ((1 - jnp.tanh(jnp.sin(u)) ** 2) * jnp.cos(u) * ct,))
    rule = cj if which == "custom_jvp" else d_prim
    x = jnp.array([0.3, 0.5])

    def f(x):
        return jnp.sum(jax.jit(lh.nest(rule, scope="b"))(x))
    run = (lambda x: jax.jvp(f, (x,), (x,))) if mode == "jvp" else jax.grad(f)
    d = lh.reap(run, tag="t")(x)
    assert ("b", "s0") in d and "s0" not in d
    close(d["b", "s0"], jnp.sin(x))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("top", [False, True])
def test_regression_backward_function_of_a_scoped_rule_built_before_the_harvest(top, jit):
    # (a wide law-5 search) jax.vjp outside a harvest runs the backward rule
    # when its function is called, after the call's nest scope has ended: the
    # recomputing rule's site came out as "s0" (next to, or clashing with, a
    # top-level site of that name).
    prim, rule, _ = _scoped_rules()
    x = jnp.array([0.3, 0.5])

    def f(x, e=0.0, rule=rule):
        y = lh.sow(jnp.cos(x), tag="t", name="s0") if top else x
        g = lh.nest(lambda x: rule(x, e), scope="b")
        return jnp.sum((jax.jit(g) if jit else g)(x)) + jnp.sum(y)
    ct = 0.7
    d = lh.reap(jax.vjp(f, x)[1], tag="t")(ct)
    assert set(d.keys()) == ({("b", "s0"), "s0"} if top else {("b", "s0")})
    # plain JAX: a zero perturbation at the site, the rule not involved
    close(d["b", "s0"], ct * jax.grad(lambda e: f(x, e, rule=prim))(jnp.zeros(2)))
    if top:
        close(d["s0"], ct * jnp.ones(2))
