"""Hooks into JAX's differentiation: linearization rules, bind hooks for
custom calls, tangents and zeros on a differentiation trace, and the
transposes of jit/scan/cond that must run a body holding sites."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as _core
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from lazyharvest._jax.core import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Primitive,
    Zero,
    no_constant_folding,
    scan_p,
    trace_flat,
)
from lazyharvest._jax.partial_eval import keep_effect, keep_staged, read_from_a_fresh_ref
from lazyharvest._jax.versions import BIND_TAKES_AVALS, BWD_RETURNS_LOGS, LINEARIZE_STRUCTURED


def register_remat_rule(prim: Primitive, rule: Callable) -> None:
    pe.partial_eval_jaxpr_custom_rules[prim] = rule


def policy_saves(saveable: Callable, eqn: JaxprEqn) -> bool:
    """Whether a jax.checkpoint policy (`saveable`, as a remat rule gets it)
    saves the outputs of `eqn` (rather than recomputing them)."""
    case = saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    if isinstance(case, bool):
        return case
    saved = getattr(_pe, "SaveableType", None)  # (an enum from jax 0.4.3x)
    return saved is not None and isinstance(case, saved)


def policy_recomputes(saveable: Callable, eqn: JaxprEqn) -> bool:
    """Whether a jax.checkpoint policy recomputes the outputs of `eqn` (it
    neither saves nor offloads them)."""
    case = saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    if isinstance(case, bool):
        return not case
    recompute = getattr(_pe, "RecomputeType", None)
    return recompute is not None and isinstance(case, recompute)


def has_effects(eqn: JaxprEqn) -> bool:
    """`eqn` has an effect that a jax.checkpoint split runs once, in the
    forward part (as JAX's partial evaluation decides)."""
    not_really = tuple(t for t in (getattr(_core, "NamedAxisEffect", None),
                                   getattr(_core, "InternalMutableArrayEffect", None))
                       if t is not None)
    return any(not isinstance(e, not_really) for e in eqn.effects)


def remat_rule(prim: Primitive) -> Callable:
    """The rule `register_remat_rule` registered for `prim`."""
    return pe.partial_eval_jaxpr_custom_rules[prim]


# --- hooks in force only while lazyharvest's state is set --------------------
# A custom call's bind hook, and the wrapper of its backward function, act
# only while a harvest is traced or a nest scope is entered (lazyharvest's
# state, per thread): they are installed while some thread is in such a block
# (`hooks_in_force`) and taken back after, so that JAX runs its own rules
# without a frame of ours in between. JAX counts the frames inside a
# custom_vjp's function, forward and backward rules (its tests/api_test.py,
# TracebackTest: `len(inspect.stack())`, every frame, not the traceback it
# filters for users, which hides the package's frames anyway:
# lazyharvest/__init__.py), and importing lazyharvest must change nothing a
# program can see.
_WHILE_IN_FORCE: list[tuple[Callable[[], None], Callable[[], None]]] = []
_in_force = [0]  # threads inside `hooks_in_force`
_in_force_lock = threading.Lock()


class _HooksInForce:
    # (a class, not a generator: entered on every call of a `nest`ed function)
    def __enter__(self) -> None:
        first_use()
        with _in_force_lock:
            if _in_force[0] == 0:
                for put, _ in _WHILE_IN_FORCE:
                    put()
            _in_force[0] += 1

    def __exit__(self, *exc: Any) -> None:
        with _in_force_lock:
            _in_force[0] -= 1
            if _in_force[0] == 0:
                for _, take_back in _WHILE_IN_FORCE:
                    take_back()


_HOOKS_IN_FORCE = _HooksInForce()


def hooks_in_force() -> contextlib.AbstractContextManager:
    """The hooks registered to act only in such a block are installed while
    any thread is inside one."""
    return _HOOKS_IN_FORCE


def _while_in_force(put: Callable[[], None], take_back: Callable[[], None]) -> None:
    with _in_force_lock:
        _WHILE_IN_FORCE.append((put, take_back))
        if _in_force[0]:
            put()


# A hook that must also act outside a harvest, on programs holding sites
# (call_hi_primitive's), is installed at the first use of lazyharvest in the
# process: the first site sown or `hooks_in_force` block entered. Until then
# a program that only imported lazyharvest binds with no frame of ours.
_FROM_FIRST_USE: list[Callable[[], None]] = []
_used = [False]


def first_use() -> None:
    """Installs, once, the hooks registered to act from lazyharvest's first
    use on (`register_bind_hook(..., from_first_use=True)`)."""
    if _used[0]:  # (the common case: no lock)
        return
    with _in_force_lock:
        if _used[0]:
            return
        _used[0] = True
        for put in _FROM_FIRST_USE:
            put()


def register_bind_hook(prim: Primitive, make_rule: Callable[[Callable], Callable],
                       only_in_force: bool = False, from_first_use: bool = False) -> None:
    """Every bind of `prim` goes through `make_rule(default)(trace, args, avals,
    params)`; `default` is JAX's own `bind_with_trace`. With `only_in_force`,
    only inside `hooks_in_force` blocks (JAX's own elsewhere); with
    `from_first_use`, from `first_use` on."""
    default = type(prim).bind_with_trace  # a custom call's class has its own
    if BIND_TAKES_AVALS:
        hook = make_rule(functools.partial(default, prim))
    else:  # jax < 0.9: bind_with_trace(trace, args, params), no avals
        def base(trace, args, avals, params):
            return default(prim, trace, args, params)
        rule = make_rule(base)

        def hook(trace, args, params):
            return rule(trace, args, tuple(jax.typeof(x) for x in args), params)
    # The hook's frames are not the user's: keep them out of eqns' source info.
    for path in (os.path.dirname(__file__) + os.sep, make_rule.__code__.co_filename):
        if path not in _source_info_util._exclude_paths:
            _source_info_util.register_exclusion(path)
    if from_first_use:
        with _in_force_lock:
            if not _used[0]:
                _FROM_FIRST_USE.append(lambda: prim.def_bind_with_trace(hook))
                return
    if not only_in_force:
        prim.def_bind_with_trace(hook)
        return
    before = vars(prim).get("bind_with_trace")

    def take_back() -> None:
        if before is None:
            vars(prim).pop("bind_with_trace", None)
        else:
            prim.def_bind_with_trace(before)
    _while_in_force(lambda: prim.def_bind_with_trace(hook), take_back)


def replace_subfuns(params: dict, make: Callable[..., tuple | None]) -> dict:
    """`params` of a custom call's bind with its functions (`fun, jvp` or `fun,
    fwd, bwd`, JAX's wrapped functions) replaced by `make(*subfuns)`, unless it
    returns None. jax 0.8 passes them outside `params`: left alone there."""
    subfuns = params.get("subfuns")
    new = None if subfuns is None else make(*subfuns)
    return params if new is None else dict(params, subfuns=new)


def wrap_custom_lin_bwd(make: Callable[[Any], Any]) -> None:
    """The transpose of a custom_vjp call's linear part runs `make(bwd)` in
    place of its backward function `bwd` (JAX's wrapped function), or `bwd`
    where `make` returns None; inside `hooks_in_force` blocks only."""
    prim = _ad.custom_lin_p
    table = (_ad.fancy_transposes if prim in _ad.fancy_transposes
             else _ad.primitive_transposes)  # (jax < 0.11)
    original = table[prim]
    if getattr(original, "_lazyharvest", False):
        return

    def rule(cts, *args, **params):
        new = make(params["bwd"])
        return original(cts, *args, **(params if new is None else dict(params, bwd=new)))
    rule._lazyharvest = True  # type: ignore[attr-defined]
    # jax >= 0.12 stages custom_lin under `jax.vjp` as a VJP node (see wrap_transpose)
    node = getattr(_ad, "vjp_node", None) if table is _ad.fancy_transposes else None

    def put() -> None:
        table[prim] = rule
        if node is not None:
            table[node(prim)] = rule

    def take_back() -> None:
        table[prim] = original
        if node is not None:
            table[node(prim)] = original
    _while_in_force(put, take_back)


def call_bwd(bwd: Any, *args: Any) -> tuple:
    """The cotangents a custom_vjp call's wrapped backward function `bwd`
    (from `params["subfuns"]`) gives for `args` (residuals, then cotangents)."""
    out = bwd.call_wrapped(*args)
    return tuple(out[0] if BWD_RETURNS_LOGS else out)


def wrapped_like(fn: Callable, like: Any) -> Any:
    """`fn`, which calls the wrapped function `like`, as a JAX wrapped
    function, for a custom call's `subfuns`."""
    fn._wraps = like  # type: ignore[attr-defined]  # (its stores: `trace_wrapped_avals`)
    return lu.wrap_init(fn, debug_info=like.debug_info)


def trace_wrapped(fun: Any, args: Sequence[Any]) -> tuple[Jaxpr, list[Any]]:
    """Traces the wrapped function `fun` at `args`' types (`trace_flat`),
    leaving the output stores it fills empty: JAX fills and reads them when it
    calls `fun` (or its rule) itself."""
    return trace_wrapped_avals(fun, [jax.typeof(x) for x in args])


def trace_wrapped_avals(fun: Any, avals: Sequence[Any], call: Callable | None = None
                        ) -> tuple[Jaxpr, list[Any]]:
    """`trace_wrapped` at these avals; `call(*args)` calls `fun` (default:
    `fun.call_wrapped`, or `fun` itself, a function over flat arguments)."""
    empty = [s for s in _stores(fun) if not _store_full(s)]
    call = call or getattr(fun, "call_wrapped", fun)
    try:
        return trace_flat(lambda *a: list(call(*a)), avals,
                          name="custom function")
    finally:
        for s in empty:
            _reset(s)


def call_fresh(fun: Any, *args: Any) -> Any:
    """`fun.call_wrapped(*args)` with its output stores emptied first, as
    JAX does before it traces a custom_vjp call's forward rule again."""
    for s in _stores(fun):
        if _store_full(s):
            _reset(s)
    return fun.call_wrapped(*args)


# JAX's transformation of a custom_vjp call's backward function when it binds
# the call again from a jaxpr (`get_bind_params`): the values the function
# closed over become ordinary operands of the new call, given zero cotangents.
# jax <= 0.12.0: `_handle_consts_in_bwd`, a `lu.transformation2` (a partial of
# its generator) given the closed-over values' avals. jax 0.12.1: a function
# that prepends a `Zero` per closed-over value with `prepend_input_cts`, which
# is the transformation `_prepend_input_cts` given the cotangents, or, for a
# rule taking accumulators, a `_PrependCtsBwdWithAccums` (`.cts`, and the rule
# it wraps as `.bwd`). Only the `Zero`s count: checkify prepends `None`s with
# the same function, which it did with a closure over `bwd` before (not
# counted there either).
def _generator(transformation: Any) -> Any:
    """The generator of a `lu.transformation2` (a partial), or None."""
    return getattr(transformation, "args", (None,))[0]


_HANDLE_CONSTS = _generator(getattr(_custom_derivatives, "_handle_consts_in_bwd", None))
_PREPEND_CTS = _generator(getattr(_custom_derivatives, "_prepend_input_cts", None))
_PREPEND_CTS_WITH_ACCUMS = getattr(_custom_derivatives, "_PrependCtsBwdWithAccums", ())


def closed_over_operands(params: dict) -> int:
    """How many leading operands of a custom_vjp call (`params`) are values
    its function closes over: its `num_consts`, and those of the calls it was
    bound again from, which are ordinary operands of this one but whose
    tangents its forward rule still refuses ("with respect to a closed-over
    value")."""
    n = params.get("num_consts", 0)
    bwd = params.get("bwd")
    while bwd is not None:
        if isinstance(bwd, _PREPEND_CTS_WITH_ACCUMS):  # (not a wrapped function)
            n += _zeros(bwd.cts)
            bwd = _wrapped_bwd(bwd.bwd)
            continue
        for generator, args in getattr(bwd, "transforms", ()):
            if generator is _HANDLE_CONSTS and args:
                n += len(args[0])
            elif generator is _PREPEND_CTS and args:
                n += _zeros(args[0])
        bwd = _wrapped_bwd(getattr(bwd, "f", None))
    return n


def _zeros(cts: Sequence[Any]) -> int:
    return sum(isinstance(ct, Zero) for ct in cts)


def _wrapped_bwd(f: Any) -> Any:
    """The backward function that `f` calls: `f` itself where it is JAX's
    wrapper of a rule taking accumulators that prepends cotangents (jax
    0.12.1), the one it wraps (`wrapped_like`), or, for a closure JAX made
    around one (the DCE of a custom_vjp call wraps its backward function),
    its free variable `bwd`."""
    if isinstance(f, _PREPEND_CTS_WITH_ACCUMS):
        return f
    inner = getattr(f, "_wraps", None)
    if inner is not None:
        return inner
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    free = dict(zip(code.co_freevars, cells)) if code is not None else {}
    cell = free.get("bwd")
    value = cell.cell_contents if cell is not None else None
    return value if isinstance(value, lu.WrappedFun) else None


def _stores(fun: Any) -> list:
    """The output stores of `fun` and of the functions it wraps (`wrapped_like`)."""
    out = [s for s in getattr(fun, "stores", ()) if s is not None]
    inner = getattr(getattr(fun, "f", None), "_wraps", None)
    return out + (_stores(inner) if inner is not None else [])


def _store_full(store: Any) -> bool:
    return bool(getattr(store, "_store", store))


def _reset(store: Any) -> None:
    getattr(store, "_store", store).reset()


def _to_jax_linearization(rule: Callable) -> Callable:
    """A rule in the four-value form as the running JAX calls rules."""
    if not LINEARIZE_STRUCTURED:
        return rule

    def structured(is_vjp, *args, **params):
        primals_out, nzs_out, residuals, linearized = rule(is_vjp, *args, **params)
        return (primals_out, nzs_out, residuals, None,
                lambda res, _structured, *tangents: linearized(res, *tangents))
    return structured


def register_linearization(prim: Primitive, rule: Callable) -> None:
    """`rule(is_vjp, nonzeros, *primals, **params) -> (primals_out,
    nonzeros_out, residuals, linearized)`; `linearized(residuals, *tangents)`
    runs on the tangent trace."""
    _ad.primitive_linearizations[prim] = _to_jax_linearization(rule)


linearization_rules = _ad.primitive_linearizations  # (tests remove sow's to break it)


def differentiation_kind(trace: Any) -> str | None:
    """"jvp" for a `jax.jvp` trace, "linearize" / "vjp" for the traces of
    `jax.linearize` / `jax.vjp` and `jax.grad`; None for any other trace."""
    if isinstance(trace, _ad.JVPTrace):
        return "jvp"
    if isinstance(trace, _ad.LinearizeTrace):
        return "vjp" if trace.is_vjp else "linearize"  # type: ignore[attr-defined]  # jax >= 0.9
    return None


def under_differentiation() -> bool:
    """Whether a differentiation (or its partial evaluation) is among the
    current traces, so values bound now may end up in a derived program."""
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace, _pe.JaxprTrace)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def has_tangent(trace: Any, x: Any) -> bool:
    """`x` carries a nonzero tangent of the differentiation trace `trace`."""
    return type(trace.to_primal_tangent_pair(x)[1]) is not Zero


