"""Plants under custom rules, then differentiated (SPEC 9, "Plants and custom
rules").

`jax.grad(lh.plant(f))` where `f` solves an ODE with a library whose adjoint is
a `custom_vjp` (diffrax, `jax.experimental.ode.odeint`): the user's rules run
on the planted program, so a rule that re-runs or differentiates the dynamics
sees the planted value. Expected values: the program written with the planted
value in place of the site, differentiated by plain JAX.
"""

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from helpers import (
    close,
    skip_where_jax_cannot_differentiate_diffrax,
    skip_where_jax_jits_scan3_wrongly,
)
from lazyharvest import _jax

# a rule's functions are replaced through the custom call's hook (docs/compat.md)
pytestmark = pytest.mark.skipif(
    not _jax.CUSTOM_CALL_HOOKS, reason="a custom call's functions are hookable on jax >= 0.9")

THETA = jnp.float32(0.7)
Y0 = jnp.array([1., 2.])
H = jnp.array([0.3, -0.2])

# (dynamics with a site, the planted program's dynamics): the site is the
# whole vector field (the planted program no longer reads theta), or scaled
VARIANTS = {
    "site": (lambda y, th: lh.sow(-y * th, tag="ode", name="h", mode="clobber"),
             lambda y, th: H + 0. * y),
    "site_times_theta": (lambda y, th: lh.sow(-y * th, tag="ode", name="h",
                                              mode="clobber") * th,
                         lambda y, th: H * th + 0. * y),
}


def _check(loss, variant):
    with_site, planted = VARIANTS[variant]
    plant = lambda th: lh.plant(lambda t: loss(with_site, t), tag="ode")({"h": H}, th)
    close(plant(THETA), loss(planted, THETA), atol=1e-4)
    close(jax.grad(plant)(THETA), jax.grad(lambda th: loss(planted, th))(THETA), atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"])
def test_grad_of_a_planted_diffrax_solve(adjoint, variant):
    diffrax = pytest.importorskip("diffrax")
    skip_where_jax_cannot_differentiate_diffrax(adjoint)

    def loss(vf, th):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: vf(y, a)), diffrax.Tsit5(), 0., 0.5, 0.1, Y0,
            args=th, stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=getattr(diffrax, adjoint)())
        return jnp.sum(sol.ys)
    _check(loss, variant)


@skip_where_jax_jits_scan3_wrongly()  # (odeint's plain-JAX reference)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_grad_of_a_planted_odeint(variant):
    from jax.experimental.ode import odeint

    def loss(f, th):
        return jnp.sum(odeint(lambda y, t, a: f(y, a), Y0, jnp.array([0., 0.5]), th)[-1])
    _check(loss, variant)


def test_a_checkpointing_rule_recomputes_the_planted_program():
    # a small custom_vjp that saves only its input and re-runs the body
    # under jax.vjp in its backward rule
    def body(w, x):
        return jnp.tanh(w * lh.sow(jnp.sin(w * x), tag="t", name="h"))

    @jax.custom_vjp
    def f(w, x):
        return body(w, x)
    f.defvjp(lambda w, x: (body(w, x), (w, x)),
             lambda r, g: jax.vjp(body, *r)[1](g))

    def planted_program(w, x):
        return jnp.tanh(w * 0.4)
    grad = jax.grad(lambda w: lh.plant(f, tag="t")({"h": jnp.float32(0.4)}, w, 1.3))(0.8)
    close(grad, jax.grad(planted_program)(0.8, 1.3))


def test_a_rule_that_does_not_run_the_function_stays_in_force():
    # SPEC 9: the user's rule is kept for the outputs; a rule that never
    # sows cannot see the plant (docs/semantics.md section 12)
    @jax.custom_vjp
    def f(x):
        return jnp.sin(lh.sow(2. * x, tag="t", name="h"))
    f.defvjp(lambda x: (jnp.sin(2. * x), x), lambda x, g: (g * 2. * jnp.cos(2. * x),))
    grad = jax.grad(lambda x: lh.plant(f, tag="t")({"h": 0.3}, x))(0.5)
    close(grad, 2. * jnp.cos(1.))


def _scan_of_a_planted_rule():
    def prim(u):
        return jnp.tanh(lh.sow(jnp.sin(u), tag="t", name="s0", mode="append"))
    rule = jax.custom_vjp(prim)
    rule.defvjp(lambda u: (jnp.tanh(jnp.sin(u)), u),
                lambda u, ct: ((1 - jnp.tanh(jnp.sin(u)) ** 2) * jnp.cos(u) * ct,))

    def f(x):
        def body(c, xi):
            u = rule(c)
            return 0.5 * c + jnp.tanh(u), jnp.sum(u)
        return jnp.sum(jax.lax.scan(body, x, x)[1])
    x = jnp.array([0.3, 0.5, 0.7])
    return f, x, lh.reap(f, tag="t")(x)["s0"]


