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

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
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
    # a harvest outside that takes the site meets it (and cannot look inside)
    with pytest.raises(lh.HarvestError, match="'inside'.*open_toy_call"):
        lh.reap(harvested, tag="t")(X)


def test_a_plant_for_a_filtered_out_site_inside_is_ignored():
    planted = lh.plant(model, tag="t", allowlist=["after"])({"inside": 5.0, "after": 0.5}, X)
    close(planted, jnp.cos(0.5))
    planted = lh.plant(model, tag="t", blocklist=["inside"])({"inside": 5.0, "before": 1.0}, X)
    close(planted, plain(1.0 / 3.0))
    # the gradient of the planted program: d cos(2 sin(3x) + 0.5) / dx
    close(jax.grad(lambda x: lh.plant(model, tag="t", blocklist=["inside"], mode="add")(
        {"after": 0.5}, x))(X), jax.grad(lambda x: plain(x, e_after=0.5))(X))


def test_a_site_the_harvest_takes_inside_raises_saying_what_to_do():
    for call in (lambda: lh.reap(model, tag="t")(X),
                 lambda: lh.reap(model, tag="t", allowlist=["inside"])(X),
                 lambda: lh.reap(jax.grad(model), tag="t", blocklist=["before"])(X),
                 lambda: lh.plant(model, tag="t")({"inside": 1.0}, X)):
        with pytest.raises(lh.HarvestError) as info:
            call()
        message = str(info.value)
        for part in ("harvest of tag 't'", "site 'inside'", "'open_toy_call'",
                     f"from {__name__}", "allowlist", "blocklist", "ove the sow outside"):
            assert part in message, (part, message)


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
    with pytest.raises(lh.HarvestError, match="'linear_solve' \\(from lineax"):
        lh.reap(solve, tag="t")(A, B)  # (the site in it is taken: refused)
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
    jax.config.update(request.param, True)
    try:
        yield request.param
    finally:
        jax.config.update(request.param, False)


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
    with pytest.raises(lh.HarvestError, match=flag):  # taken: refused, naming the flag
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