def primal_of(trace: Any, x: Any) -> Any:
    """The primal value of `x` at the differentiation trace `trace`."""
    return trace.to_primal_tangent_pair(x)[0]


def differentiable(aval: Any) -> bool:
    """A value of this aval has tangents (float or complex, not int/bool)."""
    return aval.to_tangent_aval().dtype != jax.dtypes.float0


def tangent_trace(trace: Any) -> Any:
    """The trace tangents of a differentiation trace are computed on."""
    return getattr(trace, "tangent_trace", None) or trace.parent_trace


def zeros_tangent(aval: Any) -> Any:
    """Instantiated zeros of the tangent type of `aval`, on the current trace."""
    from jax._src import ad_util as _ad_util

    return _ad_util.zeros_like_aval(aval.to_tangent_aval())


def linear_zero(aval: Any) -> Any:
    """Zeros of the tangent type of `aval`, on the current (tangent) trace of
    a `jax.vjp`, that the backward pass treats as linear: a cotangent reaches
    the eqns that use them. (An eqn of the backward pass is transposed only if
    some input is linear; a value read from a fresh reference is, as JAX's own
    references are.)"""
    return read_from_a_fresh_ref(zeros_tangent(aval))


def with_tangent(trace: Any, primal: Any, tangent: Any) -> Any:
    """The tracer of the differentiation trace `trace` for a primal value (on
    its parent trace) and its tangent (on its tangent trace)."""
    if isinstance(trace, _ad.JVPTrace):
        return _ad.JVPTracer(trace, primal, tangent)
    return _ad.LinearizeTracer(trace, primal, tangent)


