"""Control flow as library code writes it.

Branches that sow different clobber names (diffrax's checkpointed and bounded
loops), `jax.vmap` of a cond with a batched predicate, loops that run zero
times, loops inside loops (BFGS's line search). Expected values come from
plain JAX: zero perturbations and `jax.grad` for cotangents, an ordered
`jax.debug.callback` log for "the last evaluation", hand-computed values
otherwise.
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
    skip_where_jax_jits_scan3_wrongly,
)
from lazyharvest import _jax


def sow(x, name, mode="clobber"):
    return lh.sow(x, tag="t", name=name, mode=mode)


def raises(words, fn, *args):
    with pytest.raises(lh.HarvestError) as info:
        fn(*args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# --- cond / switch: branches that sow different clobber sites --------------------

def two_names(x):
    y = sow(x * 10., "a")
    z = lax.cond(x > 0, lambda v: sow(v * 2., "a") * 3.,
                 lambda v: sow(v * 3., "b") ** 2, x)
    return z + y


def test_cond_branches_sow_different_clobber_sites():
    out, d = lh.call_and_reap(two_names, tag="t")(2.)
    close(out, 32.)
    close(d["a"], 4.)    # the taken branch sowed it
    close(d["b"], 0.)    # never sown: zeros
    out, d = lh.call_and_reap(two_names, tag="t")(-1.)
    close(out, -1.)
    close(d["a"], -10.)  # the taken branch did not sow it: the earlier value
    close(d["b"], -3.)


def test_cond_branches_sow_different_clobber_sites_tangents():
    d = lh.reap(lambda x: jax.jvp(two_names, (x,), (1.,)), tag="t")(2.)
    close(d["jvp", "a"], 2.)
    close(d["jvp", "b"], 0.)
    d = lh.reap(lambda x: jax.jvp(two_names, (x,), (1.,)), tag="t")(-1.)
    close(d["jvp", "a"], 10.)  # the tangent of the earlier value
    close(d["jvp", "b"], 3.)


def one_each(x):
    return lax.cond(x > 0, lambda v: sow(v * 2., "a") * 3.,
                    lambda v: sow(v * 3., "b") ** 2, x)


def one_each_perturbed(x, ea, eb):
    return lax.cond(x > 0, lambda v: (v * 2. + ea) * 3.,
                    lambda v: (v * 3. + eb) ** 2, x)


@pytest.mark.parametrize("x", [2., -1.])
def test_cond_branches_sow_different_clobber_sites_cotangents(x):
    ea, eb = jax.grad(one_each_perturbed, argnums=(1, 2))(x, 0., 0.)
    d = lh.reap(jax.grad(one_each), tag="t")(x)
    close(d["vjp", "a"], ea)  # zeros where the branch that sows it is not taken
    close(d["vjp", "b"], eb)
    _, bwd = jax.vjp(one_each, x)
    d = lh.reap(bwd, tag="t")(1.)
    close(d["a"], ea)
    close(d["b"], eb)


def _sown_then_cond(x, e=None, in_scan=False):
    """A clobber name sown before a cond (or a scan of conds) whose true
    branch sows it again; `e` perturbs the first occurrence (plain JAX)."""
    y = sow(jnp.sin(x), "c") if e is None else jnp.sin(x) + e
    branch = (lambda v: sow(v * 3., "c")) if e is None else (lambda v: v * 3.)

    def step(v, k):
        return lax.cond(k > 0, branch, lambda v: v, v)
    if in_scan:
        z = lax.scan(lambda c, k: (step(c, k), None), y, jnp.stack([jnp.sum(x)] * 2))[0]
    else:
        z = step(y, jnp.sum(x))
    return jnp.sum(z ** 2)


@pytest.mark.parametrize("in_scan", [False, True])
@pytest.mark.parametrize("x", [jnp.array([.3, .6]), jnp.array([-.3, -.6])])
def test_cond_branch_that_does_not_sow_keeps_the_earlier_cotangent(x, in_scan):
    # SPEC 3.1 / 9: where the taken branch does not sow a clobber name, the
    # reaped occurrence is the earlier one, so its cotangent is reaped (was
    # zeros). Expected: the gradient with respect to a perturbation at the
    # reaped occurrence (the branch's sow when taken, the earlier one if not).
    if float(jnp.sum(x)) > 0:  # the branch's sow: d out / d site = 2 * site
        n = 2 if in_scan else 1
        want = 2 * jnp.sin(x) * 3. ** n
    else:
        want = jax.grad(lambda e: _sown_then_cond(x, e, in_scan))(jnp.zeros(2))
    fn = lambda v: _sown_then_cond(v, None, in_scan)  # noqa: E731
    close(lh.reap(jax.grad(fn), tag="t")(x)["vjp", "c"], want)
    _, bwd = jax.vjp(fn, x)
    close(lh.reap(bwd, tag="t")(1.)["c"], want)


def test_scan_iteration_whose_cond_does_not_sow_keeps_its_own_earlier_cotangent():
    # In a scan body, a clobber name is sown, then sown again by one branch of
    # a cond. The last iteration takes the other branch, an earlier one takes
    # the sowing branch: the reaped occurrence is the last iteration's first
    # sow (was: the earlier iteration's branch sow, as the backward scan took
    # the iteration for one that did not sow the name).
    xs = jnp.array([0.9, -0.5, 0.3])

    def f(xs, e=None):
        def body(c, inp):
            xi, i = inp
            o = sow(xi + xi, "s")
            if e is not None:
                o = o + jnp.where(i == len(xs) - 1, e, 0.)  # the reaped occurrence
            v = lax.cond(o > 1.0, lambda o: sow(jnp.cos(o), "s"), jnp.cos, o)
            return 0.5 * c + jnp.tanh(v), v
        c, ys = lax.scan(body, 0.2, (xs, jnp.arange(len(xs))))
        return jnp.sum(ys) + c
    want = jax.grad(lambda e: f(xs, e))(0.)
    d = lh.reap(jax.grad(f), tag="t")(xs)
    close(d["s"], 0.6)
    close(d["vjp", "s"], want)
    _, bwd = jax.vjp(f, xs)
    close(lh.reap(bwd, tag="t")(1.)["s"], want)


def _planted_before_cond_in_scan(xs, e=0.):
    """A scan body sows "s", then one branch of a cond sows it again; the last
    iteration takes the other branch. `e` is added at the occurrence whose
    value is reaped (the last iteration's first sow)."""
    def body(c, inp):
        xi, last = inp
        o = sow(xi + xi, "s") + jnp.where(last, e, 0.)
        v = lax.cond(o > 1.0, lambda o: sow(jnp.cos(o), "s"), jnp.cos, o)
        return 0.5 * c + jnp.tanh(v), v
    c, ys = lax.scan(body, 0.2, (xs, jnp.arange(len(xs)) == len(xs) - 1))
    return jnp.sum(ys) + c


def _planted_before_cond(x, e=0.):
    o = sow(x * 3., "s") + e
    return lax.cond(o > 100., lambda o: sow(jnp.cos(o), "s"), jnp.cos, o)


def _check_plant_goes_to(f, x, reaped, ct=2.0):
    """A cotangent `ct` planted at "s" into f's backward function is added at
    the occurrence `reaped(x)`; returns the backward function."""
    _, bwd = jax.vjp(f, x)
    # plain JAX: the VJP of x -> (f(x), reaped occurrence) fed (1, ct)
    want = jax.vjp(lambda x: (f(x), reaped(x)), x)[1]((1.0, ct))[0]
    close(lh.plant(bwd, tag="t")({"s": ct}, 1.)[0], want)
    return bwd


@pytest.mark.parametrize("f, x, reaped", [
    (_planted_before_cond, 0.4, lambda x: x * 3.),
    (_planted_before_cond_in_scan, jnp.array([0.9, -0.5, 0.3]), lambda xs: xs[-1] + xs[-1]),
], ids=["straight", "scan"])
def test_cotangent_planted_at_a_name_the_taken_branch_does_not_sow_goes_before_the_cond(
        f, x, reaped):
    # The cotangent belongs to the reaped occurrence, the one before the cond
    # (was: lost, as the plant went to the cond's occurrence, counted last).
    bwd = _check_plant_goes_to(f, x, reaped)
    # the reaped cotangent is that occurrence's too (the e-perturbation)
    close(lh.reap(bwd, tag="t")(1.)["s"], jax.grad(f, argnums=1)(x, 0.))


def _cond_sows_cos(o):
    return lax.cond(o > 100., lambda o: sow(jnp.cos(o), "s"), jnp.cos, o)


# `e` is added at the occurrence whose value is reaped.
def _owed_into_jit(x, e=0.):
    return jax.jit(_cond_sows_cos)(sow(x * 3., "s") + e)


def _owed_into_checkpoint(x, e=0.):
    return jax.checkpoint(_cond_sows_cos)(sow(x * 3., "s") + e)


def _owed_out_of_jit(x, e=0.):
    return _cond_sows_cos(jax.jit(lambda x: sow(x * 3., "s") + e)(x))


def _owed_to_another_cond(x, e=0.):
    o = lax.cond(x > 0., lambda x: sow(2 * x, "s") + e, lambda x: x, x)
    return lax.cond(o > 5., lambda o: sow(jnp.cos(o), "s"), jnp.sin, o)


@pytest.mark.parametrize("f, x, reaped", [
    (_owed_into_jit, 0.4, lambda x: x * 3.),
    (_owed_into_checkpoint, 0.4, lambda x: x * 3.),
    (_owed_out_of_jit, 0.4, lambda x: x * 3.),
    (_owed_to_another_cond, 1.0, lambda x: 2 * x),
], ids=["into-jit", "into-checkpoint", "out-of-jit", "another-cond"])
def test_cotangent_at_a_name_the_taken_branch_does_not_sow_crosses_jit_checkpoint_and_cond(
        f, x, reaped):
    # The cond's occurrence (the last) is not taken; the reaped occurrence is
    # across a jit or checkpoint boundary, or in another cond's taken branch.
    # Was: a planted cotangent was lost at the boundary, and the reaped one
    # was zeros when the cond was inside a jit or checkpoint.
    bwd = _check_plant_goes_to(f, x, reaped)
    close(lh.reap(bwd, tag="t")(1.)["s"], jax.grad(f, argnums=1)(x, 0.))


def _scan_of_wrapped_cond(wrap, reverse):
    """A scan whose body, under `wrap`, sows "s" only where xi > 0.5; `e` is
    added at iteration 1's occurrence (the highest index that sows it)."""
    def f(xs, e=0.):
        def body(c, inp):
            xi, i = inp
            v = lax.cond(xi > 0.5, lambda o: sow(jnp.cos(o), "s") + jnp.where(i == 1, e, 0.),
                         jnp.sin, xi)
            return 0.5 * c + v, None
        return lax.scan(wrap(body), 0.1, (xs, jnp.arange(3)), reverse=reverse)[0]
    return f


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_cotangent_at_a_name_a_wrapped_scan_body_may_not_sow_goes_to_the_last_iteration_that_did(
        wrap, reverse):
    # Was: with the body under jit or checkpoint, the plant went to the
    # highest iteration (which does not sow), and was lost.
    f, xs = _scan_of_wrapped_cond(wrap, reverse), jnp.array([0.9, 0.7, 0.2])
    bwd = _check_plant_goes_to(f, xs, lambda xs: jnp.cos(xs[1]))
    close(lh.reap(bwd, tag="t")(1.)["s"], jax.grad(f, argnums=1)(xs, 0.))


def _scan_cond_sows(xs, reverse=False, before=False):
    """A scan whose body sows "s" only in one branch of a cond (xi > 0.5);
    with `before`, the body sows it first, then the cond."""
    def body(c, xi):
        if before:
            xi = sow(xi * 1.5, "s")
        v = lax.cond(xi > 0.5, lambda o: sow(jnp.cos(o), "s"), jnp.sin, xi)
        return 0.5 * c + v, None
    return lax.scan(body, 0.1, xs, reverse=reverse)[0]


def _sown_before_scan(xs, reverse=False):
    """The name sown before a scan none of whose iterations sows it here."""
    y = sow(xs[0] * 3., "s")
    return _scan_cond_sows(xs * y, reverse)


def _cond_after_scan(xs, reverse=False):
    """The name sown before a scan, in some of its iterations, then in a cond
    whose taken branch does not sow it."""
    y = sow(xs[0] * 3., "s")
    c = _scan_cond_sows(xs * y, reverse)
    return lax.cond(c > 100., lambda o: sow(jnp.cos(o), "s"), jnp.sin, c)


def _nested_scans(xs):
    """An outer scan over the rows of `xs`, an inner one over their entries."""
    def row(c, r):
        return c + _scan_cond_sows(r), None
    return lax.scan(row, 0., xs)[0]


@pytest.mark.parametrize("f, x, reaped", [
    # the last iteration does not sow: iteration 1 is the reaped one
    (_scan_cond_sows, jnp.array([0.9, 0.8, 0.3]), lambda xs: jnp.cos(xs[1])),
    # only the first iteration sows
    (_scan_cond_sows, jnp.array([0.9, 0.2, 0.3]), lambda xs: jnp.cos(xs[0])),
    # reverse=True: the value at the highest index that sowed
    (lambda xs: _scan_cond_sows(xs, reverse=True), jnp.array([0.9, 0.8, 0.3]),
     lambda xs: jnp.cos(xs[1])),
    # sown before the cond too: the last iteration's first sow
    (lambda xs: _scan_cond_sows(xs, before=True), jnp.array([0.9, 0.8, 0.3]),
     lambda xs: xs[2] * 1.5),
    (lambda xs: _scan_cond_sows(xs, before=True), jnp.array([0.9, 0.8, 0.5]),
     lambda xs: jnp.cos(xs[2] * 1.5)),
    # no iteration sows: the occurrence before the scan
    (_sown_before_scan, jnp.array([0.1, 0.2, 0.3]), lambda xs: xs[0] * 3.),
    (lambda xs: _sown_before_scan(xs, reverse=True), jnp.array([0.1, 0.2, 0.3]),
     lambda xs: xs[0] * 3.),
    # a cond after the scan that does not sow: the scan's last iteration that did
    (_cond_after_scan, jnp.array([0.9, 0.8, 0.1]), lambda xs: jnp.cos(xs[1] * xs[0] * 3.)),
    (lambda xs: _cond_after_scan(xs, reverse=True), jnp.array([0.9, 0.8, 0.1]),
     lambda xs: jnp.cos(xs[1] * xs[0] * 3.)),
    # nested scans: the last outer iteration sows nowhere
    (_nested_scans, jnp.array([[0.9, 0.2], [0.1, 0.3]]), lambda xs: jnp.cos(xs[0, 0])),
], ids=["iteration-1", "iteration-0", "reverse", "before-cond", "before-cond-sown",
        "before-scan", "reverse-before-scan", "cond-after-scan",
        "reverse-cond-after-scan", "nested"])
def test_cotangent_planted_at_a_name_no_later_iteration_sows_goes_to_the_last_iteration_that_did(
        f, x, reaped):
    # The cotangent belongs to the reaped occurrence, in the highest iteration
    # that sowed the name (was: lost, as the plant went to the highest
    # iteration only, whose taken branch does not sow it).
    _check_plant_goes_to(f, x, reaped)
    close(lh.reap(f, tag="t")(x)["s"], reaped(x))


@pytest.mark.parametrize("in_cond", [False, True], ids=["body", "branches"])
def test_filtered_site_passes_through_a_plant_owed_in_a_scan_once(in_cond):
    # The VJP of a reverse scan runs forward: a first pass finds the highest
    # iteration that sows "s". Was: that pass sowed the filtered site "u"
    # again, so an outer harvest stacked 6 rows for 3 iterations.
    def f(xs):
        def body(c, xi):
            u = lambda o: sow(o, "u", "append")
            if not in_cond:
                xi = u(xi)
            v = lax.cond(xi > 0.5, lambda o: sow(jnp.cos(u(o) if in_cond else o), "s"),
                         lambda o: jnp.sin(u(o) if in_cond else o), xi)
            return 0.5 * c + v, None
        return lax.scan(body, 0.1, xs, reverse=True)[0]

    xs = jnp.array([0.9, 0.7, 0.2])
    _, bwd = jax.vjp(f, xs)
    planted = lambda ct: lh.plant(bwd, tag="t", blocklist=["u"])({"s": 2.}, ct)
    # plain JAX: "u"'s cotangent with 2. added at the reaped occurrence of "s"
    # (iteration 1, the highest that sows it), that is d f / d xs with it
    want = jax.vjp(lambda xs: (f(xs), jnp.cos(xs[1])), xs)[1]((1.0, 2.0))[0]
    close(lh.reap(planted, tag="t")(1.)["u"], want)


@pytest.mark.parametrize("x", [2., -1.])
def test_cond_plant_of_a_name_one_branch_sows(x):
    planted = lh.plant(two_names, tag="t")({"b": 5.}, x)
    close(planted, two_names(x) if x > 0 else 5. ** 2 + x * 10.)


def test_switch_branches_sow_different_clobber_sites():
    def f(i, x):
        sow(-x, "a")
        return lax.switch(i, [lambda v: sow(v * 2., "a"),
                              lambda v: sow(v * 3., "b"),
                              lambda v: sow(v * 4., "a") + sow(v * 5., "b")], x)
    expected = [(4., 0.), (-2., 6.), (8., 10.)]
    for i, (a, b) in enumerate(expected):
        d = lh.reap(f, tag="t")(i, 2.)
        close(d["a"], a)
        close(d["b"], b)


def test_cond_in_jit_keeps_the_value_sown_outside():
    def f(x):
        sow(x * 7., "a")
        return jax.jit(lambda v: lax.cond(v > 0, lambda u: sow(u * 2., "a"),
                                          lambda u: u, v))(x)
    close(lh.reap(f, tag="t")(-1.)["a"], -7.)
    close(lh.reap(f, tag="t")(1.)["a"], 2.)


def test_nested_cond_keeps_the_value_sown_outside():
    def f(x):
        sow(x * 7., "a")
        return lax.cond(x > -5, lambda v: lax.cond(v > 0, lambda u: sow(u * 2., "a"),
                                                   lambda u: u, v),
                        lambda v: sow(v * 3., "a"), x)
    close(lh.reap(f, tag="t")(-1.)["a"], -7.)
    close(lh.reap(f, tag="t")(1.)["a"], 2.)
    close(lh.reap(f, tag="t")(-6.)["a"], -18.)


def test_cond_mismatched_append_names_the_branch():
    def f(x):
        return lax.cond(x > 0, lambda v: sow(v, "p", mode="append"), lambda v: v * 2., x)
    raises(["'t'", "'p'", "mode='append'", "branch 1 (the true_fun of lax.cond)",
            "branch 0", "mode='clobber'"], lh.reap(f, tag="t"), 1.)


def test_switch_mismatched_strict_names_the_branch():
    def f(i, x):
        return lax.switch(i, [lambda v: sow(v, "s", mode="strict"),
                              lambda v: sow(v * 2., "s", mode="strict"),
                              lambda v: v * 3.], x)
    raises(["'s'", "mode='strict'", "branch 0 of lax.switch", "branch 2 of lax.switch"],
           lh.reap(f, tag="t"), 0, 1.)


def test_cond_clobber_branches_must_agree_on_shapes():
    def f(x):
        return lax.cond(x > 0, lambda v: sow(v, "c") * 1.,
                        lambda v: (sow(jnp.stack([v, v]), "c"), v)[1], x)
    raises(["'c'", "branch 0", "branch 1", "shapes"], lh.reap(f, tag="t"), 1.)


def test_cond_clobber_in_one_branch_of_another_shape_than_before_gives_zeros():
    def f(x):
        sow(jnp.stack([x, x]), "c")
        return lax.cond(x > 0, lambda v: sow(v * 2., "c"), lambda v: v, x)
    close(lh.reap(f, tag="t")(-1.)["c"], 0.)
    close(lh.reap(f, tag="t")(1.)["c"], 2.)


# --- jax.vmap of a cond with a batched predicate -----------------------------------

X = jnp.array([1., -2., 3.])


def branchy(p, x):
    return lax.cond(x > 0, lambda: sow(p * x, "s") ** 2, lambda: sow(p - x, "s") * 3.)


def branchy_perturbed(p, x, e):
    return lax.cond(x > 0, lambda: (p * x + e) ** 2, lambda: (p - x + e) * 3.)


def batched_loss(p):
    return jnp.sum(jax.vmap(branchy, (None, 0))(p, X))


def test_vmap_cond_batched_predicate_values():
    d = lh.reap(batched_loss, tag="t")(2.)
    close(d["s"], jnp.where(X > 0, 2. * X, 2. - X))


def test_vmap_cond_batched_predicate_cotangents():
    expected = jax.grad(lambda e: jnp.sum(jax.vmap(branchy_perturbed, (None, 0, 0))(
        2., X, e)))(jnp.zeros(3))
    d = lh.reap(jax.grad(batched_loss), tag="t")(2.)
    close(d["vjp", "s"], expected)
    d = lh.reap(jax.grad(lambda x: jnp.sum(jax.vmap(branchy, (None, 0))(2., x))),
                tag="t")(X)
    close(d["vjp", "s"], expected)
    d = lh.reap(jax.vmap(jax.grad(branchy), (None, 0)), tag="t")(2., X)
    close(d["vjp", "s"], expected)


def test_vmap_cond_batched_predicate_plant():
    plant = jnp.array([1., 4., -2.])
    expected = jnp.sum(jnp.where(X > 0, plant ** 2, plant * 3.))
    close(lh.plant(batched_loss, tag="t")({"s": plant}, 2.), expected)
    close(lh.plant(jax.vmap(branchy, (None, 0)), tag="t")({"s": plant}, 2., X),
          jnp.where(X > 0, plant ** 2, plant * 3.))


def test_vmap_cond_vjp_backward_built_outside():
    expected = jax.grad(lambda e: jnp.sum(jax.vmap(branchy_perturbed, (None, 0, 0))(
        2., X, e)))(jnp.zeros(3))
    _, bwd = jax.vjp(batched_loss, 2.)
    close(lh.reap(bwd, tag="t")(1.)["s"], expected)


def chained(p, x):
    def pos(v):
        a = sow(v * p, "s1")
        return jax.jit(lambda u: sow(jnp.sin(u), "s2"))(a) * a

    def neg(v):
        a = sow(v + p, "s1")
        return jax.jit(lambda u: sow(u ** 2, "s2"))(a) - a
    return lax.cond(x > 0, pos, neg, x)


def chained_perturbed(p, x, e1, e2):
    def pos(v):
        a = v * p + e1
        return (jnp.sin(a) + e2) * a

    def neg(v):
        a = v + p + e1
        return (a ** 2 + e2) - a
    return lax.cond(x > 0, pos, neg, x)


def test_vmap_cond_batched_predicate_chained_sites_in_jit():
    s1 = jnp.where(X > 0, X * 2., X + 2.)
    s2 = jnp.where(X > 0, jnp.sin(s1), s1 ** 2)
    loss = lambda p: jnp.sum(jax.vmap(chained, (None, 0))(p, X))
    d = lh.reap(jax.grad(loss), tag="t")(2.)
    close(d["s1"], s1)
    close(d["s2"], s2)
    e1, e2 = jax.grad(lambda e1, e2: jnp.sum(jax.vmap(chained_perturbed, (None, 0, 0, 0))(
        2., X, e1, e2)), argnums=(0, 1))(jnp.zeros(3), jnp.zeros(3))
    close(d["vjp", "s1"], e1)
    close(d["vjp", "s2"], e2)
    plant = jnp.array([0.5, -1., 2.])
    s2p = jnp.where(X > 0, jnp.sin(plant), plant ** 2)
    close(lh.plant(loss, tag="t")({"s1": plant}, 2.),
          jnp.sum(jnp.where(X > 0, s2p * plant, s2p - plant)))


def test_vmap_cond_batched_predicate_different_clobber_sites():
    def f(x):
        sow(x * 10., "a")
        return lax.cond(x > 0, lambda v: sow(v * 2., "a") * 3., lambda v: sow(v * 3., "b") ** 2,
                        x)

    def perturbed(x, eb):
        return lax.cond(x > 0, lambda v: v * 6., lambda v: (v * 3. + eb) ** 2, x)
    # lh.vmap keeps the cond, plain jax.vmap batches it with masked sites: an
    # element whose branch does not sow a name keeps its earlier value, as
    # without vmap
    d = lh.reap(lh.vmap(f), tag="t")(X)
    close(d["a"], jnp.where(X > 0, X * 2., X * 10.))
    close(d["b"], jnp.where(X > 0, 0., X * 3.))
    loss = lambda x: jnp.sum(jax.vmap(f)(x))
    d = lh.reap(jax.grad(loss), tag="t")(X)
    close(d["a"], jnp.where(X > 0, X * 2., X * 10.))
    close(d["b"], jnp.where(X > 0, 0., X * 3.))
    eb = jax.grad(lambda eb: jnp.sum(jax.vmap(perturbed)(X, eb)))(jnp.zeros(3))
    close(d["vjp", "b"], eb)
    close(lh.plant(jax.vmap(f), tag="t")({"b": jnp.ones(3)}, X), jnp.where(X > 0, X * 6., 1.))


def earlier_then_cond(x):
    # "a" is sown, then a cond whose first branch sows it again; the value
    # sown first feeds the output too
    a = sow(x * 10., "a")
    return lax.cond(x > 0, lambda v: sow(v * 2., "a") * 3., lambda v: sow(v * 3., "b") ** 2,
                    x) + jnp.sin(a)


def earlier_then_cond_perturbed(x, e_cond, e_before):
    # a perturbation at the occurrence of "a" in the taken branch, and one
    # at the occurrence before the cond
    a = x * 10. + e_before
    return lax.cond(x > 0, lambda v: (v * 2. + e_cond) * 3., lambda v: (v * 3.) ** 2,
                    x) + jnp.sin(a)


def vmapped_loss(x):
    return jnp.sum(jax.vmap(earlier_then_cond)(x))


def test_vmap_cond_element_whose_branch_does_not_sow_keeps_the_earlier_value():
    # values and tangents: the branch's where it sows "a", the earlier ones elsewhere
    d = lh.reap(vmapped_loss, tag="t")(X)
    close(d["a"], jnp.where(X > 0, X * 2., X * 10.))
    d = lh.reap(lambda x: jax.jvp(vmapped_loss, (x,), (jnp.ones(3),)), tag="t")(X)
    close(d["jvp", "a"], jnp.where(X > 0, 2., 10.))
    _, lin = jax.linearize(vmapped_loss, X)
    close(lh.reap(lin, tag="t")(jnp.ones(3))["a"], jnp.where(X > 0, 2., 10.))
    # the cotangent of the reaped occurrence: in the branch where it sows,
    # before the cond elsewhere
    z = jnp.zeros(3)
    at_cond, before = jax.grad(lambda e1, e0: jnp.sum(jax.vmap(earlier_then_cond_perturbed)(
        X, e1, e0)), argnums=(0, 1))(z, z)
    want = jnp.where(X > 0, at_cond, before)
    close(lh.reap(jax.grad(vmapped_loss), tag="t")(X)["vjp", "a"], want)
    bwd = jax.vjp(vmapped_loss, X)[1]
    close(lh.reap(bwd, tag="t")(1.)["a"], want)
    # a value sown outside the vmap is the earlier value too (broadcast)
    def outside(x):
        sow(jnp.sum(x), "a")
        return jnp.sum(jax.vmap(lambda v: lax.cond(v > 0, lambda v: sow(v * 2., "a"),
                                                  lambda v: v ** 2, v))(x))
    close(lh.reap(outside, tag="t")(X)["a"], jnp.where(X > 0, X * 2., jnp.sum(X)))


def test_vmap_cond_cotangent_planted_where_the_branch_does_not_sow_goes_before_the_cond():
    ct = jnp.array([1., 2., 3.])
    bwd = jax.vjp(vmapped_loss, X)[1]
    reaped = lambda x: jnp.where(x > 0, x * 2., x * 10.)  # noqa: E731
    want = jax.vjp(lambda x: (vmapped_loss(x), reaped(x)), X)[1]((1., ct))[0]
    close(lh.plant(bwd, tag="t")({"a": ct}, 1.)[0], want)
    # a primal plant replaces every occurrence, in either branch
    close(lh.plant(jax.vmap(earlier_then_cond), tag="t")({"a": 5. * jnp.ones(3)}, X),
          jnp.where(X > 0, 15., (X * 3.) ** 2) + jnp.sin(5.))


@pytest.mark.parametrize("wrap", ["jit", "checkpoint"])
def test_vmap_cond_masked_site_inside_jit_or_checkpoint_keeps_the_earlier_value(wrap):
    w = jax.jit if wrap == "jit" else jax.checkpoint

    def loss(x):
        a = sow(x * 10., "a")
        inner = jax.vmap(lambda v: lax.cond(v > 0, lambda v: sow(v * 2., "a") * 3.,
                                            lambda v: v ** 2, v))
        return jnp.sum(w(inner)(x) + jnp.sin(a))

    def perturbed(x, e1, e0):
        return jnp.sum(jax.vmap(lambda v, e: lax.cond(v > 0, lambda v: (v * 2. + e) * 3.,
                                                      lambda v: v ** 2, v))(x, e1)
                       + jnp.sin(x * 10. + e0))
    d = lh.reap(jax.grad(loss), tag="t")(X)
    close(d["a"], jnp.where(X > 0, X * 2., X * 10.))
    z = jnp.zeros(3)
    e1, e0 = jax.grad(perturbed, argnums=(1, 2))(X, z, z)
    close(d["vjp", "a"], jnp.where(X > 0, e1, e0))


@pytest.mark.parametrize("p", [1., -1.], ids=["taken", "not-taken"])
def test_vmap_cond_masked_site_in_the_branch_of_an_unbatched_cond(p):
    # the outer cond's predicate is not batched: it stays a cond, one of whose
    # branches holds the masked site
    def f(x):
        a = sow(x * 10., "a")
        inner = lambda x: lax.cond(x > 0, lambda v: sow(v * 2., "a") * 3.,  # noqa: E731
                                   lambda v: v ** 2, x)
        return lax.cond(p > 0, inner, lambda x: x, x) + jnp.sin(a)

    def perturbed(x, e1, e0):
        inner = lambda x: lax.cond(x > 0, lambda v: (v * 2. + e1) * 3.,  # noqa: E731
                                   lambda v: v ** 2, x)
        return lax.cond(p > 0, inner, lambda x: x, x) + jnp.sin(x * 10. + e0)
    loss = lambda x: jnp.sum(jax.vmap(f)(x))  # noqa: E731
    sows = (X > 0) & (p > 0)
    close(lh.reap(loss, tag="t")(X)["a"], jnp.where(sows, X * 2., X * 10.))
    z = jnp.zeros(3)
    e1, e0 = jax.grad(lambda e1, e0: jnp.sum(jax.vmap(perturbed)(X, e1, e0)),
                      argnums=(0, 1))(z, z)
    close(lh.reap(jax.grad(loss), tag="t")(X)["vjp", "a"], jnp.where(sows, e1, e0))
    ct = jnp.array([1., 2., 3.])
    reaped = lambda x: jnp.where((x > 0) & (p > 0), x * 2., x * 10.)  # noqa: E731
    want = jax.vjp(lambda x: (loss(x), reaped(x)), X)[1]((1., ct))[0]
    close(lh.plant(jax.vjp(loss, X)[1], tag="t")({"a": ct}, 1.)[0], want)


def test_vmap_of_a_cond_whose_branch_vmaps_a_cond_keeps_the_earlier_value():
    # both conds batched: the inner one's masked site is a site of the outer
    # one's branches that only one of them sows
    def inner(y):
        return lax.cond(y > 0, lambda v: sow(v * 2., "a") * 3., lambda v: v ** 2, y)

    def f(x):
        a = sow(x * 10., "a")
        return jnp.sum(lax.cond(x[0] > 0, jax.vmap(inner), lambda v: v * 5., x) + jnp.sin(a))

    def perturbed(x, e1, e0):
        inner_e = lambda y, e: lax.cond(y > 0, lambda v: (v * 2. + e) * 3.,  # noqa: E731
                                        lambda v: v ** 2, y)
        return jnp.sum(lax.cond(x[0] > 0, lambda v: jax.vmap(inner_e)(v, e1),
                                lambda v: v * 5., x) + jnp.sin(x * 10. + e0))
    x2 = jnp.stack([X, jnp.array([-1., 2., 4.])])
    sows = (x2[:, :1] > 0) & (x2 > 0)
    loss = lambda x: jnp.sum(jax.vmap(f)(x))  # noqa: E731
    d = lh.reap(jax.grad(loss), tag="t")(x2)
    close(d["a"], jnp.where(sows, x2 * 2., x2 * 10.))
    z = jnp.zeros((2, 3))
    e1, e0 = jax.grad(lambda e1, e0: jnp.sum(jax.vmap(perturbed)(x2, e1, e0)),
                      argnums=(0, 1))(z, z)
    close(d["vjp", "a"], jnp.where(sows, e1, e0))


XS3 = jnp.stack([X, -X, 0.5 * X])


def scanned(xs, reverse, e=None, last=None):
    """A masked site in a scan body (each row of `xs` vmapped through a cond
    whose first branch sows "a"), after "a" is sown before the scan. With `e`,
    a perturbation at the reaped occurrence of each element (iteration
    `last`, -1: the one before the scan)."""
    a0 = sow(xs[0] * 10., "a")
    if e is not None:
        a0 = a0 + jnp.where(last == -1, e, 0.)

    def body(c, ix):
        i, x = ix

        def one(v, e, last):
            def pos(v):
                a = sow(v * 2., "a")
                if e is not None:
                    a = a + jnp.where(last == i, e, 0.)
                return a * 3. + jnp.sin(a)
            return lax.cond(v > 0, pos, lambda v: v ** 2, v)
        if e is None:
            return c + jax.vmap(lambda v: one(v, None, None))(x), None
        return c + jax.vmap(one)(x, e, last), None
    out = lax.scan(body, jnp.zeros(3), (jnp.arange(3), xs), reverse=reverse)[0]
    return jnp.sum(out + jnp.cos(a0))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_vmap_cond_masked_site_in_a_scan_holds_the_highest_iteration_that_sowed(reverse):
    # per element, the highest iteration whose branch sowed "a" (-1: none)
    last = jnp.full(3, -1)
    for i in range(3):
        last = jnp.where(XS3[i] > 0, i, last)
    reaped = jnp.where(last == -1, XS3[0] * 10., 2. * XS3[jnp.maximum(last, 0), jnp.arange(3)])
    f = lambda xs: scanned(xs, reverse)  # noqa: E731
    close(lh.reap(f, tag="t")(XS3)["a"], reaped)
    cot = jax.grad(lambda e: scanned(XS3, reverse, e, last))(jnp.zeros(3))
    close(lh.reap(jax.grad(f), tag="t")(XS3)["vjp", "a"], cot)
    bwd = jax.vjp(f, XS3)[1]
    close(lh.reap(bwd, tag="t")(1.)["a"], cot)
    ct = jnp.array([1., 2., 3.])

    def reaped_of(xs):
        vals = xs[0] * 10.
        for i in range(3):
            vals = jnp.where(xs[i] > 0, xs[i] * 2., vals)
        return vals
    want = jax.vjp(lambda xs: (f(xs), reaped_of(xs)), XS3)[1]((1., ct))[0]
    close(lh.plant(bwd, tag="t")({"a": ct}, 1.)[0], want)


def test_vmap_of_vmap_cond_keeps_the_earlier_value():
    x2 = jnp.stack([X, -X])
    d = lh.reap(jax.grad(lambda x: jnp.sum(jax.vmap(jax.vmap(earlier_then_cond))(x))),
                tag="t")(x2)
    close(d["a"], jnp.where(x2 > 0, x2 * 2., x2 * 10.))
    close(d["b"], jnp.where(x2 > 0, 0., x2 * 3.))


# --- loops that run zero times -------------------------------------------------------

def sown_then_nested_zero_trip(x, inner="scan", e=0.):
    """"a" sown (plus `e`), then an outer scan of one iteration whose inner
    loop, of zero iterations, would sow it again: the value sown first is
    the reaped one, and it feeds the output."""
    v = sow(x, "a") + e

    def outer(c, _):
        step = lambda c2: sow(jnp.sin(c2), "a")  # noqa: E731
        if inner == "scan":
            return lax.scan(lambda c2, _: (step(c2), None), c, None, length=0)[0], None
        return lax.while_loop(lambda s: s[0] < 0, lambda s: (s[0] + 1, step(s[1])),
                              (0, c))[1], None
    return jnp.sum(jnp.cos(lax.scan(outer, v, None, length=1)[0]))


def test_cotangent_of_a_name_a_nested_zero_trip_scan_does_not_sow_is_the_earlier_ones():
    # The outer backward scan did not learn that no iteration sowed "a": the
    # occurrence before it got no cotangent (zeros), and a cotangent planted
    # there was lost.
    xs = jnp.array([0.3, 0.5, 0.9])
    want = jax.grad(lambda e: sown_then_nested_zero_trip(xs, e=e))(jnp.zeros(3))
    close(lh.reap(jax.grad(sown_then_nested_zero_trip), tag="t")(xs)["vjp", "a"], want)
    bwd = jax.vjp(sown_then_nested_zero_trip, xs)[1]
    close(lh.reap(bwd, tag="t")(1.)["a"], want)
    ct = jnp.array([1., -2., 3.])
    full = jax.vjp(lambda x: (sown_then_nested_zero_trip(x), x), xs)[1]((1., ct))[0]
    close(lh.plant(bwd, tag="t")({"a": ct}, 1.)[0], full)


@pytest.mark.skipif(not _jax.DERIVATIVE_SITES, reason="needs jax >= 0.9 (derivative_sites)")
def test_linear_function_of_a_zero_trip_while_in_a_scan_keeps_the_earlier_value():
    # The copy of the earlier value that the linear function of jax.linearize
    # gets before a while loop (which it holds whole) was not made when the
    # loop sat in a scan: the name read zeros there.
    xs = jnp.array([0.3, 0.5, 0.9])
    f = lambda x: sown_then_nested_zero_trip(x, inner="while")  # noqa: E731
    _, lin = jax.linearize(f, xs)
    close(lh.reap(lin, tag="t")(jnp.ones(3))["a"], xs)

def test_zero_trip_while_keeps_earlier_value():
    def f(x):
        sow(x * 4., "w")
        return lax.while_loop(lambda c: c < 0., lambda c: sow(c + 1., "w"), x)
    close(lh.reap(f, tag="t")(1.)["w"], 4.)
    close(lh.reap(f, tag="t")(-0.5)["w"], 0.5)  # ran once: the value sown in it


def test_zero_trip_while_tangent_keeps_earlier_value():
    def f(x):
        sow(x * 4., "w")
        return lax.while_loop(lambda c: c < 0., lambda c: sow(c * 3., "w") + 1., x)
    d = lh.reap(lambda x: jax.jvp(f, (x,), (1.,)), tag="t")(1.)
    close(d["w"], 4.)
    close(d["jvp", "w"], 4.)


def _sown_then_zero_trip_while(x):
    a = sow(jnp.sin(x), "k")
    body = lambda c: (c[0] + 1, sow(jnp.cos(c[1]), "k"))
    return a + lax.while_loop(lambda c: c[0] < 0, body, (0, x))[1]


def _in_scan_body(f):
    return lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]


