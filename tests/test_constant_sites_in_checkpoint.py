"""Constant sites inside `jax.checkpoint` under JAX's own differentiation
(issue 31; SPEC 3.2 and 9: "Dead and constant sites survive every
transformation", "Cotangents belong to their occurrence", "Repeated sows keep
program order in every mode", "Reverse mode shows no tangents").

Every program takes `e`: with `e=None` it sows; with a dict of perturbations
it is the same program in plain JAX, `e[name]` added at the occurrence whose
value is reaped (a clobber site's last one; row i of an append site at its
i-th occurrence). Expected cotangents are `jax.vjp` with respect to `e` at
zero; expected values and tangents are `jax.jvp` of a plain-JAX slice.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import skip_where_jax_checkpoints_scan3_wrongly
from lazyharvest import _jax

pytestmark = pytest.mark.skipif(
    not _jax.DERIVATIVE_SITES, reason="dead and constant sites need jax >= 0.9")

X = jnp.array([0.5, -1.0, 0.3])
TX = jnp.array([1.0, -2.0, 0.5])
CT = 2.0
C = jnp.array([2.0, -1.0, 3.0])
P = jnp.full((1, 3), -1.0)  # one row: the scan's only occurrence is its last
Q = jnp.array([[-1.0, 2.0, 0.5], [0.3, 0.2, 0.1]])
W = jnp.array([0.1, 0.2, 0.3])


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def reaped(fn, *args):
    return lh.reap(fn, tag="t")(*args)


def site(v, name, e, mode="clobber"):
    """A site; in the plain-JAX program (`e` given), the value plus `e`."""
    return lh.sow(v, tag="t", name=name, mode=mode) if e is None else v + e


def part(e, name, weight=1.0):
    """This occurrence's perturbation: `weight` 0 for one that is not reaped."""
    return None if e is None else weight * e[name]


def in_cond(g):  # the same function in both branches
    return lambda p: lax.cond(jnp.sum(p) > 0, g, g, p)


WRAPS = {"checkpoint": jax.checkpoint, "jit": jax.jit, "cond": in_cond}


# --- the programs ----------------------------------------------------------------

def stop_gradient_input(x, e=None, used=False):
    # a checkpoint none of whose inputs has a tangent
    y = jax.checkpoint(lambda c: site(c * 3.0, "a", part(e, "a")))(lax.stop_gradient(x))
    return jnp.sum(jnp.sin(y) * x if used else y) + jnp.sum(x)


def stop_gradient_input_in_cond(x, e=None, used=False, wrap="checkpoint"):
    # the taken branch is the checkpoint; the other sows a closed-over
    # constant under another clobber name (zeros: never sown)
    def other(v):
        s5 = site(C, "s5", part(e, "s5"))
        return s5 * v if used else v
    y = lax.cond(x[0] > 0, lambda v: WRAPS[wrap](
        lambda c: site(c * 3.0, "s6", part(e, "s6")))(v), other, lax.stop_gradient(x))
    return jnp.sum(jnp.sin(y) * x if used else y) + jnp.sum(x)


def constant_scan(x, e=None, used=False, nested=False, live_first=True):
    # the reaped occurrence of s2 is the constant one in the scan (after a live
    # one, or alone)
    def step(cc, p):
        s = site(p * 2.0, "s2", part(e, "s2"))
        return (cc * s if used else cc), None

    def blk(x):
        c = site(x, "s2", part(e, "s2", 0.0)) if live_first else x
        scan = lambda v: lax.scan(step, v, P)[0]  # noqa: E731
        if nested:
            return lax.scan(lambda v, _: (scan(v), None), jnp.ones(3), None, length=1)[0] + c
        return scan(jnp.ones(3)) + c
    return jnp.sum(jnp.sin(jax.checkpoint(blk)(x)))


def constant_after_live(x, e=None, used=False, wrap="checkpoint", in_scan=True):
    # a live occurrence of s1, then constant ones in a wrapper; the last is reaped
    c = site(x, "s1", part(e, "s1", 0.0))

    def inner(p, weight):
        return WRAPS[wrap](lambda p: site(p * p, "s1", part(e, "s1", weight)))(p)
    if not in_scan:
        s = inner(Q[1], 1.0)
        return jnp.sum(jnp.sin(c * s if used else c))

    def body(c, xs):
        s = inner(*xs)
        return (c * s if used else c), None
    c, _ = lax.scan(body, c, (Q, jnp.array([0.0, 1.0])))  # weight 1 at the last row
    return jnp.sum(jnp.sin(c))


def append_rows(x, e=None, used=False):
    # an append site in nested checkpoints in a scan: one row per iteration
    def layer(c, ei):
        w = site(W, "s1", ei, mode="append")
        return jnp.sin(c + c) + (w * c if used else 0.0)
    body = jax.checkpoint(lambda c, ei: (jax.checkpoint(layer)(c, ei), None))
    return jnp.sum(lax.scan(body, x, None if e is None else e["s1"], length=3)[0])


