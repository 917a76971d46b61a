"""Cotangents belong to their occurrence, however many backward passes run.

Every expected value is computed with plain JAX: a zero perturbation `eps`
added where the site is, differentiated with respect to `eps`.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

X = jnp.array([0.3, 0.7])
Q0 = jnp.array([0.4, -0.2])


def _inner_loss(w, x, sow):
    h = x
    for i in range(2):
        h = sow(jnp.sin(w * h), i)
    return jnp.sum(h ** 2)


def _loss(w, x):
    return _inner_loss(w, x, lambda v, i: lh.sow(v, tag="t", name="h", mode="append"))


def _loss_eps(w, x, eps):
    return _inner_loss(w, x, lambda v, i: v + eps[i])


@pytest.mark.parametrize("jit", [False, True])
def test_python_loop_of_grad_steps_pairs_each_cotangent_with_its_step(jit):
    grad = jax.jit(jax.grad(_loss)) if jit else jax.grad(_loss)

    def train(w, x):
        for _ in range(3):
            w = w - 0.1 * grad(w, x)
        return w

    d = lh.reap(train, tag="t")(1.5, X)
    w, vals, cts = 1.5, [], []
    for _ in range(3):
        zero = jnp.zeros((2, 2))
        cts.append(jax.grad(_loss_eps, argnums=2)(w, X, zero))
        h = X
        for _i in range(2):
            h = jnp.sin(w * h)
            vals.append(h)
        w = w - 0.1 * jax.grad(_loss_eps)(w, X, zero)
    close(d["h"], jnp.stack(vals))
    close(d["vjp", "h"], jnp.concatenate(cts))


def _u(q, sow):
    # squared: the site's cotangent depends on the state, so rows out of
    # order show (a plain sum gives every occurrence a cotangent of one)
    return jnp.sum(sow(jnp.cos(q) * q) ** 2)


def _hmc(q):
    """As an HMC sampler: the initial state's gradient, then one per step."""
    u = lambda q: _u(q, lambda v: lh.sow(v, tag="t", name="u", mode="append"))  # noqa: E731
    g = jax.grad(u)(q)

    def step(c, _):
        q, g = c
        q = q - 0.1 * g
        return (q, jax.grad(u)(q)), None
    return lax.scan(step, (q, g), None, length=3)[0][0]


def test_grad_before_and_inside_a_scan_pairs_cotangents_in_program_order():
    d = lh.reap(jax.jit(_hmc), tag="t")(Q0)
    u_eps = lambda q, e: _u(q, lambda v: v + e)
    qs, q = [Q0], Q0
    g = jax.grad(u_eps)(q, 0.)
    for _ in range(3):
        q = q - 0.1 * g
        qs.append(q)
        g = jax.grad(u_eps)(q, 0.)
    close(d["u"], jnp.stack([jnp.cos(q) * q for q in qs]))
    close(d["vjp", "u"], jnp.stack([jax.grad(u_eps, argnums=1)(q, jnp.zeros(2))
                                    for q in qs]))


def _v(q, sow):
    return jnp.sum(sow(jnp.sin(q) * q) ** 2)


@pytest.mark.parametrize("before", [False, True])
def test_clobber_cotangent_is_the_last_evaluations_across_scan_of_while_of_grads(before):
    # as a NUTS sampler: a grad, then a scan whose body runs a while loop of grads
    v = lambda q: _v(q, lambda x: lh.sow(x, tag="t", name="v", mode="clobber"))

    def nuts(q):
        g = jax.grad(v)(q) if before else jnp.zeros_like(q)

        def step(c, _):
            def body(s):
                i, q, g = s
                q = q - 0.05 * g
                return i + 1, q, jax.grad(v)(q)
            return lax.while_loop(lambda s: s[0] < 2, body, (0, *c))[1:], None
        return lax.scan(step, (q, g), None, length=2)[0][0]

    d = lh.reap(nuts, tag="t")(Q0)
    v_eps = lambda q, e: _v(q, lambda x: x + e)
    q = Q0
    g = jax.grad(v_eps)(q, 0.) if before else jnp.zeros_like(q)
    for _ in range(4):
        q = q - 0.05 * g
        g = jax.grad(v_eps)(q, 0.)
    close(d["v"], jnp.sin(q) * q)
    close(d["vjp", "v"], jax.grad(v_eps, argnums=1)(q, jnp.zeros(2)))


def test_compute_is_a_pytree_when_a_name_is_also_a_label_or_a_scope():
    def f(x):
        a = lh.sow(x * 2, tag="t", name="vjp")
        b = lh.nest(lambda v: lh.sow(v * 3, tag="t", name="q"), scope="s")(a)
        return jnp.sum(lh.sow(b * x, tag="t", name="s"))

    out = jax.jit(lambda x: lh.reap(jax.grad(f), tag="t")(x).compute())(1.)
    jax.tree_util.tree_structure(out)  # string keys only: a valid pytree
    close(out["vjp"][""], 2.)                  # the site named "vjp"
    close(out["s"][""], 6.)                    # the site named like the scope
    close(out["s"]["q"], 6.)
    eps = lambda e: jnp.sum(((1. * 2 + e[0]) * 3 + e[1]) * 1. + e[2])
    g = jax.grad(eps)(jnp.zeros(3))
    close(out["vjp"]["vjp"], g[0])
    close(out["vjp"]["s"][""], g[2])
    close(out["vjp"]["s"]["q"], g[1])