def test_reverse_mode_of_a_plant_in_a_rule_in_a_scan():
    # (reverse mode, the supported one) the plant is a constant for the rule:
    # the program with the planted value in place of the site, whose rule
    # differentiates only its input, has a zero gradient in the plant
    f, x, value = _scan_of_a_planted_rule()
    got = jax.grad(lambda p: lh.plant(f, tag="t")({"s0": p}, x))(value)
    close(got, jnp.zeros_like(value))


def test_regression_forward_mode_of_a_plant_in_a_rule_in_a_scan_after_reverse_mode():
    # (found by law 5's wide run) plain JAX refuses forward mode through a
    # custom_vjp call with a TypeError (so does the planted program, traced
    # alone); after reverse mode it raised "foreach() argument 2 is shorter":
    # the planted call's residuals had a structure per perturbation pattern,
    # and JAX keeps one per call
    f, x, value = _scan_of_a_planted_rule()
    jax.grad(lambda p: lh.plant(f, tag="t")({"s0": p}, x))(value)
    with pytest.raises(TypeError):
        jax.jvp(lambda p: lh.plant(f, tag="t")({"s0": p}, x), (value,), (value,))


def test_regression_reverse_mode_of_a_plant_in_a_rule_in_a_scan_after_another_pattern():
    # the same reuse in reverse mode: differentiated in the plant and the
    # input, then (vmapped, so JAX traces the scan's body again) in the plant
    # alone, the pattern met first: it read the other pattern's residuals
    # (an AssertionError in JAX's rule). With the planted value equal to the
    # site's, the planted program's input gradient is the program's.
    f, x, value = _scan_of_a_planted_rule()
    planted = lambda p, x: lh.plant(f, tag="t")({"s0": p}, x)
    g_p, g_x = jax.grad(planted, (0, 1))(value, x)
    close(g_p, jnp.zeros_like(value))
    close(g_x, jax.grad(f)(x))
    got = jax.vmap(jax.grad(planted), (0, None))(jnp.stack([value, value]), x)
    close(got, jnp.zeros((2,) + value.shape))


def _recomputing_layer(sow):
    """`u -> tanh(sow(sin(u))) * u` whose backward rule re-runs it (a
    checkpointing rule), site included."""
    prim = lambda u: jnp.tanh(sow(jnp.sin(u))) * u  # noqa: E731
    rule = jax.custom_vjp(prim)
    rule.defvjp(lambda u: (prim(u), u), lambda u, ct: jax.vjp(prim, u)[1](ct))
    return rule


@pytest.mark.parametrize("loop", ["python", "scan"])
def test_regression_an_append_plant_reaches_a_recomputing_rule_row_by_row(loop):
    # (the wide law-6 run) an append site sown once per call of a recomputing
    # rule, the call repeated: the rule re-ran the body with the site's own
    # value (append plants were not applied inside rules), so the gradient
    # was neither the planted program's nor zero where that is zero
    layer = _recomputing_layer(lambda v: lh.sow(v, tag="t", name="s", mode="append"))

    def f(x, layer=layer):
        if loop == "python":
            for _ in range(3):
                x = layer(x) * 0.9 + 0.1
            return jnp.sum(x ** 2)
        step = lambda h, _: (layer(h) * 0.9 + 0.1, None)  # noqa: E731
        return jnp.sum(jax.lax.scan(step, x, None, length=3)[0] ** 2)

    def planted(x, rows):  # the program with row i in place of occurrence i
        for r in rows:
            x = jnp.tanh(r) * x * 0.9 + 0.1
        return jnp.sum(x ** 2)

    x = jnp.array([0.3, -0.5, 0.8])
    rows = jnp.array([[0.2, 0.4, -0.1], [0.5, -0.3, 0.9], [-0.7, 0.1, 0.3]])
    got = jax.grad(lambda x, p: lh.plant(f, tag="t")({"s": p}, x), argnums=(0, 1))(x, rows)
    want = jax.grad(planted, argnums=(0, 1))(x, rows)
    close(got[0], want[0], atol=1e-5)
    close(got[1], want[1], atol=1e-5)  # the cotangent the rule gives each row