# Reverse mode differentiates `jax.checkpoint`'s body with jvp, then splits
# that jvp into a forward and a linear part (`linearize_from_jvp`). While the
# body's jvp is traced for such a split, a flag says so (a user context: it is
# part of the keys of JAX's caches, so a jvp traced for forward mode is not
# reused), and a constant site's zero tangent flows on (`_constant_site`):
# the linear part then carries its cotangent.
_splitting_checkpoint = jax.make_user_context(default_value=False)


def splitting_checkpoint() -> bool:
    """Whether the jvp being traced is `jax.checkpoint`'s, for reverse mode
    or `jax.linearize`."""
    return bool(_splitting_checkpoint.value)


def _wrap_checkpoint_jvp() -> None:
    from jax._src.ad_checkpoint import remat_p

    original = _ad.primitive_jvps[remat_p]
    if getattr(original, "_lazyharvest", False):
        return

    def jvp(primals, tangents, **params):
        if not any(isinstance(t, _pe.JaxprTracer) for t in tangents):  # forward mode
            return original(primals, tangents, **params)
        with _splitting_checkpoint(True):
            return original(primals, tangents, **params)

    jvp._lazyharvest = True  # type: ignore[attr-defined]
    _ad.primitive_jvps[remat_p] = jvp


_wrap_checkpoint_jvp()


