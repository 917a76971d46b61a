"""The generic path through a higher-order primitive lazyharvest has no rule
for (issue 33, SPEC section 9 "Primitives without a rule of their own"),
shown on a toy primitive of this module's own, made as a library makes one:
`toy_solve` solves `A x = b` for a symmetric positive definite operator
given as a function (`matvec`, closure-converted into a jaxpr in the
params, its constants operands), by a fixed number of Richardson steps in
its implementation, with an implicit JVP rule, a transpose rule and a
batching rule. Nothing in lazyharvest knows it.

Expected values come from plain JAX: the iteration written as a Python
loop, the linear algebra with `jnp.linalg.solve`, and programs written
without lazyharvest.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close
from lazyharvest import _jax

STEPS, OMEGA = 25, 0.2
A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
B = jnp.array([1.0, 2.0])

toy_solve_p = _jax.Primitive("toy_solve")


def _matvec(matvec, consts, x):
    return _jax.eval_jaxpr(matvec.jaxpr, matvec.consts, x, *consts)[0]


def _impl(b, *consts, matvec):
    def step(_, x):
        return x + OMEGA * (b - _matvec(matvec, consts, x))
    return lax.fori_loop(0, STEPS, step, jnp.zeros_like(b))


def _jvp(primals, tangents, *, matvec):
    b, *consts = primals
    db, *dconsts = (_jax.ad.instantiate_zeros(t) for t in tangents)
    x = toy_solve_p.bind(b, *consts, matvec=matvec)
    # implicit: A dx = db - dA x, dA x the matvec's tangent in its constants
    da_x = jax.jvp(lambda *c: _matvec(matvec, c, x), consts, dconsts)[1]
    return x, toy_solve_p.bind(db - da_x, *consts, matvec=matvec)


def _transpose(ct, b, *consts, matvec):
    assert _jax.ad.is_undefined_primal(b)  # linear in b only; A is symmetric
    ct = _jax.ad.instantiate_zeros(ct)
    return [toy_solve_p.bind(ct, *consts, matvec=matvec)] + [None] * len(consts)


def _batch(args, dims, *, matvec):
    b, *consts = args
    if any(d is not None for d in dims[1:]):
        raise NotImplementedError("toy_solve batches its right-hand side only")
    b = jnp.moveaxis(b, dims[0], 0)
    return jax.vmap(lambda bi: _impl(bi, *consts, matvec=matvec))(b), 0


toy_solve_p.def_impl(_impl)
toy_solve_p.def_abstract_eval(lambda b, *consts, matvec: b)
_jax.ad.primitive_jvps[toy_solve_p] = _jvp
_jax.ad.primitive_transposes[toy_solve_p] = _transpose
_jax.register_batcher(toy_solve_p, _batch)
_jax.mlir.register_lowering(toy_solve_p, _jax.mlir.lower_fun(_impl, multiple_results=False))


def toy_solve(mv, b):
    """x with mv(x) = b; `mv` closes over arrays (its constants)."""
    converted, consts = jax.closure_convert(mv, b)
    matvec = jax.make_jaxpr(converted)(b, *consts)  # (x, *consts) -> mv(x)
    return toy_solve_p.bind(b, *consts, matvec=matvec)


def program(a, b, sow=True, e=0.0):
    """A loss of the solution; sites in the matvec (its value, clobber; its
    input, append) and on the solution. `e` is added to the matvec's value
    (the zero perturbation of the plain-JAX program)."""
    def mv(v):
        if sow:
            v = lh.sow(v, tag="t", name="iterate", mode="append")
            return lh.sow(a @ v, tag="t", name="mv", mode="clobber")
        return a @ v + e
    x = toy_solve(mv, b)
    x = lh.sow(x, tag="t", name="x") if sow else x
    return jnp.sum(jnp.tanh(x) ** 2)


def iterates(a, b):
    """The matvec's inputs, step by step, as the implementation runs them."""
    xs, x = [], jnp.zeros_like(b)
    for _ in range(STEPS):
        xs.append(x)
        x = x + OMEGA * (b - a @ x)
    return jnp.stack(xs), x


