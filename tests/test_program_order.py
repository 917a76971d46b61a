"""Repeated sows keep program order (SPEC 9): values, tangents and cotangents
of a name sown several times line up occurrence by occurrence, and a
`"clobber"` site's cotangent is that of the occurrence whose value is reaped.

Every expected value is computed with plain JAX: the model written without
`sow`, with a perturbation `eps[i]` added at occurrence `i` (a cotangent is
the gradient with respect to it) and the site values returned (a tangent is
their `jax.jvp`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

R = np.random.RandomState(0)
MS = jnp.asarray(R.standard_normal((4, 2, 2)) * 0.8, jnp.float32)  # one matrix per layer
X = jnp.array([0.4, -0.7])
T_IN = jnp.array([0.3, 1.1])  # a tangent of X
CTS = jnp.asarray(R.standard_normal((4, 2)), jnp.float32)  # a cotangent per occurrence
LAST = 3  # the highest occurrence in program order: the one a clobber site reaps


def _layer(h, m):
    """The value a layer sows."""
    return jnp.tanh(m @ h) + 0.5 * h


def _after(v):
    """The layer's output, from its sown value (nonlinear: a backward pass needs
    the value, so jax.checkpoint rematerializes it)."""
    return jnp.sin(v) * v


def _out(h):
    return jnp.sum(jnp.sin(h) * h)


# --- the model with sites, several ways of repeating the layer --------------------

def _lh_layer(mode):
    return lambda h, m: _after(lh.sow(_layer(h, m), tag="t", name="h", mode=mode))


def _loop(layer, h):
    for m in MS:
        h = layer(h, m)
    return h


def _scan(layer, h, reverse=False):
    return lax.scan(lambda c, m: (layer(c, m), None), h, MS, reverse=reverse)[0]


def _every_other(layer, h):
    remat = jax.checkpoint(layer)
    for i, m in enumerate(MS):
        h = (remat if i % 2 == 0 else layer)(h, m)
    return h


def _two_at_a_time(layer, h):
    two = jax.checkpoint(lambda h, m1, m2: layer(layer(h, m1), m2))
    return two(two(h, MS[0], MS[1]), MS[2], MS[3])


STRUCTURES = {
    # name: (h -> h given the layer, order the layers run in)
    "python_loop": (_loop, range(4)),
    "jit_layer": (lambda layer, h: _loop(jax.jit(layer), h), range(4)),
    "lh_jit_layer": (lambda layer, h: _loop(lh.jit(layer), h), range(4)),
    "jit_of_jit_layer": (lambda layer, h: jax.jit(lambda h: _loop(jax.jit(layer), h))(h),
                         range(4)),
    **{f"checkpoint_layer_{name}": (
        (lambda p: lambda layer, h: _loop(jax.checkpoint(layer, policy=p), h))(p),
        range(4)) for name, p in POLICIES.items()},
    "jit_checkpoint_layer": (lambda layer, h: _loop(jax.jit(jax.checkpoint(layer)), h),
                             range(4)),
    "checkpoint_every_other_layer": (_every_other, range(4)),
    "checkpoint_of_checkpoint_layer": (
        lambda layer, h: _loop(jax.checkpoint(jax.checkpoint(layer)), h), range(4)),
    "checkpoint_two_layers": (_two_at_a_time, range(4)),
    "scan": (_scan, range(4)),
    "scan_reverse": (lambda layer, h: _scan(layer, h, reverse=True), range(3, -1, -1)),
    "scan_of_checkpoint": (
        lambda layer, h: lax.scan(jax.checkpoint(lambda c, m: (layer(c, m), None)),
                                  h, MS)[0], range(4)),
    "checkpoint_of_scan": (lambda layer, h: jax.checkpoint(lambda h: _scan(layer, h))(h),
                           range(4)),
    "scan_between_sows": (
        lambda layer, h: layer(lax.scan(lambda c, m: (layer(c, m), None),
                                        layer(h, MS[0]), MS[1:3])[0], MS[3]),
        range(4)),
    "scan_of_two_steps": (
        lambda layer, h: lax.scan(lambda c, ms: (layer(layer(c, ms[0]), ms[1]), None),
                                  h, MS.reshape(2, 2, 2, 2))[0], range(4)),
}


def model(structure, mode):
    run, _ = STRUCTURES[structure]
    return lambda x: _out(run(_lh_layer(mode), x))


# --- the same model in plain JAX --------------------------------------------------

def oracle(structure, x, eps):
    """(output, site values by occurrence) with `eps[i]` added at occurrence i."""
    _, order = STRUCTURES[structure]
    h, values = x, [None] * 4
    for i in order:
        values[i] = _layer(h, MS[i]) + eps[i]
        h = _after(values[i])
    return _out(h), jnp.stack(values)


def cotangents(structure, x):
    return jax.grad(lambda e: oracle(structure, x, e)[0])(jnp.zeros((4, 2)))


def values(structure, x):
    return oracle(structure, x, jnp.zeros((4, 2)))[1]


def reaped(mode, values):
    """What a site of `mode` reaps of the values of its occurrences."""
    return values if mode == "append" else values[LAST]


@pytest.fixture(params=sorted(STRUCTURES))
def structure(request):
    return request.param


@pytest.fixture(params=["append", "clobber"])
def mode(request):
    return request.param


# --- values and tangents ----------------------------------------------------------

def test_repeated_sow_values_and_tangents_in_program_order(structure, mode):
    f = model(structure, mode)
    d = lh.reap(f, tag="t")(X)
    close(d["h"], reaped(mode, values(structure, X)))
    d = lh.reap(lambda x: jax.jvp(f, (x,), (T_IN,)), tag="t")(X)
    tangents = jax.jvp(lambda x: values(structure, x), (X,), (T_IN,))[1]
    close(d["h"], reaped(mode, values(structure, X)))
    close(d["jvp", "h"], reaped(mode, tangents))


# --- cotangents ---------------------------------------------------------------------

def test_repeated_append_cotangents_in_program_order(structure):
    f = model(structure, "append")
    d = lh.reap(jax.grad(f), tag="t")(X)
    close(d["h"], values(structure, X))
    close(d["vjp", "h"], cotangents(structure, X))
    d = lh.reap(lambda x: jax.vjp(f, x)[1](2.), tag="t")(X)
    close(d["vjp", "h"], 2. * cotangents(structure, X))


def test_clobber_cotangent_is_the_reaped_occurrences(structure):
    f = model(structure, "clobber")
    d = lh.reap(jax.grad(f), tag="t")(X)
    close(d["h"], values(structure, X)[LAST])
    close(d["vjp", "h"], cotangents(structure, X)[LAST])


def test_reaped_backward_function_cotangents_in_program_order(structure, mode):
    _, bwd = jax.vjp(model(structure, mode), X)
    d = lh.reap(bwd, tag="t")(2.)
    close(d["h"], reaped(mode, 2. * cotangents(structure, X)))


def test_two_append_sows_cotangents_in_program_order():
    def f(x):
        return jnp.sum(lh.sow(x, tag="t", name="v", mode="append") * 10
                       + lh.sow(2 * x, tag="t", name="v", mode="append") * 100)
    x = jnp.ones(2)
    expected = jax.grad(lambda e: jnp.sum((x + e[0]) * 10 + (2 * x + e[1]) * 100))(
        jnp.zeros((2, 2)))
    close(expected, [[10., 10.], [100., 100.]])
    close(lh.reap(jax.grad(f), tag="t")(x)["vjp", "v"], expected)
    close(lh.reap(jax.vjp(f, x)[1], tag="t")(1.)["v"], expected)
    d = lh.reap(jax.jit(jax.grad(f)), tag="t")(x)
    close(d["vjp", "v"], expected)
    close(d["v"], [x, 2 * x])


# --- planting cotangents --------------------------------------------------------------

def test_planted_append_cotangent_goes_to_its_occurrence(structure):
    f = model(structure, "append")
    _, bwd = jax.vjp(f, X)
    got = lh.plant(bwd, tag="t")({"h": CTS}, 2.)[0]
    _, full = jax.vjp(lambda x: oracle(structure, x, jnp.zeros((4, 2))), X)
    close(got, full((2., CTS))[0])


def test_planted_clobber_cotangent_goes_to_the_reaped_occurrence(structure):
    f = model(structure, "clobber")
    _, bwd = jax.vjp(f, X)
    got = lh.plant(bwd, tag="t")({"h": CTS[0]}, 2.)[0]
    _, full = jax.vjp(lambda x: (lambda o, v: (o, v[LAST]))(
        *oracle(structure, x, jnp.zeros((4, 2)))), X)
    close(got, full((2., CTS[0]))[0])


def test_cotangent_planted_inside_grad_goes_to_its_occurrence(structure, mode):
    f = model(structure, mode)
    ct = CTS if mode == "append" else CTS[0]
    got = lh.plant(jax.grad(f), tag="t")({("vjp", "h"): ct}, X)
    want = jax.grad(lambda x: (lambda o, v: o + jnp.sum(ct * reaped(mode, v)))(
        *oracle(structure, x, jnp.zeros((4, 2)))))(X)
    close(got, want)


# --- loops run in Python ---------------------------------------------------------------

def test_scan_under_disable_jit_keeps_program_order(mode):
    f = model("scan", mode)
    with jax.disable_jit():
        d = lh.reap(jax.grad(f), tag="t")(X)
        got_values, got_cts = d["h"], d["vjp", "h"]
        _, bwd = jax.vjp(f, X)
        got_bwd = lh.reap(bwd, tag="t")(1.)["h"]
    close(got_values, reaped(mode, values("scan", X)))
    close(got_cts, reaped(mode, cotangents("scan", X)))
    close(got_bwd, reaped(mode, cotangents("scan", X)))


# --- planting an append site under jax.checkpoint + grad ---------------------------------

P = jnp.array([[1., 2.], [3., -1.]])


def _two_sows(site):
    def f(x):
        a = site(jnp.sin(x) * x, 0)
        b = site(a * jnp.cos(x) + x, 1)
        return jnp.sum(b * a + jnp.tanh(b))
    return f


def _planted_grad(x):
    # A planted primal value replaces the sown one; the derivative still flows
    # through the site (docs/semantics.md section 5): value P[i], derivative 1.
    site = lambda v, i: v + lax.stop_gradient(P[i] - v)  # noqa: E731
    return jax.grad(_two_sows(site))(x)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_plant_append_under_checkpoint_grad(policy):
    f = _two_sows(lambda v, i: lh.sow(v, tag="t", name="a", mode="append"))
    x = jnp.array([.3, .7])
    want = _planted_grad(x)
    close(lh.plant(jax.grad(f), tag="t")({"a": P}, x), want)
    g = jax.grad(jax.checkpoint(f, policy=POLICIES[policy]))
    close(lh.plant(g, tag="t")({"a": P}, x), want)


def _planted(structure, mode, plant):
    """The model with each occurrence's value replaced by its plant (an append
    plant: its row; a clobber plant: every occurrence), the derivative flowing
    through the site as through the identity."""
    def fn(x):
        _, order = STRUCTURES[structure]
        h = x
        for i in order:
            v = _layer(h, MS[i])
            h = _after(v + lax.stop_gradient((plant[i] if mode == "append" else plant) - v))
        return _out(h)
    return fn


def _plant_for(mode):
    plants = jnp.asarray(np.random.RandomState(1).standard_normal((4, 2)), jnp.float32)
    return plants if mode == "append" else plants[0]


def test_plant_repeated_layer_in_program_order(structure, mode):
    plant = _plant_for(mode)
    got = lh.plant(model(structure, mode), tag="t")({"h": plant}, X)
    close(got, _planted(structure, mode, plant)(X))


def test_plant_under_grad_repeated_layer(structure, mode):
    plant = _plant_for(mode)
    got = lh.plant(jax.grad(model(structure, mode)), tag="t")({"h": plant}, X)
    close(got, jax.grad(_planted(structure, mode, plant))(X))


def test_vmap_of_grad_of_checkpointed_cond_sows_once():
    # Each branch pairs its rematerialized copies with its originals by a token
    # of its own; a cond with a batched predicate still lifts its sites and
    # sows them once.
    def site(u):
        return lax.cond(jnp.sum(u) > 0, lambda u: lh.sow(u + 0.3, tag="t", name="s"),
                        lambda u: lh.sow(u * u, tag="t", name="s"), u)

    def value(u):
        return jnp.where(jnp.sum(u) > 0, u + 0.3, u * u)

    f = lambda x: jnp.sum(jnp.sin(jax.checkpoint(site)(x * 2)))  # noqa: E731
    xb = jnp.array([[0.3, -0.2, 0.5], [-0.3, -0.2, 0.1]])
    d = lh.reap(jax.vmap(jax.grad(f)), tag="t")(xb)
    close(d["s"], jax.vmap(lambda x: value(x * 2))(xb))
    close(d["vjp", "s"], jnp.cos(jax.vmap(lambda x: value(x * 2))(xb)))


@pytest.mark.parametrize("structure", ["python_loop", "jit_layer", "checkpoint_layer_default",
                                       "scan_between_sows", "scan_reverse"])
def test_law5_holds_for_repeated_sites(structure, mode):
    from lazyharvest import testing
    testing.check_vjp(model(structure, mode), X, tag="t")  # (a): every key

    def two(x):
        return jnp.sum(lh.sow(jnp.sin(x), tag="t", name="v", mode=mode) * 10
                       + lh.sow(2 * x, tag="t", name="v", mode=mode) ** 2)
    # (b) for an append site whose occurrences do not feed each other (a clobber
    # plant replaces every occurrence: its gradient sums their cotangents)
    testing.check_vjp(two, X, tag="t", keys=["v"] if mode == "append" else None)


# --- a clobber cotangent from a later backward pass ----------------------------------

def _inner_loss(v, e=0.):
    """The function each inner `jax.grad` differentiates; `e` perturbs its site."""
    return jnp.sum((jnp.sin(v) + e) ** 2)


def _sown_inner_loss(v):
    return jnp.sum(lh.sow(jnp.sin(v), tag="t", name="c", mode="clobber") ** 2)


def _site_cotangent(v):
    """d inner loss / d site at input `v`, by perturbation (plain JAX)."""
    return jax.grad(lambda e: _inner_loss(v, e))(jnp.zeros_like(v))


@pytest.mark.parametrize("where", ["straight", "scan", "cond"])
def test_clobber_cotangent_of_a_later_backward_pass_replaces_an_earlier_one(where):
    # Each jax.grad in the program runs its own backward pass. A clobber
    # cotangent kept the first pass's occurrence (that of the sow *before*
    # a later grad, a scan body or a cond branch that differentiates again);
    # the reaped one is that of the last occurrence in program order.
    grad_in = jax.grad(_sown_inner_loss)
    grad_plain = jax.grad(_inner_loss)

    def program(x, inner):
        y = inner(x)
        if where == "straight":
            return inner(2 * y), 2 * y
        if where == "scan":
            def body(c, k):
                return c + inner(c * k), c * k
            c, ins = lax.scan(body, y, jnp.arange(1., 4.))
            return c, ins[-1]
        return lax.cond(jnp.sum(y) > -9., lambda c: (c + inner(c * 3), c * 3),
                        lambda c: (c, c), y)

    out, last_input = program(X, grad_plain)
    d = lh.reap(lambda x: program(x, grad_in)[0], tag="t")(X)
    close(d["vjp", "c"], _site_cotangent(last_input))
    close(d["c"], jnp.sin(last_input))
    close(program(X, grad_in)[0], out)
