"""Dead and constant sites under JAX's own transformations (SPEC 9, "Dead and
constant sites survive every transformation"), and integer, boolean and
complex sites under recorded transforms (docs/semantics.md).

Expected values come from plain JAX only: tangents are `jax.jvp` of the
hand-written slice; cotangents are `jax.grad` with respect to a zero
perturbation argument added at the site.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from lazyharvest import _jax
from lazyharvest import testing as T

pytestmark = pytest.mark.skipif(
    not _jax.DERIVATIVE_SITES, reason="dead and constant sites need jax >= 0.9")

X = jnp.array([0.5, 1.5, 2.5])
TX = jnp.array([1.0, -2.0, 0.5])
C0 = jnp.array([2.0, -1.0, 3.0])


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def reaped(fn, *args):
    return lh.reap(fn, tag="t")(*args)


# --- dead sites: the output does not use them ------------------------------------

def g(x):  # the seed's example
    lh.sow(x ** 2, tag="t", name="y")
    return x + 1


def test_dead_site_survives_linearize_outside_reap():
    _, g_lin = jax.linearize(g, 3.)
    d = reaped(g_lin, 0.5)
    assert list(d.keys()) == ["y"]
    close(d["y"], jax.jvp(lambda x: x ** 2, (3.,), (0.5,))[1])  # 3.0
    assert float(d["y"]) == 3.0


def test_dead_site_survives_linearize_outside_reap_under_jit():
    _, lin = jax.linearize(jax.jit(g), 3.)
    close(reaped(lin, 0.5)["y"], 3.0)
    _, lin = jax.linearize(g, 3.)
    close(reaped(jax.jit(lin), 0.5)["y"], 3.0)


def test_dead_site_cotangent_is_zero_in_vjp_backward():
    _, bwd = jax.vjp(g, 3.)
    d = reaped(bwd, 1.)
    assert list(d.keys()) == ["y"]
    want = jax.grad(lambda e, x: x + 1 + 0. * e, argnums=0)(9., 3.)  # the site is unused
    close(d["y"], want)
    assert float(d["y"]) == 0.


def test_dead_site_cotangent_in_backward_of_jit():
    _, bwd = jax.vjp(jax.jit(g), 3.)
    assert float(reaped(bwd, 1.)["y"]) == 0.


def test_dead_site_tangent_under_jvp():
    h = jax.jit(lambda x: jax.jvp(g, (x,), (0.5,)))
    h(3.)  # traced (and cached) outside any harvest first
    d = reaped(h, 3.)
    close(d["y"], 9.)
    close(d["jvp", "y"], 3.)


def test_planting_into_backward_at_dead_site_adds_its_cotangent():
    # the transpose of reading a value is writing one: a cotangent planted at
    # the site flows back through x ** 2
    _, bwd = jax.vjp(g, 3.)
    got = lh.plant(bwd, tag="t")({"y": 2.}, 1.)[0]
    want = jax.grad(lambda x: x + 1 + 2. * x ** 2)(3.)
    close(got, want)


def dead_in_scan(x):
    def body(c, xi):
        lh.sow(jnp.sin(c * xi), tag="t", name="s", mode="append")
        return c + xi, None
    return lax.scan(body, x, TX)[0]


def dead_in_cond(x):
    def br(k):
        return lambda x: (lh.sow(k * x ** 2, tag="t", name="s"), x + k)[1]
    return lax.cond(x > 0, br(1.), br(2.), x)


def test_dead_site_in_scan_body_outside_reap():
    x, t = 0.3, 0.7
    d = reaped(jax.linearize(dead_in_scan, x)[1], t)

    def slice_s(x):
        cs = x + jnp.concatenate([jnp.zeros(1), jnp.cumsum(TX)[:-1]])
        return jnp.sin(cs * TX)
    close(d["s"], jax.jvp(slice_s, (x,), (t,))[1])
    d = reaped(jax.vjp(dead_in_scan, x)[1], 1.)
    close(d["s"], jnp.zeros(3))


def test_dead_site_in_cond_body_outside_reap():
    d = reaped(jax.linearize(dead_in_cond, 1.5)[1], 0.5)
    close(d["s"], jax.jvp(lambda x: x ** 2, (1.5,), (0.5,))[1])
    d = reaped(jax.vjp(dead_in_cond, 1.5)[1], 1.)
    close(d["s"], 0.)


def test_dead_site_in_jit_whose_outputs_are_unused():
    inner = jax.jit(lambda x: lh.sow(x ** 2, tag="t", name="y"))

    def h(x):
        inner(x)
        return x + 1
    close(reaped(jax.linearize(h, 3.)[1], 0.5)["y"], 3.)
    close(reaped(jax.vjp(h, 3.)[1], 1.)["y"], 0.)


def test_dead_scan_whose_outputs_are_unused_outside_reap():
    def h(x):
        lax.scan(lambda c, xi: (c * xi, lh.sow(jnp.cos(c), tag="t", name="s", mode="append")),
                 x, TX)
        return x + 1
    d = reaped(jax.linearize(h, 0.3)[1], 1.)
    cs = 0.3 * jnp.concatenate([jnp.ones(1), jnp.cumprod(TX)[:-1]])
    close(d["s"], jax.jvp(lambda x: jnp.cos(x * cs / 0.3), (0.3,), (1.,))[1])
    close(reaped(jax.vjp(h, 0.3)[1], 1.)["s"], jnp.zeros(3))


def test_dead_site_in_checkpoint_outside_reap():
    h = jax.checkpoint(g)
    close(reaped(jax.linearize(h, 3.)[1], 0.5)["y"], 3.)
    close(reaped(jax.vjp(h, 3.)[1], 1.)["y"], 0.)


@pytest.mark.parametrize("in_cond", [False, True])
def test_checkpoint_whose_outputs_are_unused_outside_reap(in_cond):
    # the whole checkpoint is dead code: its linear part is kept for its site,
    # and its transpose runs it (a zero cotangent), also from a cond inside
    def block(v):
        site = lambda u: lh.sow(u * 2., tag="t", name="s")  # noqa: E731
        return jnp.cos(lax.cond(v[0] > 0, site, site, v) if in_cond else site(v))

    def h(x):
        jax.checkpoint(block)(x)
        return jnp.sum(jnp.cos(x))
    close(reaped(jax.linearize(h, X)[1], TX)["s"], jax.jvp(lambda x: x * 2., (X,), (TX,))[1])
    bwd = reaped(jax.vjp(h, X)[1], 1.)
    assert set(bwd.keys()) == {"s"}
    close(bwd["s"], jnp.zeros(3))
    close(jax.vjp(h, X)[1](1.)[0], -jnp.sin(X))  # outside a harvest: as before


def test_dead_cond_in_a_live_checkpoint_outside_reap():
    # the checkpoint's output is used, the cond holding the site is not
    def block(v):
        site = lambda u: lh.sow(jnp.cos(u), tag="t", name="s")  # noqa: E731
        lax.cond(v[0] > 0, site, site, v)
        return jnp.sin(v)

    def h(x):
        return jnp.sum(jax.checkpoint(block)(x))
    close(reaped(jax.linearize(h, X)[1], TX)["s"], jax.jvp(jnp.cos, (X,), (TX,))[1])
    bwd = reaped(jax.vjp(h, X)[1], 1.)
    assert set(bwd.keys()) == {"s"}
    close(bwd["s"], jnp.zeros(3))
    close(jax.vjp(h, X)[1](1.)[0], jnp.cos(X))


@pytest.mark.parametrize("inner", ["checkpoint", "jit", None])
def test_regression_dead_scan_of_a_checkpointed_body_in_a_live_checkpoint(inner):
    # (the law-7 property test) a dead scan whose body is a checkpoint, in a
    # checkpoint whose output is used: the transpose of the outer checkpoint
    # partially evaluates its linear part, where the scan's staged half has
    # no output; it was dropped, and the backward function built outside the
    # harvest had no key for the site
    wrap = {"checkpoint": jax.checkpoint, "jit": jax.jit, None: lambda f: f}[inner]

    def block(v, a):
        def body(c, xi):
            t = lh.sow(jnp.cos(xi), tag="t", name="s", mode="append")
            return 0.5 * c + jnp.tanh(t), t
        lax.scan(wrap(body), v, a)  # dead
        return jnp.cos(v + v)

    def h(x, a):
        return jnp.sum(jnp.cos(jax.checkpoint(block)(x, a)))
    a = jnp.array([1.8, 1.5, -0.8])
    bwd = reaped(jax.vjp(h, 0.76, a)[1], 1.)
    assert set(bwd.keys()) == {"s"}
    close(bwd["s"], jnp.zeros(3))  # one zero cotangent per row
    lin = reaped(jax.linearize(h, 0.76, a)[1], 1., TX)
    close(lin["s"], jax.jvp(jnp.cos, (a,), (TX,))[1])
    want = jax.grad(lambda x: jnp.sum(jnp.cos(jnp.cos(x + x))))(0.76)
    close(jax.grad(h)(0.76, a), want)  # outside a harvest: as before


# --- constant sites: no dependence on the differentiated inputs -----------------

def ppo(x, e=None):
    """A loss with a constant site `c` and a stop-gradient site `adv` (PPO's
    advantages); with `e`, the same loss with perturbations added at the sites
    (the plain-JAX definition of their cotangents)."""
    e = e or {}
    def sow(v, name):
        return v + e.get(name, 0.) if e else lh.sow(v, tag="t", name=name)
    c = sow(C0, "c")
    adv = sow(lax.stop_gradient(jnp.tanh(x) * 3.), "adv")
    y = sow(jnp.sin(x), "y")
    return jnp.sum(c * y * adv)


def cotangents(f_e, x, names, ct=1.):
    eps = {n: jnp.zeros(3) for n in names}
    return jax.vjp(lambda e: f_e(x, e), eps)[1](ct)[0]


def test_constant_site_has_zero_tangent_under_jvp():
    d = reaped(lambda x: jax.jvp(ppo, (x,), (TX,)), X)
    close(d["jvp", "c"], jax.jvp(lambda x: C0, (X,), (TX,))[1])
    close(d["jvp", "adv"], jax.jvp(lambda x: lax.stop_gradient(jnp.tanh(x) * 3.), (X,), (TX,))[1])
    close(d["jvp", "y"], jax.jvp(jnp.sin, (X,), (TX,))[1])
    assert not np.any(np.asarray(d["jvp", "c"]))


def test_constant_site_has_zero_tangent_in_linear_function():
    _, lin = jax.linearize(ppo, X)
    d = reaped(lin, TX)
    assert set(d.keys()) == {"c", "adv", "y"}
    close(d["c"], jnp.zeros(3))
    close(d["adv"], jnp.zeros(3))
    close(d["y"], jax.jvp(jnp.sin, (X,), (TX,))[1])


def test_stop_gradient_site_cotangent_under_grad():
    d = reaped(jax.grad(ppo), X)
    want = cotangents(ppo, X, ["c", "adv", "y"])
    for name in ("c", "adv", "y"):
        close(d["vjp", name], want[name])
    assert np.all(np.asarray(d["vjp", "adv"]) != 0)  # d loss / d adv is not zero
    close(d["adv"], jnp.tanh(X) * 3.)


def test_constant_site_cotangent_in_vjp_backward():
    _, bwd = jax.vjp(ppo, X)
    d = reaped(bwd, 2.)
    want = cotangents(ppo, X, ["c", "adv", "y"], ct=2.)
    assert set(d.keys()) == {"c", "adv", "y"}
    for name in ("c", "adv", "y"):
        close(d[name], want[name])


def test_constant_site_cotangents_under_jit():
    want = cotangents(ppo, X, ["c", "adv"])
    for fn in (jax.jit(jax.grad(ppo)), jax.grad(jax.jit(ppo))):
        d = reaped(fn, X)
        close(d["vjp", "c"], want["c"])
        close(d["vjp", "adv"], want["adv"])


def test_constant_site_keys_are_those_of_any_site():
    # keys() is the same set whichever sites depend on the inputs
    def dep(x):  # the same program, `c` made to depend on x (numerically unchanged)
        c = lh.sow(C0 + 0. * jnp.sum(jnp.sin(x)), tag="t", name="c")
        return jnp.sum(c * lh.sow(jnp.sin(x), tag="t", name="y"))

    def const(x):
        c = lh.sow(C0, tag="t", name="c")
        return jnp.sum(c * lh.sow(jnp.sin(x), tag="t", name="y"))
    shapes = {
        "jvp": lambda f: reaped(lambda x: jax.jvp(f, (x,), (TX,)), X),
        "grad": lambda f: reaped(jax.grad(f), X),
        "linearize": lambda f: reaped(jax.linearize(f, X)[1], TX),
        "vjp": lambda f: reaped(jax.vjp(f, X)[1], 1.),
        "linearize inside": lambda f: reaped(lambda x: jax.linearize(f, x)[1](TX), X),
    }
    for name, shape in shapes.items():
        a, b = shape(dep), shape(const)
        assert set(a.keys()) == set(b.keys()), name
        for k in a.keys():
            close(b[k], a[k])


def test_planting_into_backward_at_constant_site_changes_nothing_upstream():
    # c does not depend on x: a cotangent added there reaches no input (law 5a)
    _, bwd = jax.vjp(ppo, X)
    close(lh.plant(bwd, tag="t")({"c": jnp.ones(3)}, 1.)[0], bwd(1.)[0])


def test_constant_sites_in_scan_and_cond_bodies():
    def in_scan(x, e=None):
        def body(carry, _):
            c = C0 + e["c"] if e else lh.sow(C0, tag="t", name="c", mode="clobber")
            return carry + 0.1 * c * jnp.sin(carry), None
        return jnp.sum(lax.scan(body, x, None, length=3)[0])

    def last_only(x, e):  # the clobber site's cotangent: the occurrence reaped (the last)
        def body(carry, i):
            c = C0 + jnp.where(i == 2, 1., 0.) * e["c"]
            return carry + 0.1 * c * jnp.sin(carry), None
        return jnp.sum(lax.scan(body, x, jnp.arange(3))[0])

    def in_cond(x, e=None):
        def br(k):
            def f(x):
                c = C0 + e["c"] if e else lh.sow(C0, tag="t", name="c")
                return jnp.sum(c * jnp.sin(x)) * k
            return f
        return lax.cond(jnp.sum(x) > 0, br(1.), br(2.), x)

    for f, f_e in ((in_scan, last_only), (in_cond, in_cond)):
        want = cotangents(f_e, X, ["c"])["c"]
        close(reaped(jax.grad(f), X)["vjp", "c"], want)
        close(reaped(jax.vjp(f, X)[1], 1.)["c"], want)
        close(reaped(lambda x: jax.jvp(f, (x,), (TX,)), X)["jvp", "c"], jnp.zeros(3))
        close(reaped(jax.linearize(f, X)[1], TX)["c"], jnp.zeros(3))


def test_constant_bodies_of_jit_scan_and_cond_keep_their_sites():
    # JAX skips a jit/scan/cond none of whose inputs has a tangent as a whole.
    # Each program takes `e`: the perturbation added at its site `k`.
    def in_jit(x, e=None):
        k = jax.jit(lambda c: c * 2. + e if e is not None
                    else lh.sow(c * 2., tag="t", name="k"))(C0)
        return jnp.sum(k * jnp.sin(x))

    def in_cond(x, e=None):
        def br(s):
            return lambda c: s * c + e if e is not None else lh.sow(s * c, tag="t", name="k")
        return jnp.sum(lax.cond(C0[0] > 0, br(2.), br(-1.), C0) * x)

    def in_scan(x, e=None):  # one perturbation per occurrence
        def step(carry, inp):
            ci, ei = inp
            v = carry * ci
            return carry, (v + ei if e is not None
                           else lh.sow(v, tag="t", name="k", mode="append"))
        return jnp.sum(lax.scan(step, 2., (C0, jnp.zeros(3) if e is None else e))[1] * x)

    for f in (in_jit, in_cond, in_scan):
        want = jax.grad(lambda e, f=f: f(X, e))(jnp.zeros(3))
        close(reaped(jax.grad(f), X)["vjp", "k"], want)
        close(reaped(jax.vjp(f, X)[1], 1.)["k"], want)
        close(reaped(lambda x, f=f: jax.jvp(f, (x,), (TX,)), X)["jvp", "k"], jnp.zeros(3))
        close(reaped(jax.linearize(f, X)[1], TX)["k"], jnp.zeros(3))


@pytest.mark.parametrize("trips", [0, 2])
@pytest.mark.parametrize("wrap", [lambda g: g, jax.jit], ids=["eager", "jit"])
def test_constant_while_loop_sites(trips, wrap):
    # Forward mode gives the zero tangent (a loop none of whose inputs has a
    # tangent was skipped by JAX as a whole: no ("jvp", "k"), also for a loop
    # that never runs). Reverse mode cannot: JAX cannot transpose a while
    # loop (docs/semantics.md 2a).
    def f(x):
        k = wrap(lambda c: lax.while_loop(lambda s: s[0] < trips, lambda s: (
            s[0] + 1, lh.sow(s[1] * 2., tag="t", name="k", mode="clobber")), (0, c))[1])(C0)
        return jnp.sum(k * x)
    d = reaped(lambda x: jax.jvp(f, (x,), (TX,)), X)
    close(d["jvp", "k"], jnp.zeros(3))
    close(d["k"], C0 * 2. ** trips if trips else jnp.zeros(3))
    assert set(reaped(jax.grad(f), X).keys()) == {"k"}
    T.check_jvp(f, X, tag="t", strict_keys=True)


def test_constant_sites_pass_the_laws_with_strict_keys():
    for f in (lambda x: ppo(x), lambda x: jax.jit(ppo)(x)):
        T.check_jvp(f, X, tag="t", strict_keys=True)
        T.check_linearize(f, X, tag="t", strict_keys=True)
        T.check_vjp(f, X, tag="t", strict_keys=True)


def test_compile_time_eval_site_is_reaped_and_planted():
    def h(x):
        with jax.ensure_compile_time_eval():
            k = lh.sow(jnp.arange(3.) * 2., tag="t", name="k")
        return jnp.sum(k * x)
    d = reaped(h, X)
    close(d["k"], jnp.arange(3.) * 2.)
    close(lh.plant(h, tag="t")({"k": jnp.ones(3)}, X), jnp.sum(X))
    d = reaped(jax.grad(h), X)  # a constant site: its cotangent is d out / d k
    close(d["vjp", "k"], X)
    close(reaped(jax.linearize(h, X)[1], TX)["k"], jnp.zeros(3))
    assert float(h(X)) == float(jnp.sum(jnp.arange(3.) * 2. * X))  # outside a harvest: as before


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.everything_saveable,
                                    jax.checkpoint_policies.dots_saveable])
def test_constant_site_in_checkpoint_under_reverse_mode(policy):
    # jax.checkpoint differentiates its body with jvp, then splits it: the
    # constant sites' zeros are staged in the linear part, so their cotangents
    # arrive as outside jax.checkpoint (d out / d site), and jax.linearize's
    # and jax.vjp's functions hold every site.
    h = jax.checkpoint(ppo, policy=policy)
    d = reaped(jax.grad(h), X)
    assert set(d.keys()) == {"c", "adv", "y", ("vjp", "c"), ("vjp", "adv"), ("vjp", "y")}
    want = cotangents(ppo, X, ["c", "adv", "y"])
    for name in ("c", "adv", "y"):
        close(d["vjp", name], want[name])
    close(jax.grad(h)(X), jax.grad(ppo)(X))  # outside a harvest: as before
    bwd = reaped(jax.vjp(h, X)[1], 2.)
    assert set(bwd.keys()) == {"c", "adv", "y"}
    for name, ct in cotangents(ppo, X, ["c", "adv", "y"], ct=2.).items():
        close(bwd[name], ct)
    lin = reaped(jax.linearize(h, X)[1], TX)
    assert set(lin.keys()) == {"c", "adv", "y"}
    close(lin["c"], jnp.zeros(3))
    close(lin["adv"], jnp.zeros(3))
    close(lin["y"], jnp.cos(X) * TX)
    d = reaped(lambda x: jax.jvp(h, (x,), (TX,)), X)
    close(d["jvp", "c"], jnp.zeros(3))
    T.check_linearize(h, X, tag="t", strict_keys=True)
    T.check_vjp(h, X, tag="t", strict_keys=True)


def test_constant_site_in_jitted_checkpoint_in_a_scan():
    # the checkpoint's split happens inside the scan's and the jit's own
    # rules; a clobber site's cotangent is its last occurrence's
    def loss(x, e=None):
        def body(carry, i):
            def block(v):
                c = C0 * (i + 1.)  # depends on the iteration, not on x
                c = c + e * (i == 1.) if e is not None else lh.sow(
                    c, tag="t", name="c", mode="clobber")
                return jnp.sum(c * jnp.sin(v))
            return carry + jax.jit(jax.checkpoint(block))(x), None
        return lax.scan(body, 0., jnp.arange(2.))[0]
    d = reaped(jax.grad(loss), X)
    close(d["c"], C0 * 2.)
    close(d["vjp", "c"], jax.grad(lambda e: loss(X, e))(jnp.zeros(3)))
    close(d["vjp", "c"], jnp.sin(X))


def test_reverse_over_reverse_spells_out_the_levels():
    # The inner cotangent of `y` (c * adv) does not depend on x: at the outer
    # level it is a constant site with its own cotangent, so ('vjp', 'y')
    # would name two sites and both spell out their levels (docs/semantics.md).
    f = lambda x: jnp.sum(jax.grad(ppo)(x))  # noqa: E731
    d = reaped(jax.grad(f), X)
    keys = set(d.keys())
    assert {("vjp", "primal", "y"), ("primal", "vjp", "y"), ("vjp", "vjp", "y")} <= keys
    assert ("vjp", "y") not in keys
    close(d["vjp", "primal", "y"], reaped(jax.grad(ppo), X)["vjp", "y"])  # the inner cotangent


def test_eager_shard_map_of_grad_with_constant_site():
    mesh = jax.make_mesh((1,), ("i",))
    spec = jax.sharding.PartitionSpec()
    g_ = jax.shard_map(jax.grad(ppo), mesh=mesh, in_specs=spec, out_specs=spec)
    close(g_(X), jax.grad(ppo)(X))
    close(reaped(g_, X)["vjp", "c"], cotangents(ppo, X, ["c"])["c"])


def test_gradient_outside_a_harvest_binds_no_cotangent_site():
    # outside a harvest the backward pass records nothing: no work on sites
    eqns = jax.make_jaxpr(jax.grad(ppo))(X).jaxpr.eqns
    paths = [e.params["path"] for e in eqns if e.primitive.name == "sow"]
    assert paths and all(p == ("primal",) for p in paths)
    assert not [e for e in eqns if e.primitive.name in ("new_ref", "freeze")]


# --- integer, boolean and complex sites -------------------------------------------

def kinds(x):
    i = lh.sow(jnp.argmax(x), tag="t", name="i")
    b = lh.sow(x > 1., tag="t", name="b")
    z = lh.sow(x.astype(jnp.complex64) * (1 + 2j), tag="t", name="z")
    m = lh.sow({"f": x * 2., "n": jnp.argmin(x)}, tag="t", name="m")
    return jnp.sum(x ** 2) + i + jnp.sum(jnp.real(z * z)) + jnp.sum(m["f"]) + jnp.sum(b)


def _avals(tree):
    return jax.tree_util.tree_map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)


@pytest.mark.parametrize("transform", ["grad", "jacfwd", "jacrev", "hessian", "jvp",
                                       "jax.grad", "jax.jvp"])
def test_integer_sites_advertise_no_uncomputable_leaves(transform):
    fns = {
        "grad": lh.grad(kinds), "jacfwd": lh.jacfwd(kinds), "jacrev": lh.jacrev(kinds),
        "hessian": lh.hessian(kinds),
        "jvp": lambda x: lh.jvp(kinds, (x,), (TX,)),
        "jax.grad": jax.grad(kinds), "jax.jvp": lambda x: jax.jvp(kinds, (x,), (TX,)),
    }
    d = reaped(fns[transform], X)
    derivative = {k for k in d.keys() if isinstance(k, tuple)}
    assert {k[-1] for k in derivative} == {"z", "m"}  # never the integer or boolean sites
    avals = d.avals
    for k in d.keys():  # every advertised leaf is computed, with its advertised aval
        assert _avals(d[k]) == _avals(avals[k]), k
    mixed = d[next(k for k in derivative if k[-1] == "m")]
    assert mixed["n"].dtype == jax.dtypes.float0  # as JAX gives integer values
    assert jnp.issubdtype(mixed["f"].dtype, jnp.floating)


def test_complex_site_grad_leaf():
    d = reaped(lh.grad(kinds), X)
    want = jax.jacfwd(lambda x: x.astype(jnp.complex64) * (1 + 2j))(X)
    close(d["grad", "z"], want)
    assert d.avals["grad", "z"].dtype == jnp.complex64
    # a complex site of complex inputs has a Jacobian only for holomorphic=True
    f = lambda w: jnp.real(jnp.sum(lh.sow(w * w, tag="t", name="w2")))  # noqa: E731
    w = X.astype(jnp.complex64)
    assert ("grad", "w2") not in reaped(lh.grad(f), w)
    hf = lambda w: jnp.sum(lh.sow(w * w, tag="t", name="w2"))  # noqa: E731
    d = reaped(lh.grad(hf, holomorphic=True), w)
    close(d["grad", "w2"], jax.jacrev(lambda w: w * w, holomorphic=True)(w))


# --- regressions ---------------------------------------------------------------------

def test_regression_constant_clobber_site_in_scan_under_reverse_over_reverse():
    # The outer cotangent was that of a perturbation at every occurrence, not
    # only the last: the loop-invariant site was hoisted out of the scan.
    def f(x, e=None):
        def body(carry, i):
            c = (C0 + jnp.where(i == 2, 1., 0.) * e if e is not None
                 else lh.sow(C0, tag="t", name="c", mode="clobber"))
            return carry + 0.1 * c * jnp.sin(carry), None
        return jnp.sum(lax.scan(body, x, jnp.arange(3))[0])

    def outer(x, e=None):
        return jnp.sum(jax.grad(f)(x, e))
    want = jax.grad(lambda e: outer(X, e))(jnp.zeros(3))
    close(reaped(jax.grad(outer), X)["primal", "vjp", "c"], want)


def test_regression_constant_site_in_a_jit_whose_outputs_ignore_its_inputs():
    # jax.jit(lambda x: sow(c))(x) under reverse mode: DCE left the jit of the
    # linear function with no input, so the backward pass evaluated it forward:
    # a zero ("jvp", name) key instead of ("vjp", name), and zeros in the
    # backward function of jax.vjp.
    def f(x, e=0.):
        c = jax.jit(lambda x: lh.sow(C0 * 1., tag="t", name="c"))(x)
        return jnp.sum((c + e) * jnp.sin(x))
    want = jax.grad(lambda e: f(X, e))(jnp.zeros(3))  # d out / d site
    d = reaped(jax.grad(f), X)
    assert ("jvp", "c") not in d
    close(d["vjp", "c"], want)
    _, bwd = jax.vjp(f, X)
    close(reaped(bwd, 1.)["c"], want)


def _cond_site_in_jit(custom):
    """``jax.jit(lambda p, b: ...)(p, X)``: the differentiated input ``p`` is
    dead; a constant site in a cond feeds the output (through a custom_vjp
    function with ``custom``)."""
    g = jax.custom_vjp(jnp.tanh)
    g.defvjp(lambda u: (jnp.tanh(u), u), lambda u, ct: ((1 - jnp.tanh(u) ** 2) * ct,))
    squash = g if custom else jnp.tanh

    def body(b, e):
        v = lax.cond(jnp.sum(b) > 0, lambda o: lh.sow(jnp.cos(o), tag="t", name="s"),
                     lambda o: lh.sow(jnp.sin(o), tag="t", name="s"), b)
        return jnp.sum(squash(v + e))
    return lambda p: jax.jit(lambda p, b: body(b, 0.))(p, X), body


@pytest.mark.parametrize("custom", [False, True], ids=["plain", "custom_vjp"])
def test_regression_constant_site_in_a_jit_whose_differentiated_input_is_dead(custom):
    # The jit of the linear function kept its residuals but lost its only
    # linear input, so the backward pass evaluated it forward: a zero
    # ("jvp", "s") key instead of ("vjp", "s") — and a custom_vjp function
    # inside crashed ("can't apply forward-mode autodiff"), even outside a
    # harvest.
    f, body = _cond_site_in_jit(custom)
    want = jax.grad(lambda e: body(X, e))(jnp.zeros(3))  # d out / d site
    close(jax.grad(f)(X), jnp.zeros(3))
    d = reaped(jax.grad(f), X)
    assert ("jvp", "s") not in d
    close(d["vjp", "s"], want)
    _, bwd = jax.vjp(f, X)
    close(reaped(bwd, 1.)["s"], want)


def test_regression_scan_kept_for_its_sites_with_unused_stacked_outputs_under_vjp():
    # The scan's stacked outputs feed only a jit that holds a constant site:
    # the scan is kept for its tangent sites, its stacked outputs get a
    # symbolic-zero cotangent, and JAX's scan transpose crashed on it
    # ("Expected cotangent type float32[] but got float32[3]") — plain
    # jax.vjp, no harvest needed.
    a, b = jnp.array([0.3, 0.7, 0.1]), jnp.array(0.2)

    def f(a, b, e=0.):
        def body(c, xi):
            v = lh.sow(jnp.cos(xi), tag="t", name="s0", mode="append")
            return 0.5 * c + jnp.tanh(v), v
        carry, ys = lax.scan(body, b, a)
        k = jax.jit(lambda a, b, c, ys: lh.sow(lax.stop_gradient(ys), tag="t", name="s1"))(
            a, b, carry, ys)
        return 0.5 * jnp.sum(k + e)
    _, bwd = jax.vjp(f, a, b)
    ga, gb = bwd(1.)
    close(ga, jnp.zeros(3))
    close(gb, 0.)
    d = reaped(bwd, 1.)
    close(d["s1"], jax.grad(lambda e: f(a, b, e))(jnp.zeros(3)))  # d out / d site
    close(d["s0"], jnp.zeros(3))


def test_regression_constant_site_in_a_scan_whose_outputs_are_unused():
    # Under reverse mode DCE left the scan of the linear function with no
    # input, so the backward pass evaluated it forward: a zero ("jvp", name)
    # key instead of ("vjp", name). `e`: one perturbation per iteration, of a
    # value nothing uses.
    def f(x, e=None):
        def body(c, ei):
            k = lh.sow(C0 * 1., tag="t", name="k", mode="append")
            return c, (k if e is None else k + ei)
        lax.scan(body, x, jnp.zeros((4, 3)) if e is None else e)
        return jnp.sum(jnp.sin(x))
    want = jax.grad(lambda e: f(X, e))(jnp.zeros((4, 3)))  # zeros
    d = reaped(jax.grad(f), X)
    assert set(d) == {"k", ("vjp", "k")}
    close(d["vjp", "k"], want)
    _, bwd = jax.vjp(f, X)
    close(reaped(bwd, 1.)["k"], want)


def _scaled_constant_site(wrap):
    """`f(x, e)` whose jit, scan or cond body squares a constant site `k` (plus
    `e`): its linear body reads a residual, not the tangent of `x`."""
    def site(e):
        return lh.sow(C0 * 1., tag="t", name="k", mode="append") + e

    def f(x, e=None):
        e = jnp.zeros((1, 3)) if e is None else e
        if wrap == "jit":
            y = jax.jit(lambda x, e: (jnp.sum(jnp.square(site(e[0]))), x))(x, e)[0]
        elif wrap == "scan":
            y = jnp.sum(lax.scan(lambda c, ei: (c, jnp.sum(jnp.square(site(ei)))), x, e)[1])
        else:
            y = lax.cond(jnp.sum(x) > 0, lambda x, e: jnp.sum(jnp.square(site(e[0]))),
                         lambda x, e: -jnp.sum(jnp.square(site(e[0]))), x, e)
        return y + jnp.sum(jnp.sin(x))
    return f


@pytest.mark.parametrize("wrap", ["jit", "scan", "cond"])
def test_regression_constant_site_scaled_by_a_residual_in_a_body(wrap):
    # The body's only linear value was the site's zero tangent (times a
    # residual): DCE kept the residual, dropped the tangent input, and the
    # backward pass evaluated the body forward: ("jvp", "k") instead of
    # ("vjp", "k") = d out / d site.
    f = _scaled_constant_site(wrap)
    want = jax.grad(lambda e: f(X, e))(jnp.zeros((1, 3)))
    d = reaped(jax.grad(f), X)
    assert set(d) == {"k", ("vjp", "k")}
    close(d["vjp", "k"], want)
    _, bwd = jax.vjp(f, X)
    close(reaped(bwd, 1.)["k"], want)


def _sown_then_dead_while(x, sow=True):
    """Sows `x` under "k", then runs one trip of a loop sowing sin(v) under
    "k" whose result it drops (`sow=False`: the same without sites)."""
    s = (lambda v: lh.sow(v, tag="t", name="k", mode="clobber")) if sow else (lambda v: v)
    s(x)
    lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, s(jnp.sin(c[1]))), (0, x))
    return jnp.cos(x)


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["plain", "jit"])
def test_regression_dead_while_loop_sown_before_keeps_its_sites_under_linearize(wrap):
    # JAX dropped the loop from the linear function: the occurrence before it
    # stood in for the loop's own (value x, tangent t).
    x, t = 0.7, 1.5
    value, tangent = jax.jvp(jnp.sin, (x,), (t,))  # plain JAX: the loop's k is sin(x)
    out, lin = jax.linearize(wrap(_sown_then_dead_while), x)
    d = reaped(lin, t)
    close(d["k"], value)
    close(d["jvp", "k"], tangent)
    close(lin(t), jax.jvp(lambda v: _sown_then_dead_while(v, sow=False), (x,), (t,))[1])
    # jax.vjp still drops the loop (it cannot be transposed); k is dead there
    bwd = jax.vjp(_sown_then_dead_while, x)[1]
    close(bwd(1.0)[0], jax.grad(jnp.cos)(x))
    close(reaped(bwd, 1.0)["k"], 0.0)


@pytest.mark.parametrize("nest", [1, 2, 3])
def test_regression_checkpoint_whose_body_reads_no_differentiated_input(nest):
    # (issue: "fix it rather than narrow it") The split of such a checkpoint
    # has no linear input: its backward half was evaluated forward, so the
    # site had no key in the backward function (one checkpoint), or a zero
    # one and, under jax.vjp in a harvest, a ("jvp", k) key (nested ones).
    def f(x, e=0.0):
        g = lambda x: lh.sow(jnp.float32(1.3) + e, tag="t", name="k")  # noqa: E731
        for _ in range(nest):
            g = jax.checkpoint(g)
        return 0.5 * g(x)
    ct = jnp.float32(0.7)
    want = jax.grad(lambda e: f(X, e))(0.0) * ct  # plain JAX: a zero perturbation
    got = reaped(jax.vjp(f, X)[1], ct)
    assert set(got.keys()) == {"k"}
    np.testing.assert_allclose(got["k"], want, rtol=1e-6)
    under = reaped(lambda x: jax.vjp(f, x)[1](ct), X)
    assert set(under.keys()) == {"k", ("vjp", "k")}
    np.testing.assert_allclose(under["vjp", "k"], want, rtol=1e-6)
    T.check_vjp(f, X, tag="t")
    T.check_linearize(f, X, tag="t")


def test_regression_checkpoint_reading_its_input_through_stop_gradient():
    # (a wide law-5 search) The body reads its input, but only through
    # stop_gradient: the split's linear part read no linear input, so the
    # backward pass evaluated it forward: a zero cotangent (and, under
    # jax.grad in a harvest, a ("jvp", k) key), later no key at all.
    def f(x, e=0.0):
        body = lambda v: lh.sow(lax.stop_gradient(v) + e, tag="t", name="k")  # noqa: E731
        return jnp.sum(jax.checkpoint(body)(jnp.cos(x)) ** 2)
    want = jax.grad(lambda e: f(X, e))(jnp.zeros_like(X))
    got = reaped(jax.grad(f), X)
    assert set(got.keys()) == {"k", ("vjp", "k")}
    np.testing.assert_allclose(got["vjp", "k"], want, rtol=1e-6)
    np.testing.assert_allclose(reaped(jax.vjp(f, X)[1], 1.)["k"], want, rtol=1e-6)
    T.check_vjp(f, X, tag="t")


def _rule_on(kind):
    def primal(u):
        return jnp.tanh(lh.sow(jnp.sin(u), tag="t", name="s2"))

    def d_primal(u):
        return (1 - jnp.tanh(jnp.sin(u)) ** 2) * jnp.cos(u)
    if kind == "custom_jvp":
        rule = jax.custom_jvp(primal)
        rule.defjvp(lambda p, t: (primal(p[0]), d_primal(p[0]) * t[0]))
    else:
        rule = jax.custom_vjp(primal)
        rule.defvjp(lambda u: (primal(u), u), lambda u, ct: (d_primal(u) * ct,))
    return rule


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_regression_rule_site_on_a_constant_in_a_checkpoint_under_linearize(kind, nested):
    # (a wide law-1 search) A custom call none of whose inputs has a tangent
    # is copied whole into jax.checkpoint's rematerialized linear part: its
    # site there is a recomputation. The linear function reaped its value
    # sin(0.7) as if it were the site's tangent.
    rule = _rule_on(kind)
    inner = jax.checkpoint(rule) if nested else rule

    def f(x):
        c = lh.sow(jnp.float32(0.7), tag="t", name="s1")
        return jax.checkpoint(lambda x, c: inner(c) * jnp.sum(jnp.cos(x)))(x, c)
    lin = reaped(jax.linearize(f, X)[1], TX)
    # a rule's function site is not in a linear function built before the
    # harvest (docs/laws.md, law 1), and never with its value
    assert set(lin.keys()) == {"s1"}
    close(lin["s1"], 0.)
    T.check_linearize(f, X, tag="t")
    # inside a harvest, the site is sown once, with its value
    d = reaped(jax.grad(f), X)
    close(d["s2"], jnp.sin(jnp.float32(0.7)))


def test_regression_while_loop_on_a_constant_in_a_checkpoint_under_linearize():
    # (JAX's split of a while loop asserts its body needs no residual; the
    # zero tangent of a site in it was kept in the forward part only)
    def body(s):
        return s[0] + 1, jnp.tanh(lh.sow(jnp.sin(s[1]), tag="t", name="w", mode="clobber"))

    @jax.checkpoint
    def g(x):
        w = lax.while_loop(lambda s: s[0] < 2, body, (0, jnp.float32(0.7)))[1]
        return w * jnp.sum(jnp.cos(x))
    lin = reaped(jax.linearize(g, X)[1], TX)
    # the linear function of a while loop holds the loop (docs/laws.md,
    # law 1): the value of its site, and its zero tangent
    close(lin["w"], jnp.sin(jnp.tanh(jnp.sin(jnp.float32(0.7)))))
    close(lin["jvp", "w"], 0.)
    T.check_linearize(g, X, tag="t")


def _dead_in_nested_checkpoints(x, e=0.0):
    # the site's value reaches the output only through stop_gradient (a
    # cond's predicate in the program the wide search found): its cotangent is zero
    inner = lambda v: lh.sow(v + e, tag="t", name="k")  # noqa: E731

    def outer(x, v):
        return jnp.cos(x) + 0.0 * lax.stop_gradient(jax.checkpoint(inner)(v))
    return jnp.sum(jax.checkpoint(outer)(x, jnp.cos(x)))


def test_regression_dead_site_in_nested_checkpoints_under_reverse_mode():
    # (law 7's wide run) SPEC 9: a site the output does not depend on gets
    # zeros; forward mode and jax.linearize kept the key, reverse mode had
    # none: JAX's partial evaluation of the outer checkpoint's transpose
    # dropped the inner one's tangent half, which has no outputs
    want = jax.grad(lambda e: _dead_in_nested_checkpoints(X, e))(jnp.zeros_like(X))
    close(want, 0.0)  # plain JAX: a zero perturbation argument
    assert ("jvp", "k") in reaped(lambda x: jax.linearize(_dead_in_nested_checkpoints, x)[1](x), X)
    got = reaped(jax.grad(_dead_in_nested_checkpoints), X)
    close(got["vjp", "k"], want)
    close(reaped(jax.vjp(_dead_in_nested_checkpoints, X)[1], 1.0)["k"], want)


def _dead_in_a_checkpoint_after_a_loop_with_sites(x, e=0.0, es=0.0):
    # the outer checkpoint's partial evaluation meets the loop's staged eqn
    # (an effect handle) before it stages the inner checkpoint's tangent half
    def body(c, ve):
        return c, lh.sow(jnp.sin(ve[0]), tag="t", name="s", mode="append") + ve[1]

    def outer(x, v):
        _, ys = lax.scan(body, 0.0, (v, v * 0.0 + es))
        k = jax.checkpoint(lambda w: lh.sow(jnp.ones(3) + e, tag="t", name="k"))(v)
        return jnp.cos(x) * ys + 0.0 * lax.stop_gradient(k)
    return jnp.sum(jax.checkpoint(outer)(x, x))


def test_regression_dead_site_in_a_checkpoint_after_a_loop_with_sites():
    # (law 7's wide run on several-pass programs) reverse mode raised
    # AttributeError: the check for an already-registered half read a field
    # JAX's effect handles do not have, reached only when one was registered
    fn = _dead_in_a_checkpoint_after_a_loop_with_sites
    want_k = jax.grad(lambda e: fn(X, e))(jnp.zeros_like(X))
    want_s = jax.grad(lambda es: fn(X, 0.0, es))(jnp.zeros_like(X))
    close(want_k, 0.0)
    for got in (reaped(jax.grad(fn), X)["vjp"], reaped(jax.vjp(fn, X)[1], 1.0)):
        close(got["k"], want_k)
        close(got["s"], want_s)


def _output_without_tangents(x, b, e=0.0):
    lh.sow(b + e, tag="t", name="s0")  # dead
    return jnp.sum(jax.checkpoint(jnp.sin)(lax.stop_gradient(x)))


def test_regression_backward_function_of_an_output_without_tangents_keeps_its_sites():
    # (the wide law-5 run on constant checkpoints) the output depends on no
    # differentiated input: JAX's backward pass returned at once (every
    # cotangent reaching it zero, no effect), and the backward function built
    # outside the harvest reaped nothing; a dead site's cotangent is zeros
    want = jax.grad(lambda e: _output_without_tangents(X, C0, e))(jnp.zeros(3))
    close(want, 0.0)  # plain JAX: a zero perturbation argument
    bwd = jax.vjp(_output_without_tangents, X, C0)[1]
    d = reaped(bwd, 1.0)
    assert list(d.keys()) == ["s0"]
    close(d["s0"], want)
    close(bwd(1.0)[1], 0.0)  # and the backward function's own cotangents


def test_a_constant_site_under_jacrev_of_grad_outside_a_harvest():
    # (found by tests/test_testing_module.py's random stacks) A site on a
    # constant, the only thing the output reads, under jax.jacrev of
    # jax.grad: the outer level gave the inner level's zero tangent copy
    # (already marked `constant`) a tangent copy of its own, binding
    # `constant` twice: TypeError in plain JAX with lazyharvest imported.
    from lazyharvest.testing.random_programs import Output, Program, Sow
    p = Program(body=(Sow(name="s0", srcs=(), mode="strict", const=(), seed=0,
                          stop_gradient=False),),
                output=Output(kind="scalar", srcs=(1,)), tree_input=False, tag="t")
    stack = T.Stack((T.Transform("grad", 0, 0), T.Transform("jacrev", 0, 0)))
    args = p.example_args(0)
    want = stack.apply(lambda *a: p.perturb({}, *a), jax)(*args)  # the program in JAX alone
    np.testing.assert_allclose(stack.apply(p.fn, jax)(*args), want)
    d = lh.reap(stack.apply(p.fn, jax), tag="t")(*args)
    np.testing.assert_allclose(d["s0"], p.slices["s0",](*args))