@pytest.mark.skipif(not _jax.DERIVATIVE_SITES, reason="needs jax >= 0.9 (derivative_sites)")
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit, jax.checkpoint, _in_scan_body],
                         ids=["plain", "jit", "checkpoint", "scan_body"])
def test_linear_function_of_zero_trip_while_keeps_earlier_value(wrap):
    # jax.linearize keeps the whole loop in the linear function, but the value
    # sown before it lived in the primal part only: the loop reaped zeros.
    x, t = 0.7, 1.5
    value, tangent = jax.jvp(jnp.sin, (x,), (t,))  # plain JAX: k is sin(x)
    _, lin = jax.linearize(wrap(_sown_then_zero_trip_while), x)
    d = lh.reap(lin, tag="t")(t)
    close(d["k"], value)
    close(d["jvp", "k"], tangent)


def test_zero_length_scan_keeps_earlier_value():
    def f(x, xs):
        sow(x * 5., "c")
        return lax.scan(lambda c, xi: (sow(c + xi, "c"), None), x, xs)[0]
    close(lh.reap(f, tag="t")(1., jnp.zeros(0))["c"], 5.)
    close(lh.reap(f, tag="t")(1., jnp.ones(2))["c"], 3.)


def test_zero_length_reverse_scan_keeps_earlier_value():
    def f(x, xs):
        sow(x * 5., "c")
        return lax.scan(lambda c, xi: (sow(c + xi, "c"), None), x, xs, reverse=True)[0]
    close(lh.reap(f, tag="t")(1., jnp.zeros(0))["c"], 5.)


