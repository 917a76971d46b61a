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
from helpers import close
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

    def loss(vf, th):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: vf(y, a)), diffrax.Tsit5(), 0., 0.5, 0.1, Y0,
            args=th, stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=getattr(diffrax, adjoint)())
        return jnp.sum(sol.ys)
    _check(loss, variant)


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