def _cases():
    """id: (program, its reaped values in plain JAX, whether the output uses a site)."""
    cases = {}
    for used in (False, True):
        u = "used" if used else "unused"
        cases[f"stop_gradient_input-{'nonlinear' if used else 'linear'}"] = (
            functools.partial(stop_gradient_input, used=used),
            lambda x: {"a": 3.0 * lax.stop_gradient(x)}, True)
        for wrap in ("checkpoint", "jit"):
            cases[f"cond-{wrap}-{u}"] = (
                functools.partial(stop_gradient_input_in_cond, used=used, wrap=wrap),
                lambda x: {"s6": 3.0 * lax.stop_gradient(x), "s5": jnp.zeros(3)}, used)
        for nested in (False, True):
            for live_first in (True, False):
                cases[f"constant_scan-{'nested-' * nested}{'alone-' * (not live_first)}{u}"] = (
                    functools.partial(constant_scan, used=used, nested=nested,
                                      live_first=live_first),
                    lambda x: {"s2": 2.0 * P[-1]}, used)
        for wrap in WRAPS:
            for in_scan in (True, False):
                cases[f"after_live-{wrap}-{'scan' if in_scan else 'straight'}-{u}"] = (
                    functools.partial(constant_after_live, used=used, wrap=wrap, in_scan=in_scan),
                    lambda x: {"s1": Q[1] ** 2}, used)
        cases[f"append_rows-{u}"] = (
            functools.partial(append_rows, used=used),
            lambda x: {"s1": jnp.tile(W, (3, 1))}, used)
    return cases


CASES = _cases()
each_case = pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
# under jax.linearize, jax.vjp and jax.grad: the cases whose scan is inside the
# checkpoint and carries a value skip where JAX itself computes those wrongly
_JAX_WRONG = skip_where_jax_checkpoints_scan3_wrongly()
each_case_linearized = pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[_JAX_WRONG] if "constant_scan" in k else [])
             for k, c in CASES.items()], ids=CASES.keys())


def cotangents(prog, values, ct):
    """d <ct, out> / d site: the cotangent of a zero perturbation (plain JAX)."""
    zeros = jax.tree.map(jnp.zeros_like, values(X))
    return jax.vjp(lambda e: prog(X, e), zeros)[1](ct)[0]


# --- forward mode: a zero tangent, present ----------------------------------------

@each_case
def test_jvp_gives_the_zero_tangent_of_a_constant_site(case):
    prog, values, _ = case
    d = reaped(lambda x: jax.jvp(prog, (x,), (TX,)), X)
    want, tangents = jax.jvp(values, (X,), (TX,))
    assert set(d.keys()) == set(want) | {("jvp", n) for n in want}
    for n in want:
        close(d[n], want[n])
        close(d["jvp", n], tangents[n])


@each_case_linearized
def test_linear_function_gives_the_zero_tangent_under_the_plain_name(case):
    prog, values, _ = case
    d = reaped(jax.linearize(prog, X)[1], TX)
    tangents = jax.jvp(values, (X,), (TX,))[1]
    assert set(d.keys()) == set(tangents)
    for n in tangents:
        close(d[n], tangents[n])


# --- reverse mode: the cotangent of the reaped occurrence, no tangents -------------

@each_case_linearized
def test_backward_function_gives_the_cotangent_of_the_reaped_occurrence(case):
    prog, values, used = case
    d = reaped(jax.vjp(prog, X)[1], CT)
    want = cotangents(prog, values, CT)
    assert set(d.keys()) == set(want)
    for n in want:
        close(d[n], want[n])
    if used:  # the variant is one where the site's value reaches the output
        assert any(np.any(np.asarray(v) != 0) for v in want.values())


@each_case_linearized
def test_grad_gives_values_and_cotangents_and_no_tangents(case):
    prog, values, _ = case
    d = reaped(jax.grad(prog), X)
    want, cts = values(X), cotangents(prog, values, 1.0)
    assert set(d.keys()) == set(want) | {("vjp", n) for n in want}
    for n in want:
        close(d[n], want[n])
        close(d["vjp", n], cts[n])
    zeros = jax.tree.map(jnp.zeros_like, want)  # the plain-JAX rewrite is the same program
    close(jax.grad(prog)(X), jax.grad(lambda x: prog(x, zeros))(X))