def _sown_then_zero_length_scan(x, e=0.):
    """A clobber name sown before a scan of length 0 that sows it too; `e`
    perturbs the occurrence before the scan (plain JAX when given)."""
    y = jnp.sin(x) + e if isinstance(e, jax.Array) else sow(jnp.sin(x), "c")
    body = (lambda c, _: (c * 2., None)) if isinstance(e, jax.Array) else (
        lambda c, _: (sow(c * 2., "c"), None))
    return jnp.sum(lax.scan(body, y, None, length=0)[0] ** 2)


def test_zero_length_scan_keeps_the_earlier_cotangent():
    # The backward pass reached the (transposed, zero-length) scan first and
    # recorded zeros, which the earlier occurrence's cotangent could not replace.
    x = jnp.array([.3, .6])
    want = jax.grad(lambda e: _sown_then_zero_length_scan(x, e))(jnp.zeros(2))
    close(lh.reap(jax.grad(_sown_then_zero_length_scan), tag="t")(x)["vjp", "c"], want)
    _, bwd = jax.vjp(_sown_then_zero_length_scan, x)
    close(lh.reap(bwd, tag="t")(1.)["c"], want)


def test_zero_length_scan_plant_into_backward_function():
    # An additive cotangent planted into the backward function at a clobber
    # name a zero-length scan also sows raised IndexError; it belongs to the
    # occurrence before the scan.
    x = jnp.array([.3, .6])
    _, bwd = jax.vjp(_sown_then_zero_length_scan, x)
    ct = jnp.array([1., -2.])
    want = jax.grad(_sown_then_zero_length_scan)(x) + jnp.cos(x) * ct
    close(lh.plant(bwd, tag="t")({"c": ct}, 1.)[0], want)