@pytest.mark.parametrize("nondiff", [True, False])
def test_a_custom_jvp_rule_that_calls_its_function_sows_once(nondiff):
    # the rule's site is sown where JAX runs the rule; the call of the
    # function inside the rule adds no occurrence of it
    if nondiff:
        fn = jax.custom_jvp(lambda n, x: jnp.sin(x) * n, nondiff_argnums=(0,))

        def rule(n, p, t):
            c = lh.sow(jnp.cos(p[0]), tag="t", name="c")
            return fn(n, p[0]), c * n * t[0]
    else:
        fn = jax.custom_jvp(lambda n, x: jnp.sin(x) * n)

        def rule(p, t):
            c = lh.sow(jnp.cos(p[1]), tag="t", name="c")
            return fn(*p), c * p[0] * t[1]
    fn.defjvp(rule)
    d = lh.reap(jax.grad(lambda x: fn(2., x)), tag="t")(0.5)
    assert set(d.keys()) == {"c"}
    close(d["c"], jnp.cos(0.5))


def test_custom_root_under_grad_uses_the_implicit_rule():
    # custom_root's rule evaluates the traced function (no `sow` call): its
    # sows were not seen, so a copy of the solver was differentiated, and JAX
    # refused to reverse its while loop
    def newton(f, x0):
        def body(c):
            x, i = c
            return x - f(x) / jax.grad(f)(x), i + 1
        return lax.while_loop(lambda c: (c[1] < 20) & (jnp.abs(f(c[0])) > 1e-6),
                              body, (x0, 0))[0]

    def loss(a, sow, eps=0., eps_f=0.):
        def f(x):
            return sow(x ** 2 - a, "fin") + eps_f
        x = lax.custom_root(f, 1.0, newton, lambda g, y: y / g(1.0))
        return jnp.sin(sow(x * a, "after") + eps)
    sown = lambda v, name: lh.sow(v, tag="t", name=name, mode="clobber")
    plain = lambda v, name: v
    # (jax >= 0.12 stages custom_root as a high-level primitive, CustomRoot,
    # with every flag off: its sites are harvested through its implementation)
    d = lh.reap(jax.grad(lambda a: loss(a, sown)), tag="t")(2.)
    close(d["after"], 2. * jnp.sqrt(2.))
    close(d["vjp", "after"], jax.grad(lambda e: loss(2., plain, eps=e))(0.))
    # through the implicit-function rule: f(x) + e = 0 moves the root
    close(d["vjp", "fin"], jax.grad(lambda e: loss(2., plain, eps_f=e))(0.), atol=1e-4)
    close(jax.grad(lambda a: loss(a, sown))(2.), jax.grad(lambda a: loss(a, plain))(2.))


# --- cotangent plants over several backward passes: row i goes to occurrence i ---

C_ROWS = jnp.arange(12.).reshape(6, 2) / 10.  # one planted cotangent per occurrence


@pytest.mark.parametrize("jit", [False, True])
def test_python_loop_of_grad_steps_takes_each_planted_cotangent_at_its_step(jit):
    grad = jax.jit(jax.grad(_loss)) if jit else jax.grad(_loss)

    def train(w, x):
        for _ in range(3):
            w = w - 0.1 * grad(w, x)
        return w

    got = lh.plant(train, tag="t")({("vjp", "h"): C_ROWS}, 1.5, X)
    # plain JAX: a cotangent c added at an occurrence h is the gradient of
    # loss + <c, h> (rows 2s, 2s+1 belong to step s)
    w = 1.5
    for s in range(3):
        step_loss = lambda w, s=s: _loss_eps(w, X, jnp.zeros((2, 2))) + sum(
            jnp.vdot(C_ROWS[2 * s + i], h) for i, h in enumerate(_hs(w, X)))
        w = w - 0.1 * jax.grad(step_loss)(w)
    close(got, w)


def _hs(w, x):
    """The values `_inner_loss` sows, in order."""
    hs: list = []
    _inner_loss(w, x, lambda v, i: hs.append(v) or v)
    return hs


def test_grad_before_and_inside_a_scan_takes_each_planted_cotangent():
    cts = C_ROWS[:4]
    got = lh.plant(jax.jit(_hmc), tag="t")({("vjp", "u"): cts}, Q0)
    u_ct = lambda q, c: _u(q, lambda v: v) + jnp.vdot(c, jnp.cos(q) * q)
    q = Q0
    g = jax.grad(u_ct)(q, cts[0])
    for i in range(3):
        q = q - 0.1 * g
        g = jax.grad(u_ct)(q, cts[i + 1])
    close(got, q)


def test_python_loop_of_grad_steps_adds_a_clobber_cotangent_at_the_last_occurrence():
    sown = lambda v, i: lh.sow(v, tag="t", name="h", mode="clobber")

    def train(w, x):
        for _ in range(3):
            w = w - 0.1 * jax.grad(lambda w: _inner_loss(w, x, sown))(w)
        return w

    c = jnp.array([0.5, -1.])
    got = lh.plant(train, tag="t")({("vjp", "h"): c}, 1.5, X)
    w = 1.5
    for s in range(3):  # only the last step's last occurrence takes it
        extra = (lambda w: jnp.vdot(c, _hs(w, X)[1])) if s == 2 else (lambda w: 0.)
        w = w - 0.1 * jax.grad(lambda w: _loss_eps(w, X, jnp.zeros((2, 2))) + extra(w))(w)
    close(got, w)
