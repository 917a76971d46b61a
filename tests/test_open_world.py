"""Programs with constructs lazyharvest has no rule for (issue 33, "Open
world"): a higher-order primitive of a library (a toy one defined here,
lineax's `linear_solve`) or JAX's high-level primitives (the `jax_*3` flags).

A site inside one that the harvest's `allowlist`/`blocklist` leaves out is
the identity and blocks nothing: the eqn is kept as it is (its sites stay
sites, for harvests outside this one), the sites outside it are reaped and
planted, with their cotangents, and a plant for the filtered-out name is
ignored (SPEC section 9). Only a site the harvest takes raises, naming the
primitive, where it comes from, the site and what to do.

Expected values are the same programs written in plain JAX (cotangents by
the zero-perturbation trick: d out / d eps at eps = 0, eps added at the site).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close, jax_flag, jax_jits_scan3_wrongly, skip_where_jax_jits_scan3_wrongly
from lazyharvest import _jax
from lazyharvest._interpreter import sub_jaxprs
from lazyharvest.primitive import sow_p

# --- a toy higher-order primitive: calls its `body` (a ClosedJaxpr) ----------------

toy_call_p = _jax.Primitive("open_toy_call")
toy_call_p.multiple_results = True


def _toy_impl(*args, body):
    return _jax.eval_jaxpr(body.jaxpr, body.consts, *args)


def _toy_abstract_eval(*avals, body):
    return body.out_avals, _jax.effects_of(body.jaxpr)  # (a harvested site's effect)


def _toy_jvp(primals, tangents, *, body):
    # The primitive stays in the primal computation (so it is in the programs
    # of jax.grad too); the tangents are the body's, inlined.
    outs = toy_call_p.bind(*primals, body=body)
    tangents = [_jax.ad.instantiate_zeros(t) for t in tangents]
    _, outs_dot = jax.jvp(lambda *a: _toy_impl(*a, body=body), list(primals), tangents)
    return outs, outs_dot


toy_call_p.def_impl(_toy_impl)
toy_call_p.def_effectful_abstract_eval(_toy_abstract_eval)
_jax.ad.primitive_jvps[toy_call_p] = _toy_jvp
_jax.mlir.register_lowering(toy_call_p, _jax.mlir.lower_fun(_toy_impl, multiple_results=True))


def toy_call(f, *args):
    jaxpr, consts = _jax.trace_flat(lambda *a: list(f(*a)), [jax.typeof(a) for a in args])
    return toy_call_p.bind(*args, body=_jax.ClosedJaxpr(jaxpr, consts))


def _sow(x, name):
    return lh.sow(x, tag="t", name=name)


def model(x):
    u = _sow(x * 3.0, "before")
    (y,) = toy_call(lambda v: [_sow(jnp.sin(v), "inside") * 2.0], u)
    return jnp.cos(_sow(y, "after"))


def plain(x, e_before=0.0, e_after=0.0):
    """`model` in plain JAX, perturbed at its sites outside the primitive."""
    return jnp.cos(2.0 * jnp.sin(x * 3.0 + e_before) + e_after)


X = 0.4
LEAVE_OUT_INSIDE = [{"allowlist": ["before", "after"]}, {"blocklist": ["inside"]},
                    {"allowlist": [("after",), "before"]}]


def _eqns(jaxpr):
    """Every eqn of `jaxpr`, at any depth."""
    for e in jaxpr.eqns:
        yield e
        for j in sub_jaxprs(e.params):
            yield from _eqns(j)


def _has_toy_call(jaxpr):
    return any(e.primitive is toy_call_p for e in _eqns(jaxpr))


@pytest.mark.parametrize("filters", LEAVE_OUT_INSIDE)
@pytest.mark.parametrize("jit", [False, True])
def test_a_site_filtered_out_inside_a_primitive_without_a_rule_is_the_identity(filters, jit):
    f = jax.jit(model) if jit else model
    out, d = lh.call_and_reap(f, tag="t", **filters)(X)
    close(out, plain(X))
    assert set(d) == {"before", "after"}
    close(d["before"], 3 * X)
    close(d["after"], 2 * jnp.sin(3 * X))
    grad, g = lh.call_and_reap(jax.grad(f), tag="t", **filters)(X)
    assert _has_toy_call(jax.make_jaxpr(jax.grad(f))(X).jaxpr)
    close(grad, jax.grad(plain)(X))
    close(g["before"], 3 * X)
    e_before, e_after = jax.grad(plain, argnums=(1, 2))(X, 0.0, 0.0)
    close(g["vjp", "before"], e_before)
    close(g["vjp", "after"], e_after)


def test_the_filtered_out_site_stays_in_the_primitive_for_harvests_outside():
    def harvested(x):
        return lh.call_and_reap(model, tag="t", blocklist=["inside"])(x)[0]

    closed = jax.make_jaxpr(harvested)(X)
    calls = [e for e in _eqns(closed.jaxpr) if e.primitive is toy_call_p]
    assert len(calls) == 1
    inner = [e.params for e in calls[0].params["body"].jaxpr.eqns if e.primitive is sow_p]
    assert [(p["tag"], p["name"]) for p in inner] == [("t", "inside")]
    # the other sites were consumed by the harvest
    assert [e.params["name"] for e in _eqns(closed.jaxpr) if e.primitive is sow_p] == ["inside"]
    close(jax.jit(harvested)(X), plain(X))
    # a harvest outside that takes the site meets it there, and looks inside
    # through the primitive's implementation (tests/test_generic_primitive.py)
    d = lh.reap(harvested, tag="t")(X)
    assert set(d) == {"inside"}
    close(d["inside"], jnp.sin(3 * X))


def test_a_plant_for_a_filtered_out_site_inside_is_ignored():
    planted = lh.plant(model, tag="t", allowlist=["after"])({"inside": 5.0, "after": 0.5}, X)
    close(planted, jnp.cos(0.5))
    planted = lh.plant(model, tag="t", blocklist=["inside"])({"inside": 5.0, "before": 1.0}, X)
    close(planted, plain(1.0 / 3.0))
    # the gradient of the planted program: d cos(2 sin(3x) + 0.5) / dx
    close(jax.grad(lambda x: lh.plant(model, tag="t", blocklist=["inside"], mode="add")(
        {"after": 0.5}, x))(X), jax.grad(lambda x: plain(x, e_after=0.5))(X))


def plain_inside(x, e_inside=0.0):
    """`model` in plain JAX, perturbed at the site inside the primitive."""
    return jnp.cos(2.0 * (jnp.sin(x * 3.0) + e_inside))


@pytest.mark.parametrize("jit", [False, True])
def test_a_site_the_harvest_takes_inside_is_reaped_through_the_implementation(jit):
    f = jax.jit(model) if jit else model
    out, d = lh.call_and_reap(f, tag="t")(X)
    close(out, plain(X))
    assert set(d) == {"before", "inside", "after"}
    close(d["inside"], jnp.sin(3 * X))
    g = lh.reap(jax.grad(f), tag="t")(X)
    close(g["inside"], jnp.sin(3 * X))
    close(g["vjp", "inside"], jax.grad(plain_inside, argnums=1)(X, 0.0))
    close(lh.plant(f, tag="t")({"inside": 0.25}, X), jnp.cos(0.5))


# --- lineax's linear_solve (an Equinox filter_primitive) ----------------------------

A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
B = jnp.array([1.0, 2.0])


def solve(a, b, eps=0.0, sow=True):
    """Solves a x = b with lineax's CG, a sow in the operator's matvec; the
    matrix is traced (the matvec is closure-converted into the primitive's
    params). The loss of the solution, perturbed by `eps` there."""
    lx = pytest.importorskip("lineax")

    def mv(v):
        v = lh.sow(v, tag="t", name="drive", mode="clobber") if sow else v
        return a @ v
    op = lx.FunctionLinearOperator(mv, jax.eval_shape(lambda: b), lx.positive_semidefinite_tag)
    x = lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6)).value
    y = lh.sow(x, tag="t", name="y") if sow else x
    return jnp.sum(jnp.tanh(y + eps) ** 2)


@pytest.mark.parametrize("filters", [{"allowlist": ["y"]}, {"blocklist": ["drive"]}])
def test_a_filtered_out_site_inside_lineax_linear_solve_is_the_identity(filters):
    pytest.importorskip("lineax")
    x = jnp.linalg.solve(A, B)
    d = lh.reap(solve, tag="t", **filters)(A, B)
    close(d["y"], x, rtol=1e-4, atol=1e-4)
    grads, g = lh.call_and_reap(jax.grad(solve, argnums=(0, 1)), tag="t", **filters)(A, B)
    plain_grads = jax.grad(lambda a, b: solve(a, b, sow=False), argnums=(0, 1))(A, B)
    close(grads, plain_grads, rtol=1e-4, atol=1e-4)
    close(g["y"], x, rtol=1e-4, atol=1e-4)
    expected = jax.grad(lambda e: solve(A, B, eps=e, sow=False))(jnp.zeros(2))
    close(g["vjp", "y"], expected, rtol=1e-4, atol=1e-4)
    # a plant for the filtered-out name is ignored; the other one applies
    planted = lh.plant(solve, tag="t", **filters)({"drive": jnp.ones(2), "y": x * 2}, A, B)
    close(planted, jnp.sum(jnp.tanh(x * 2) ** 2), rtol=1e-4, atol=1e-4)


# --- JAX's high-level primitives (the `jax_*3` flags) -------------------------------

FLAGS = [pytest.param(f, marks=pytest.mark.skipif(
    f not in _jax.HI_PRIM_FLAGS.values(), reason=f"jax {jax.__version__} has no {f}"))
    for f in ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")]


@pytest.fixture
def flag(request):
    with jax_flag(request.param):
        yield request.param


def _construct(flag_name):
    """`sin` as the construct `flag_name` changes, with a site inside (made
    after the flag is set)."""
    if flag_name == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(_sow(c, "inside")), None), x, None,
                                  length=1)[0]
    if flag_name == "jax_remat3":
        return jax.checkpoint(lambda x: jnp.sin(_sow(x, "inside")))
    if flag_name == "jax_custom_jvp3":
        cjvp = jax.custom_jvp(lambda x: jnp.sin(_sow(x, "inside")))
        cjvp.defjvp(lambda p, t: (cjvp(p[0]), jnp.cos(p[0]) * t[0]))
        return cjvp
    cvjp = jax.custom_vjp(lambda x: jnp.sin(_sow(x, "inside")))
    cvjp.defvjp(lambda x: (cvjp(x), x), lambda r, g: (jnp.cos(r) * g,))
    return cvjp


@pytest.mark.parametrize("flag", FLAGS, indirect=True)
def test_a_filtered_out_site_inside_a_high_level_primitive_is_the_identity(flag):
    inner = _construct(flag)

    def f(x):
        return inner(_sow(x * 2, "outside")) + 1

    assert _jax.call_hi_primitive_p in [e.primitive for e in jax.make_jaxpr(f)(X).eqns]
    if flag == "jax_scan3":  # taken: harvested as in a scan (tests/test_jax_flags.py),
        with pytest.raises(lh.HarvestError, match="mode='strict' inside lax.scan"):
            lh.reap(f, tag="t")(X)  # where a strict site is refused
    elif flag == "jax_remat3" or _jax.CUSTOM_HI_PRIMS:  # taken: harvested (test_jax_flags.py)
        close(lh.reap(f, tag="t")(X)["inside"], 2 * X)
    else:  # taken: refused, naming the flag
        with pytest.raises(lh.HarvestError, match=flag):
            lh.reap(f, tag="t")(X)
    for filters in ({"allowlist": ["outside"]}, {"blocklist": ["inside"]}):
        out, d = lh.call_and_reap(f, tag="t", **filters)(X)
        close(out, jnp.sin(2 * X) + 1)
        assert set(d) == {"outside"}
        close(d["outside"], 2 * X)
        close(lh.plant(f, tag="t", **filters)({"outside": 1.0, "inside": 5.0}, X),
              jnp.sin(1.0) + 1)
        if flag != "jax_scan3":  # (JAX cannot reverse-differentiate Scan3)
            grad, g = lh.call_and_reap(jax.grad(f), tag="t", **filters)(X)
            close(grad, 2 * jnp.cos(2 * X))
            close(g["vjp", "outside"], jax.grad(lambda e: jnp.sin(2 * X + e) + 1)(0.0))


# --- the generic path through lineax and optimistix (issue 33, item 1) -------------
# A site the harvest takes inside lineax's linear_solve is harvested through
# the primitive's implementation (tests/test_generic_primitive.py shows the
# mechanism on a toy primitive): a clobber site holds its last evaluation (an
# ordered jax.debug.callback log of the program without lazyharvest), and
# cotangents come through the library's implicit rule: the gradient of the
# program with a zero perturbation added in the solved function.

def solve_matvec(a, b, log=None, sow=True, eps=0.0):
    """`solve` with its site on the matvec's value instead; without
    lazyharvest (`sow=False`), `eps` added there (at every evaluation, as the
    implicit rule sees the function) and the evaluations logged in order."""
    lx = pytest.importorskip("lineax")

    def mv(v):
        u = a @ v
        if log is not None:
            jax.debug.callback(lambda w: log.append(np.asarray(w)), u)
        return lh.sow(u, tag="t", name="mv", mode="clobber") if sow else u + eps
    op = lx.FunctionLinearOperator(mv, jax.eval_shape(lambda: b), lx.positive_semidefinite_tag)
    return jnp.sum(jnp.tanh(lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6)).value) ** 2)


def test_sites_inside_lineax_linear_solve_are_reaped():
    pytest.importorskip("lineax")
    log: list = []
    want = solve_matvec(A, B, log, sow=False)
    out, d = lh.call_and_reap(solve_matvec, tag="t")(A, B)
    close(out, want, rtol=1e-5)
    assert set(d) == {"mv"}
    close(d["mv"], log[-1])  # the last evaluation
    d = lh.reap(solve, tag="t")(A, B)  # (the site on the matvec's input)
    close(d["y"], jnp.linalg.solve(A, B), rtol=1e-4, atol=1e-4)
    g = lh.reap(jax.grad(solve_matvec), tag="t")(A, B)
    expected = jax.grad(lambda e: solve_matvec(A, B, sow=False, eps=e))(jnp.zeros(2))
    close(g["vjp", "mv"], expected, rtol=1e-4, atol=1e-5)


W_ROOT = jnp.array([[0.5, 0.1], [-0.2, 0.3]])
DRIVE = jnp.array([0.3, -0.4])


def root(w, d, sow=True, e_res=0.0, e_y=0.0, log=None):
    """optimistix's Newton root of y = tanh(w y) + d: a site on the residual
    (a Newton solve differentiates it, and its implicit adjoint solves a
    linear system under jax.grad) and one on the root."""
    optx = pytest.importorskip("optimistix")

    def residual(y, args):
        w, d = args
        r = jnp.tanh(w @ y) + d - y
        if log is not None:
            jax.debug.callback(lambda u: log.append(np.asarray(u)), r)
        return (lh.sow(r, tag="t", name="res", mode="clobber") if sow else r) + e_res
    y = optx.root_find(residual, optx.Newton(rtol=1e-6, atol=1e-6), jnp.zeros(2),
                       args=(w, d)).value
    return jnp.sum((lh.sow(y, tag="t", name="y") if sow else y) + e_y) ** 2


def test_sites_inside_an_optimistix_root_find_under_grad():
    log: list = []
    root(W_ROOT, DRIVE, sow=False, log=log)
    grads, d = lh.call_and_reap(jax.grad(root, argnums=(0, 1)), tag="t")(W_ROOT, DRIVE)
    close(grads, jax.grad(lambda w, d: root(w, d, sow=False), argnums=(0, 1))(W_ROOT, DRIVE),
          rtol=1e-5)
    close(d["res"], log[-1], atol=1e-6)
    e_res, e_y = jax.grad(lambda a, b: root(W_ROOT, DRIVE, False, a, b), argnums=(0, 1))(
        jnp.zeros(2), jnp.zeros(2))
    close(d["vjp", "res"], e_res, rtol=1e-4, atol=1e-6)
    close(d["vjp", "y"], e_y, rtol=1e-4, atol=1e-6)


def test_sites_on_the_solutions_of_least_squares_and_minimise_under_grad():
    optx = pytest.importorskip("optimistix")
    ts = jnp.linspace(0.0, 1.0, 5)
    data = 2.0 * jnp.exp(-1.3 * ts)

    def fit(scale, sow=True, e=0.0):
        def residuals(p, _):
            r = p[0] * jnp.exp(-p[1] * ts) - data
            return lh.sow(r, tag="t", name="r", mode="clobber") if sow else r
        p = optx.least_squares(residuals, optx.GaussNewton(rtol=1e-6, atol=1e-6),
                               jnp.ones(2) * scale, max_steps=64).value
        return jnp.sum(jnp.sin((lh.sow(p, tag="t", name="fit") if sow else p) + e))

    d = lh.reap(jax.grad(fit), tag="t")(1.0)
    close(d["fit"], jnp.array([2.0, 1.3]), rtol=1e-4)
    close(d["vjp", "fit"], jax.grad(lambda e: fit(1.0, False, e))(jnp.zeros(2)), rtol=1e-4)

    def minimum(w, sow=True, e=0.0):
        loss = lambda y, a: jnp.sum((y - a) ** 2) + 0.1 * jnp.sum(y ** 4)  # noqa: E731
        y = optx.minimise(loss, optx.BFGS(rtol=1e-6, atol=1e-6), jnp.zeros(3), args=w).value
        return jnp.sum(jnp.cos((lh.sow(y, tag="t", name="y") if sow else y) + e))

    w = jnp.array([0.5, -1.0, 0.3])
    g, d = lh.call_and_reap(jax.grad(minimum), tag="t")(w)
    close(g, jax.grad(lambda w: minimum(w, False))(w), rtol=1e-4)
    close(d["vjp", "y"], jax.grad(lambda e: minimum(w, False, e))(jnp.zeros(3)), rtol=1e-4)


# --- item 3: a plant inside a function a library differentiates implicitly --------
# The implicit rule evaluates the function again (its gradient, its Jacobian in
# a lineax operator); with the site planted, it is the planted function it
# differentiates, as in the program written with the plant in place.

THETA = jnp.array([0.5, -1.0, 0.8])
W_PLANT = jnp.array([0.3, 0.7, 0.4])


def _objective(w):
    def objective(y, theta):
        return jnp.sum(w(theta) * y ** 2 - theta * y) + 0.1 * jnp.sum(y ** 4)
    return objective


def _sown_w(theta):
    return lh.sow(2.0 * theta, tag="t", name="w", mode="clobber")


def test_a_plant_inside_an_optimistix_minimise_is_differentiated_by_its_implicit_rule():
    optx = pytest.importorskip("optimistix")

    def loss(theta, w=_sown_w):
        y = optx.minimise(_objective(w), optx.BFGS(rtol=1e-8, atol=1e-8), jnp.ones(3),
                          args=theta).value
        return jnp.sum(y ** 2)

    planted = lambda th: lh.plant(loss, tag="t")({"w": W_PLANT}, th)  # noqa: E731
    by_hand = lambda th: loss(th, w=lambda _: W_PLANT)  # noqa: E731
    close(planted(THETA), by_hand(THETA), rtol=1e-5)
    expected = jax.grad(by_hand)(THETA)
    assert not np.allclose(expected, jax.grad(loss)(THETA), rtol=1e-2)  # (the plant matters)
    close(jax.grad(planted)(THETA), expected, rtol=1e-4, atol=1e-5)
    close(jax.jvp(planted, (THETA,), (jnp.ones(3),))[1],
          jax.jvp(by_hand, (THETA,), (jnp.ones(3),))[1], rtol=1e-4)
    # the implicit function theorem by hand: d/dtheta of sum(y*^2), where
    # 2 w y + 0.4 y^3 = theta at the minimum y*, so dy*/dtheta = 1 / (2 w + 1.2 y*^2)
    y = optx.minimise(_objective(lambda _: W_PLANT), optx.BFGS(rtol=1e-8, atol=1e-8),
                      jnp.ones(3), args=THETA).value
    close(jax.grad(planted)(THETA), 2 * y / (2 * W_PLANT + 1.2 * y ** 2), rtol=1e-4)


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def _implicit_minimum(theta, w):
    # Newton steps on the gradient, with an implicit rule that evaluates the
    # gradient again: the pattern of optimistix's `implicit_jvp`, in JAX alone
    grad = jax.grad(_objective(w))
    step = lambda _, y: y - grad(y, theta) / (2 * jnp.abs(theta) + 1.2 * y ** 2 + 1.0)  # noqa: E731
    return lax.fori_loop(0, 200, step, jnp.ones(3))


@_implicit_minimum.defjvp
def _implicit_minimum_jvp(w, primals, tangents):
    (theta,), (dtheta,) = primals, tangents
    y = _implicit_minimum(theta, w)
    grad = jax.grad(_objective(w))
    _, b = jax.jvp(lambda th: grad(y, th), (theta,), (dtheta,))
    hessian = jax.jacfwd(lambda u: grad(u, theta))(y)
    return y, -jnp.linalg.solve(hessian, b)


def test_a_plant_in_a_custom_jvp_whose_function_and_rule_differentiate_the_site():
    # the primal function holds the site under jax.grad (its key is a value
    # key with a differentiation label inside the call); the rule differentiates
    # the same function again: both see the plant
    def loss(theta, w=_sown_w):
        return jnp.sum(_implicit_minimum(theta, w) ** 2)

    planted = lambda th: lh.plant(loss, tag="t")({"w": W_PLANT}, th)  # noqa: E731
    by_hand = lambda th: loss(th, w=lambda _: W_PLANT)  # noqa: E731
    expected = jax.grad(by_hand)(THETA)
    assert not np.allclose(expected, jax.grad(loss)(THETA), rtol=1e-2)
    close(planted(THETA), by_hand(THETA), rtol=1e-6)
    close(jax.grad(planted)(THETA), expected, rtol=1e-5)
    if not jax_jits_scan3_wrongly():  # (JAX's jit drops the solve's Scan3 from this program)
        close(jax.jit(jax.grad(planted))(THETA), expected, rtol=1e-5)


@pytest.mark.parametrize("how", ["add", "function", "intervention"])
def test_a_plant_that_shifts_the_residual_of_an_optimistix_root_find_under_grad(how):
    # the Newton steps linearize the residual and the implicit rule evaluates
    # it again inside lineax's operator: a plant computed from the sown value
    # (added, or a function of it) is applied in both
    pytest.importorskip("optimistix")
    shift = jnp.array([0.1, -0.2])
    plants, mode = {
        "add": ({"res": shift}, "add"),
        "function": ({"res": lambda r: r + shift}, "replace"),
        "intervention": ({"res": lh.intervention(lambda r, s: r + s, shift)}, "replace"),
    }[how]
    planted = lambda w, d: lh.plant(root, tag="t", mode=mode)(plants, w, d)  # noqa: E731
    by_hand = lambda w, d: root(w, d, sow=False, e_res=shift)  # noqa: E731
    close(planted(W_ROOT, DRIVE), by_hand(W_ROOT, DRIVE), rtol=1e-5)
    expected = jax.grad(by_hand, argnums=(0, 1))(W_ROOT, DRIVE)
    close(jax.grad(planted, argnums=(0, 1))(W_ROOT, DRIVE), expected, rtol=1e-4, atol=1e-6)


# --- JAX's high-level primitives that jax >= 0.12 stages with every flag off -------
# (`lax.custom_root` as `CustomRoot`, `jnp.nonzero(size=...)` as `Nonzero`; on
# older JAX the same programs stage ordinary primitives, and must give the same)

def _cube_root(a, sow=True, e=0.0, log=None):
    def residual(y):
        r = y ** 3 - a
        if log is not None:
            jax.debug.callback(lambda v: log.append(float(v)), r)
        return (lh.sow(r, tag="t", name="res", mode="clobber") if sow else r) + e

    def newton(f, y0):
        return lax.fori_loop(0, 12, lambda _, y: y - f(y) / (3 * y ** 2), y0)
    y = lax.custom_root(residual, 1.0, newton, lambda g, y: y / g(1.0))
    return jnp.sin(y * a)


@skip_where_jax_jits_scan3_wrongly()  # (the plain-JAX solve runs a fori_loop eagerly)
def test_sites_inside_lax_custom_root_keep_its_implicit_rule():
    log: list = []
    _cube_root(2.0, sow=False, log=log)
    d = lh.reap(_cube_root, tag="t")(2.0)
    close(d["res"], log[-1], atol=1e-6)  # the last evaluation
    plain = jax.grad(lambda a: _cube_root(a, sow=False))(2.0)
    # differentiated after the harvest: the implicit rule, not the unrolled solve
    close(jax.grad(lambda a: lh.call_and_reap(_cube_root, tag="t")(a)[0])(2.0), plain)
    close(jax.grad(lambda a: lh.plant(_cube_root, tag="t")({}, a))(2.0), plain)
    # under jax.grad inside the harvest: the residual's cotangent through the rule
    d = lh.reap(jax.grad(_cube_root), tag="t")(2.0)
    close(d["vjp", "res"], jax.grad(lambda e: _cube_root(2.0, sow=False, e=e))(0.0),
          rtol=1e-4)
    # a planted residual: the planted program (a shifted root)
    shift = 0.5
    got = lh.plant(_cube_root, tag="t", mode="add")({"res": jnp.float32(shift)}, 2.0)
    close(got, _cube_root(2.0, sow=False, e=shift), rtol=1e-5)


def test_a_site_next_to_jnp_nonzero_with_a_size():
    def f(x, e=0.0, sow=True):
        h = jnp.sin(x)
        h = (lh.sow(h, tag="t", name="h") if sow else h) + e
        idx = jnp.nonzero(h > 0, size=3)[0]
        inner = lh.sow(h[idx] * 2.0, tag="t", name="picked") if sow else h[idx] * 2.0
        return jnp.sum(inner ** 2)
    x = jnp.arange(5.0)
    d = lh.reap(jax.grad(f), tag="t")(x)
    close(d["h"], jnp.sin(x))
    close(d["picked"], 2.0 * jnp.sin(x)[jnp.nonzero(jnp.sin(x) > 0, size=3)[0]])
    close(d["vjp", "h"], jax.grad(lambda e: f(x, e, sow=False))(jnp.zeros(5)))