# --- loops whose body does not always sow ------------------------------------------------

def test_while_body_cond_that_does_not_always_sow():
    def f(x):
        def body(s):
            i, c = s
            c = lax.cond(i % 2 == 0, lambda v: sow(v * 2., "a") + 1., lambda v: v - 1., c)
            return i + 1, c
        return lax.while_loop(lambda s: s[0] < 4, body, (0, x))[1]
    # i=0: a=2, c=3; i=1: c=2; i=2: a=4, c=5; i=3: c=4
    close(lh.reap(f, tag="t")(1.)["a"], 4.)


def test_scan_of_cond_holds_last_sown_value_and_its_cotangent():
    def f(p):
        def body(c, i):
            return lax.cond(i < 2, lambda c: sow(c * p, "y") + 1., lambda c: c, c), None
        return lax.scan(body, 1., jnp.arange(4))[0]

    def perturbed(p, e):
        def body(c, ie):
            i, ei = ie
            return lax.cond(i < 2, lambda c: c * p + ei + 1., lambda c: c, c), None
        return lax.scan(body, 1., (jnp.arange(4), e))[0]

    d = lh.reap(jax.grad(f), tag="t")(3.)
    close(d["y"], 12.)  # i=0: y=3, c=4; i=1: y=12, c=13; i=2, 3: the identity
    # the cotangent of the occurrence whose value is reaped (i=1)
    close(d["vjp", "y"], jax.grad(perturbed, argnums=1)(3., jnp.zeros(4))[1])


