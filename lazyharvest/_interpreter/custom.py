"""Rules for `custom_jvp_call` and `custom_vjp_call`: the user's rule stays.

Sites of the primal function are reaped from an inline copy of it (DCE drops
the copy when no reaped value is used); the outputs still come from the
custom call, so the user's derivative rule stays in force.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import PlantOperands, strip_sites
from lazyharvest._interpreter.run import EVAL_RULES, Run, bind
from lazyharvest._interpreter.sites import count_occurrences, jaxpr_has_sites
from lazyharvest.primitive import active_tags, harvested_sows


def _custom(run: Run, eqn: _jax.JaxprEqn, invals: list, *, call_jaxpr, **_) -> list:
    counts = count_occurrences(call_jaxpr.jaxpr, run.harvest)
    if any(k in run.plants for k in counts):
        return _custom_planted(run, eqn, invals, call_jaxpr)
    if any(run.want(k) for k in counts):
        run.eval(call_jaxpr.jaxpr, call_jaxpr.consts, invals)
    return bind(eqn, invals, dict(eqn.params, call_jaxpr=strip_sites(run, call_jaxpr)))


EVAL_RULES[_jax.custom_jvp_call_p] = _custom
EVAL_RULES[_jax.custom_vjp_call_p] = _custom


# --- JAX's differentiation inside a harvest ------------------------------------
#
# A JAX differentiation traced inside a harvest runs the user's rule (jvp or
# fwd) instead of the primal function, whose sites would never be traced. The
# bind hooks below make the rule also evaluate a copy of the primal function
# when it sows a harvested tag: its sites are then traced like any others (a
# custom_jvp function's under `jax.jvp`, so they get tangents; a custom_vjp
# function's as values only), while the outputs still come from the rule.

def _harvested_sites(fun: Any, primals: Sequence[Any]) -> _jax.ClosedJaxpr | None:
    """The primal function traced at `primals`, if it sows a harvested tag."""
    tags = active_tags()
    if not tags:
        return None
    jaxpr, consts = _jax.trace_wrapped(fun, primals)
    if not any(jaxpr_has_sites(jaxpr, t) for t in tags):
        return None
    return _jax.ClosedJaxpr(jaxpr, consts)


def _dense(t: Any) -> Any:
    if isinstance(t, SymbolicZero):
        return np.zeros(t.shape, t.dtype) if t.dtype == jax.dtypes.float0 else jnp.zeros(
            t.shape, t.dtype)
    return t


def _jvp_with_sites(fun: Any, jvp: Any) -> tuple:
    def rule(*xs: Any) -> Any:
        n = len(xs) // 2
        before = harvested_sows()
        out = jvp.call_wrapped(*xs)
        # A rule that sows (most call the function itself) has its own sites.
        closed = None if harvested_sows() != before else _harvested_sites(fun, xs[:n])
        if closed is not None:
            jax.jvp(lambda *p: _jax.eval_jaxpr(closed.jaxpr, closed.consts, *p),
                    tuple(xs[:n]), tuple(map(_dense, xs[n:])))
        return out
    return fun, _jax.wrapped_like(rule, jvp)


def _fwd_with_sites(fun: Any, fwd: Any, bwd: Any) -> tuple:
    def rule(*xs: Any) -> Any:  # (primal, perturbed) pairs
        before = harvested_sows()
        out = fwd.call_wrapped(*xs)
        closed = None if harvested_sows() != before else _harvested_sites(fun, xs[::2])
        if closed is not None:
            _jax.eval_jaxpr(closed.jaxpr, closed.consts, *xs[::2])
        return out
    return fun, _jax.wrapped_like(rule, fwd), bwd


def _make_custom_bind(with_sites: Callable[..., tuple]) -> Callable:
    def make(default: Callable) -> Callable:
        def bind_with_trace(trace, args, avals, params):
            if (active_tags() and _jax.differentiation_kind(trace) is not None
                    and any(_jax.has_tangent(trace, x) for x in args)):
                params = _jax.replace_subfuns(params, with_sites)
            return default(trace, args, avals, params)
        return bind_with_trace
    return make


if _jax.CUSTOM_CALL_HOOKS:  # (jax 0.8: these sites stay unreaped)
    _jax.register_bind_hook(_jax.custom_jvp_call_p, _make_custom_bind(_jvp_with_sites))
    _jax.register_bind_hook(_jax.custom_vjp_call_p, _make_custom_bind(_fwd_with_sites))


def _custom_vmap(run: Run, eqn: _jax.JaxprEqn, invals: list, *, call, **_) -> list:
    """`custom_vmap`: reaped from an inline copy; the user's batching rule stays
    for the outputs. A planted call runs its planted body inline (the rule, a
    statement about the unplanted function, no longer applies)."""
    counts = count_occurrences(call.jaxpr, run.harvest)
    if any(k in run.plants for k in counts):
        return run.eval(call.jaxpr, call.consts, invals)
    if any(run.want(k) for k in counts):
        run.eval(call.jaxpr, call.consts, invals)
    return bind(eqn, invals, dict(eqn.params, call=strip_sites(run, call)))


EVAL_RULES[_jax.custom_vmap_p] = _custom_vmap


def _remat_opt(run: Run, eqn: _jax.JaxprEqn, invals: list, *, fwd_jaxpr, **_) -> list:
    """The forward of a `custom_vjp(optimize_remat=True)`, once differentiated:
    evaluated inline under a harvest (same values and derivatives; the harvested
    program does not get the remat optimization)."""
    return run.eval(fwd_jaxpr.jaxpr, fwd_jaxpr.consts, invals)


EVAL_RULES[_jax.remat_opt_p] = _remat_opt


def _custom_planted(run: Run, eqn: _jax.JaxprEqn, invals: list,
                    closed: _jax.ClosedJaxpr) -> list:
    """A custom_jvp/vjp call with plants inside its primal function.

    The planted primal is a new custom function of (inputs, plants) whose
    derivative rule is the user's, applied to the inputs; plants get a zero
    derivative, like any constant.
    """
    counts = count_occurrences(closed.jaxpr, run.harvest)
    ops = PlantOperands.of(run, [k for k in counts if k in run.plants])
    start, n_in = dict(run.cursor), len(invals)

    def planted(*args):
        inner = run.nested(ops.plants(run.plants, args[n_in:]), start)
        return inner.eval(closed.jaxpr, closed.consts, args[:n_in]), inner

    if any(run.want(k) for k in counts):
        _, inner = planted(*invals, *ops.leaves)
        run.begin_passes(inner.primal_sown)
        for k, r in inner.records.items():
            run.record_all(k, r)
    for k in ops.keys:
        run.cursor[k] = start.get(k, 0) + counts[k]
    stripped = dict(eqn.params, call_jaxpr=strip_sites(run, closed))
    original = lambda *xs: bind(eqn, list(xs), stripped)
    primal = lambda *a: planted(*a)[0]
    # The leading `num_consts` operands are values the user's function closes
    # over: like the plants, they are operands the user's rule does not
    # differentiate.
    n_c = eqn.params.get("num_consts", 0)
    if eqn.primitive is _jax.custom_jvp_call_p:
        fun = _with_jvp_of(original, primal, n_c, n_in)
    else:
        fun = _with_vjp_of(original, primal, n_c, n_in)
    return list(fun(*invals, *ops.leaves))


def _with_jvp_of(original: Callable, primal: Callable, n_c: int, n_in: int) -> Callable:
    """`primal(*consts, *xs, *plants)` whose JVP is `original`'s in `xs`
    (consts and plants: zero)."""
    fun = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        consts = primals[:n_c]
        _, t_out = jax.jvp(lambda *xs: original(*consts, *xs),
                           primals[n_c:n_in], tangents[n_c:n_in])
        return primal(*primals), t_out
    fun.defjvp(jvp)
    return fun


def _with_vjp_of(original: Callable, primal: Callable, n_c: int, n_in: int) -> Callable:
    """`primal(*consts, *xs, *plants)` whose VJP is `original`'s in the `xs` that
    are perturbed (consts, plants and unperturbed inputs get none: libraries
    such as Equinox check that their non-differentiated inputs stay so)."""
    fun = jax.custom_vjp(primal)

    def fwd(*a: Any):
        vals = [x.value for x in a]
        idx = [i for i in range(n_c, n_in) if a[i].perturbed]

        def part(*ps: Any) -> Any:
            full = list(vals[:n_in])
            for i, p in zip(idx, ps):
                full[i] = p
            return original(*full)
        _, vjp = jax.vjp(part, *[vals[i] for i in idx])
        return primal(*vals), (vjp, idx, len(vals))

    def bwd(res, cts):
        vjp, idx, n = res
        cts = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
               for c in cts]
        out: list = [None] * n
        for i, g in zip(idx, vjp(list(cts))):
            out[i] = g
        return tuple(out)
    fun.defvjp(fwd, bwd, symbolic_zeros=True)
    return fun