@_JAX_WRONG
def test_the_cases_of_issue_31():
    # the numbers the issue gives, each from plain JAX
    d = reaped(jax.grad(stop_gradient_input), X)
    close(d["vjp", "a"], jnp.ones(3))
    d = reaped(jax.vjp(constant_scan, X)[1], 1.0)
    assert set(d.keys()) == {"s2"}
    close(d["s2"], jnp.zeros(3))
    d = reaped(jax.grad(constant_scan), X)
    close(d["s2"], jnp.full(3, -2.0))
    close(d["vjp", "s2"], jnp.zeros(3))
    d = reaped(jax.vjp(functools.partial(constant_after_live, in_scan=False), X)[1], 1.0)
    close(d["s1"], jnp.zeros(3))  # not cos(x), the live occurrence's
    d = reaped(jax.grad(append_rows), X)
    close(d["s1"], jnp.tile(W, (3, 1)))
    close(d["vjp", "s1"], jnp.zeros((3, 3)))


def _masked_site_in_a_constant_checkpoint(x, e=None):
    # a plain jax.vmap of a cond whose taken branch sows: the site carries a
    # mask (the rows that sow it), a primal value even where the site is linear
    def blk(a):
        def row(p, v, er):  # er: this row's perturbation (plain JAX)
            sown = (lambda v: lh.sow(jnp.sin(v), tag="t", name="s0", mode="clobber")) if (
                e is None) else (
                lambda v: jnp.sin(v) + er)
            return lax.cond(p > 0, sown, jnp.cos, v)
        preds, operands = jnp.array([1.0, -1.0]), jnp.stack([a, -a])
        if e is None:
            return jax.vmap(lambda p, v: row(p, v, None))(preds, operands)
        return jax.vmap(row)(preds, operands, e)
    return jnp.sum(jax.checkpoint(blk)(lax.stop_gradient(x)) * x)


def test_regression_masked_site_in_a_constant_checkpoint_under_reverse_mode():
    # (the wide law-5 run) the backward function raised TypeError: the zero
    # made linear for the constant site read its mask from a fresh reference
    # too, so the mask was an undefined primal in the transpose
    rows = jnp.stack([X, -X])
    want = jax.vjp(lambda e: _masked_site_in_a_constant_checkpoint(X, e),
                   jnp.zeros_like(rows))[1](CT)[0]
    close(want[1], 0.0)  # the second row takes the other branch: no occurrence
    d = reaped(jax.vjp(_masked_site_in_a_constant_checkpoint, X)[1], CT)
    assert set(d.keys()) == {"s0"}
    close(d["s0"], want)


def _constant_scan_in_a_checkpointed_scan_body(x, a, e=None):
    def outer(c, xi):
        def inner(c2, xj):
            v = xj * 1.5
            v = lh.sow(v, tag="t", name="s0", mode="append") if e is None else v
            return 0.5 * c2 + jnp.tanh(v), None
        lax.scan(inner, lax.stop_gradient(x), lax.stop_gradient(a))  # dead
        return 0.5 * c + jnp.tanh(a * xi), None
    return jnp.sum(lax.scan(jax.checkpoint(outer), a, a)[0])


@_JAX_WRONG
def test_constant_scan_in_a_checkpointed_scan_body_under_grad():
    # (the wide law-7 run) a dead constant scan nested in a checkpointed scan
    # body: nine rows, each with a zero cotangent (it reaches no output)
    a = jnp.array([0.2, 0.4, -0.6])
    d = reaped(jax.grad(_constant_scan_in_a_checkpointed_scan_body), X, a)
    rows = jnp.tile(a * 1.5, 3)  # three outer iterations of the inner scan
    assert set(d.keys()) == {"s0", ("vjp", "s0")}
    close(d["s0"], rows)
    close(d["vjp", "s0"], jnp.zeros(9))
    close(jax.grad(_constant_scan_in_a_checkpointed_scan_body)(X, a),
          jax.grad(lambda x: _constant_scan_in_a_checkpointed_scan_body(x, a, e=0.0))(X))


def _while_loop_in_a_constant_jit_in_a_checkpoint(x, sown=True):
    def step(s):
        v = jnp.sin(s[1])
        return s[0] + 1, lh.sow(v, tag="t", name="w", mode="clobber") if sown else v

    def blk(x):
        inner = jax.jit(lambda c: lax.while_loop(lambda s: s[0] < 2, step, (0, c))[1])
        return jnp.sin(x) + inner(lax.stop_gradient(x))
    return jnp.sum(jax.checkpoint(blk)(x))


def test_regression_while_loop_in_a_constant_construct_inside_a_checkpoint_under_grad():
    # (the differential import test) the zero given to the constant jit
    # reached its while loop, which the checkpoint's split put in the linear
    # part: jax.grad raised "Reverse-mode differentiation does not work for
    # lax.while_loop", outside any harvest too; JAX skips the loop
    fn = _while_loop_in_a_constant_jit_in_a_checkpoint
    want = jax.grad(lambda x: fn(x, sown=False))(X)
    close(jax.grad(fn)(X), want)
    d = reaped(jax.grad(fn), X)
    close(d["w"], jnp.sin(jnp.sin(X)))
    assert ("jvp", "w") not in d  # reverse mode shows no tangents