def test_reverse_scan_clobber_holds_highest_index_sown():
    def f(xs):
        def body(c, ix):
            i, x = ix
            c = lax.cond(i % 2 == 0, lambda c: sow(c + x, "a") * 1., lambda c: c * 2., c)
            return c, None
        return lax.scan(body, 0., (jnp.arange(4), xs), reverse=True)[0]
    # reverse: i=3: c=0; i=2: a=0+3=3, c=3; i=1: c=6; i=0: a=6+1=7
    # the highest index that sowed is 2
    close(lh.reap(f, tag="t")(jnp.array([1., 2., 3., 4.]))["a"], 3.)


# --- nested loops ----------------------------------------------------------------------

def test_nested_while_holds_last_evaluation():
    def f(x):
        def outer(s):
            i, v = s

            def inner(t):
                j, w = t
                sow(w * 2., "w")
                return j + 1, w + 1.
            # the inner loop runs 2, 1, then 0 times
            _, v = lax.while_loop(lambda t: t[0] < 2 - i, inner, (0, v))
            return i + 1, v
        return lax.while_loop(lambda s: s[0] < 3, outer, (0, x))[1]
    # sown: 2, 4 (i=0), 6 (i=1), nothing (i=2)
    close(lh.reap(f, tag="t")(1.)["w"], 6.)