def test_the_toy_has_no_rule_and_a_plain_implementation():
    from lazyharvest._interpreter import EVAL_RULES
    assert toy_solve_p not in EVAL_RULES
    xs, x = iterates(A, B)
    close(x, jnp.linalg.solve(A, B), atol=1e-5)
    close(jax.jit(lambda b: toy_solve(lambda v: A @ v, b))(B), x)


@pytest.mark.parametrize("jit", [False, True])
def test_values_inside_come_from_its_implementation(jit):
    f = jax.jit(program) if jit else program
    out, d = lh.call_and_reap(f, tag="t")(A, B)
    xs, x = iterates(A, B)
    close(out, program(A, B, sow=False))
    assert set(d) == {"iterate", "mv", "x"}
    close(d["iterate"], xs)  # append: one row per evaluation, in order
    close(d["mv"], A @ xs[-1])  # clobber: the last evaluation
    close(d["x"], x)


def test_the_outputs_come_from_the_primitive_itself():
    # its rules stay in force for what transforms the harvested program
    jaxpr = jax.make_jaxpr(lambda a, b: lh.call_and_reap(program, tag="t")(a, b)[0])(A, B)
    assert toy_solve_p in [e.primitive for e in _all_eqns(jaxpr.jaxpr)]
    grad = jax.grad(lambda a: lh.call_and_reap(program, tag="t")(a, B)[0])(A)
    close(grad, jax.grad(lambda a: program(a, B, sow=False))(A), rtol=1e-4)


def test_cotangents_come_through_its_implicit_rule():
    g, d = lh.call_and_reap(jax.grad(program), tag="t")(A, B)
    close(g, jax.grad(lambda a: program(a, B, sow=False))(A), rtol=1e-4)
    x = jnp.linalg.solve(A, B)
    # d loss / d e, e added to the matvec's value: x = A^-1 (b - e)
    dloss_dx = 2 * jnp.tanh(x) / jnp.cosh(x) ** 2
    close(d["vjp", "mv"], -jnp.linalg.solve(A.T, dloss_dx), rtol=1e-3, atol=1e-4)
    close(d["vjp", "mv"], jax.grad(lambda e: program(A, B, sow=False, e=e))(jnp.zeros(2)),
          rtol=1e-4, atol=1e-6)
    close(d["vjp", "x"], dloss_dx, rtol=1e-3, atol=1e-4)


def test_under_vmap():
    bs = jnp.stack([B, 2 * B, -B])
    d = jax.vmap(lambda b: lh.reap(program, tag="t")(A, b)["mv"])(bs)
    close(d, jnp.stack([A @ iterates(A, b)[0][-1] for b in bs]))


def test_a_plant_inside_replaces_every_evaluation():
    v = jnp.array([0.5, -1.0])
    out = lh.plant(program, tag="t")({"mv": v}, A, B)
    # every step then reads v: x = STEPS * OMEGA * (b - v)
    x = STEPS * OMEGA * (B - v)
    close(out, jnp.sum(jnp.tanh(x) ** 2))
    d = lh.reap(lh.plant(program, tag="t"), tag="t")({"mv": v}, A, B)
    close(d["x"], x)


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for j in _jax.sub_jaxprs(e.params):
            yield from _all_eqns(j)


def test_a_primitive_with_no_implementation_to_look_through_is_refused():
    # a primitive that only lowers (no Python impl): the harvest cannot look
    # inside, and says so, naming it and where it comes from
    opaque_p = _jax.Primitive("toy_lowered_only")
    opaque_p.def_abstract_eval(lambda b, *consts, matvec: b)
    _jax.mlir.register_lowering(opaque_p, _jax.mlir.lower_fun(_impl, multiple_results=False))

    def f(b):
        matvec = jax.make_jaxpr(lambda x: lh.sow(A @ x, tag="t", name="inside"))(b)
        return opaque_p.bind(b, matvec=matvec)
    with pytest.raises(lh.HarvestError) as info:
        lh.reap(f, tag="t")(B)
    for part in ("site 'inside'", "'toy_lowered_only'", f"from {__name__}", "allowlist"):
        assert part in str(info.value), (part, str(info.value))
    np.testing.assert_allclose(jax.jit(f)(B), iterates(A, B)[1], rtol=1e-6)