def with_zero_tangent(trace: Any, x: Any, linear: bool,
                      zeros: Callable[[Any], Any] = zeros_tangent) -> Any:
    """`x` as a tracer of the differentiation trace `trace` with a zero
    tangent (one the backward pass treats as linear, with `linear`); on a
    `jax.jvp` trace, `zeros(aval)` makes it."""
    x = primal_of(trace, x)
    aval = jax.typeof(x)
    if isinstance(trace, _ad.JVPTrace):
        with _core.set_current_trace(trace.parent_trace):
            return _ad.JVPTracer(trace, x, zeros(aval))
    with _core.set_current_trace(trace.tangent_trace), no_constant_folding():
        zero = linear_zero(aval) if linear else zeros_tangent(aval)
    return _ad.LinearizeTracer(trace, x, zero)


def under_linearization(trace: Any) -> bool:
    """Whether a `jax.linearize`/`jax.vjp` trace or a partial evaluation is
    below `trace` (its values may end up in a linear function)."""
    while trace is not None:
        if isinstance(trace, (_ad.LinearizeTrace, _pe.JaxprTrace)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def records_program(trace: Any) -> bool:
    """Whether values bound on a `jax.jvp` trace end up in a traced program
    (False when every trace below is a JVP trace over eager evaluation)."""
    while isinstance(trace, _ad.JVPTrace):
        trace = trace.parent_trace
    return not isinstance(trace, _core.EvalTrace)


def wrap_linearization(prim: Primitive, keep: Callable[[JaxprEqn], bool],
                       forward_only: bool = False) -> None:
    """`prim`'s linearization keeps the tangent eqns `keep` selects (a jit,
    scan or cond holding tangent sites whose outputs nobody uses); with
    `forward_only`, under `jax.linearize` only, not `jax.vjp`."""
    original = _ad.primitive_linearizations.get(prim)
    if original is None:  # JAX linearizes `prim` from its JVP rule
        original = functools.partial(_ad.fallback_linearize_rule, prim)
    if getattr(original, "_lazyharvest", False):
        return

    def rule(is_vjp, *args, **params):
        if is_vjp and forward_only:
            return original(is_vjp, *args, **params)
        # (four values, or five with structured residuals on jax >= 0.11)
        *head, linearized = original(is_vjp, *args, **params)

        def kept(*a, **k):
            with keep_staged(keep):
                return linearized(*a, **k)
        return (*head, kept)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    _ad.primitive_linearizations[prim] = rule


def wrap_transpose(prim: Primitive, keep: Callable[[dict], bool],
                   show: Callable[[Jaxpr], Jaxpr] | None = None) -> None:
    """`prim`'s transpose (jit, scan, cond, remat) runs the backward pass of its
    body even when every cotangent reaching it is zero, if `keep(params)`:
    JAX skips a body whose cotangents are all zero unless it has effects, and
    a site there still records its (zero) cotangent. With `show(jaxpr)`, a
    body whose eqns themselves carry an effect, the body is shown so whatever
    the cotangents (remat's transpose partially evaluates its body again,
    which recomputes its effects from its eqns and drops dead ones)."""
    original = _ad.fancy_transposes.get(prim)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def shown(x: Any) -> Any:
        if isinstance(x, Jaxpr) and show is not None:  # (remat's body; on jax >=
            return show(x)  # 0.11 a Jaxpr is also a ClosedJaxpr)
        if isinstance(x, ClosedJaxpr):
            inner = x.jaxpr.replace(effects=x.jaxpr.effects | {keep_effect})
            return ClosedJaxpr(inner, x.consts)
        if isinstance(x, tuple):
            return tuple(shown(y) for y in x)
        return x

    def rule(cts_in, *args, **params):
        # (`show`: remat's transpose evaluates its body again, partially,
        # which may drop a dead part holding sites whatever the cotangents)
        if (show is not None or all(type(c) is Zero for c in cts_in)) and keep(params):
            params = {n: shown(v) for n, v in params.items()}
        if prim is scan_p and any(type(c) is Zero for c in cts_in):
            # A scan kept for its sites may get a symbolic-zero cotangent for
            # its stacked outputs (JAX's DCE would have dropped them), which
            # JAX's scan transpose does not slice per iteration.
            cts_in = [_ad.instantiate_zeros(c) for c in cts_in]
        return original(cts_in, *args, **params)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    _ad.fancy_transposes[prim] = rule
    # jax >= 0.12 stages `prim`'s tangent eqns under `jax.vjp` as a VJP node
    # made once per primitive, which copied the transpose rule in force then
    # (possibly JAX's own, if the user differentiated before importing us)
    node = getattr(_ad, "vjp_node", None)
    if node is not None:
        _ad.fancy_transposes[node(prim)] = rule


def show_to_backward_pass(show: Callable[[Jaxpr], bool]) -> None:
    """JAX's backward pass of a linear jaxpr (`jax.vjp`'s backward function)
    returns at once when every cotangent reaching it is zero (an output that
    does not depend on the differentiated inputs) and the jaxpr has no
    effect. A jaxpr for which `show(jaxpr)` holds (it holds cotangent sites
    to record) runs with an effect shown, so its sites get their zeros;
    inside `hooks_in_force` blocks only (a frame in every backward pass)."""
    original = getattr(_ad, "backward_pass3", None)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def backward_pass3(jaxpr, transform_stack, consts, primals_in, cotangents_in):
        if (not jaxpr.effects and all(type(c) is Zero for c in cotangents_in)
                and show(jaxpr)):
            from lazyharvest._jax.partial_eval import keep_effect
            jaxpr = jaxpr.replace(effects=jaxpr.effects | {keep_effect})
        return original(jaxpr, transform_stack, consts, primals_in, cotangents_in)
    backward_pass3._lazyharvest = True  # type: ignore[attr-defined]
    _while_in_force(lambda: setattr(_ad, "backward_pass3", backward_pass3),
                    lambda: setattr(_ad, "backward_pass3", original))


def internals() -> dict[str, Any]:
    """The JAX modules this module imports inside functions, by dotted name
    (for the contract tests, tests/jax_contracts/)."""
    from jax._src import ad_util as _ad_util

    return {"jax._src.ad_util": _ad_util}