def test_nested_while_keeps_value_sown_before_both():
    def f(x):
        sow(x * 9., "w")
        inner = lambda v: lax.while_loop(lambda w: w < 0., lambda w: sow(w + 1., "w"), v)
        return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, inner(s[1])), (0, x))[1]
    close(lh.reap(f, tag="t")(1.)["w"], 9.)


def test_bfgs_minimize_objective_last_evaluation():
    from jax.scipy.optimize import minimize

    target = jnp.array([1., 2.])
    log = []

    def objective(x, site):
        s = site(jnp.sin(x))
        return jnp.sum((x - target) ** 2) + jnp.sum(jnp.array([1., 3.]) * s ** 2)

    def logged(x):
        jax.debug.callback(lambda v: log.append(np.asarray(v)), x, ordered=True)
        return objective(x, lambda s: s)

    def solve(obj):
        return lambda x0: minimize(obj, x0, method="BFGS").x

    x0 = jnp.array([0.5, -0.3])
    solve(logged)(x0)
    jax.effects_barrier()
    assert len(log) > 2
    last = log[-1]
    expected_ct = jax.grad(lambda e: objective(jnp.asarray(last), lambda s: s + e))(
        jnp.zeros(2))

    d = lh.reap(solve(lambda x: objective(x, lambda s: sow(s, "s"))), tag="t")(x0)
    close(d["s"], jnp.sin(last))
    close(d["vjp", "s"], expected_ct)
    assert float(jnp.abs(expected_ct).max()) > 0.1  # not the gradient w.r.t. x (~0)


# --- diffrax ----------------------------------------------------------------------------

def diffrax_solve(a, adjoint, vf, e=None):
    diffrax = pytest.importorskip("diffrax")
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vf), diffrax.Euler(), 0., 1., 0.1, jnp.array([1., 2.]),
        args=a if e is None else (a, e), adjoint=adjoint,
        saveat=diffrax.SaveAt(t1=True), max_steps=16)
    return jnp.sum(sol.ys)


def diffrax_case(adjoint_name):
    diffrax = pytest.importorskip("diffrax")
    adjoint = getattr(diffrax, adjoint_name)()
    log = []

    def logged(t, y, a):
        jax.debug.callback(lambda tt, v: log.append((float(tt), np.asarray(v))), t, y,
                           ordered=True)
        return -a * y

    def sown(t, y, a):
        return -a * sow(y, "y")

    def perturbed_at(t_pert):
        # e is added to the vector field's input at the evaluation at time t_pert
        def vf(t, y, args):
            a, e = args
            return -a * (y + jnp.where(jnp.abs(t - t_pert) < 0.05, e, 0.))
        return lambda a, e: diffrax_solve(a, adjoint, vf, e)
    return adjoint, log, logged, sown, perturbed_at


def _forward_value_is_the_last_evaluation(adjoint, log, logged, sown):
    """The reaped value is the vector field's last evaluation (debug log);
    returns that evaluation's (t, y)."""
    diffrax_solve(0.5, adjoint, logged)
    jax.effects_barrier()
    t_last, y_last = log[-1]
    d = lh.reap(lambda a: diffrax_solve(a, adjoint, sown), tag="t")(0.5)
    close(d["y"], y_last)
    return t_last, y_last


def test_diffrax_default_adjoint():
    # The checkpointed loop's backward rule re-runs the body: recomputations,
    # not occurrences (SPEC 9). The value and its cotangent are the last
    # forward evaluation's, as under DirectAdjoint, with no extra key (the
    # cotangent was once that of the backward pass's recomputation of the
    # first step, the last evaluation in program order).
    pytest.importorskip("diffrax")
    skip_where_jax_cannot_differentiate_diffrax()
    adjoint, log, logged, sown, perturbed_at = diffrax_case("RecursiveCheckpointAdjoint")
    t_last, y_last = _forward_value_is_the_last_evaluation(adjoint, log, logged, sown)
    grad = jax.grad(lambda a: diffrax_solve(a, adjoint, logged))(0.5)
    out, d = lh.call_and_reap(jax.grad(lambda a: diffrax_solve(a, adjoint, sown)),
                              tag="t")(0.5)
    close(out, grad)
    assert set(d.keys()) == {"y", ("vjp", "y")}
    close(d["y"], y_last)
    expected = jax.grad(perturbed_at(t_last), argnums=1)(0.5, jnp.zeros(2))
    close(d["vjp", "y"], expected)
    assert float(jnp.abs(expected).min()) > 0.01


@skip_where_jax_jits_scan3_wrongly()  # (the plain-JAX solve: scans in its checkpointed loop)
def test_diffrax_direct_adjoint():
    adjoint, log, logged, sown, perturbed_at = diffrax_case("DirectAdjoint")
    t_last, y_last = _forward_value_is_the_last_evaluation(adjoint, log, logged, sown)

    grad = jax.grad(lambda a: diffrax_solve(a, adjoint, logged))(0.5)
    out, d = lh.call_and_reap(jax.grad(lambda a: diffrax_solve(a, adjoint, sown)),
                              tag="t")(0.5)
    close(out, grad)
    close(d["y"], y_last)
    # the cotangent of the last evaluation (a bounded loop: the iterations
    # after the solve has finished take the identity branch)
    expected = jax.grad(perturbed_at(t_last), argnums=1)(0.5, jnp.zeros(2))
    close(d["vjp", "y"], expected)
    assert float(jnp.abs(expected).min()) > 0.01


def test_vmap_cond_branches_it_cannot_cut_are_refused_not_wrong():
    # JAX batches such a cond by running every branch and sowing each one's
    # sites, whatever branch an element takes: the reaped values were silently
    # the last branch's. Now a HarvestError; lh.vmap keeps the cond and is right.
    def in_scan(p, x):
        def hot(v):
            body = lambda c, _: (sow(jnp.sin(c), "s"), None)  # noqa: E731
            return lax.scan(body, v, None, length=2)[0]
        return lax.cond(p > 0, hot, lambda v: sow(v * 2, "s"), x)

    def append_in_one(p, x):
        return lax.cond(p > 0, lambda v: sow(v, "a", mode="append"), lambda v: v, x)

    def strict_orders(p, x):
        two = lambda v, m, n: sow(sow(v, m, "strict") + 1, n, "strict")  # noqa: E731
        return lax.cond(p > 0, lambda v: two(v, "u", "w"), lambda v: two(v, "w", "u"), x)

    P = jnp.array([1., -1., 1.])
    for fn, words in ((in_scan, ["'s'", "higher-order", "lh.vmap"]),
                      (append_in_one, ["'a'", "only some branches", "append"]),
                      (strict_orders, ["different orders"])):
        raises(words, lh.reap(jax.vmap(fn), tag="t"), P, X)
        close(lh.reap(jax.vmap(fn), tag="other")(P, X).compute(), {})  # other tags: inert
        with jax.disable_jit():  # (each element in Python: JAX's own eager cond
            #  jits its branches, and jax 0.12.1 jits a Scan3 wrongly)
            each = jnp.stack([fn(p, x) for p, x in zip(P, X)])
        close(jax.vmap(fn)(P, X), each)
    # lh.vmap keeps the cond: each element's branch, zeros where it sows none
    d = lh.reap(lh.vmap(in_scan), tag="t")(P, X)
    close(d["s"], jnp.where(P > 0, jnp.sin(jnp.sin(X)), 2 * X))


def test_vmap_cond_with_checkpointed_branches_keeps_cotangents_and_plants():
    # Sites inside jax.checkpoint in the branches: the stages look into the
    # checkpoint (run inline), so the site is each element's taken branch.
    def f(p, x, e=None):
        def branch(fn):
            def run(v):
                h = fn(v)
                return (sow(h, "s") if e is None else h + e) ** 2
            return jax.checkpoint(run)
        return lax.cond(p > 0, branch(jnp.sin), branch(lambda v: 3 * v), x)

    P = jnp.array([1., -1., 1.])
    loss = lambda xs: jnp.sum(jax.vmap(f)(P, xs))  # noqa: E731
    d = lh.reap(jax.grad(loss), tag="t")(X)
    close(d["s"], jnp.where(P > 0, jnp.sin(X), 3 * X))
    want = jax.grad(lambda e: jnp.sum(jax.vmap(f)(P, X, e)))(jnp.zeros(3))
    close(d["vjp", "s"], want)
    close(lh.plant(loss, tag="t")({"s": jnp.array([1., 2., 3.])}, X), 14.)
