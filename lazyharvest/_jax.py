"""Every use of JAX internals lives here, so a JAX upgrade touches one file.

Pinned to jax 0.10.2. `jax.extend` and `jax.interpreters` carry no
compatibility guarantee; `jax._src` even less. Nothing else in the package may
import from them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax.api_util import debug_info as _debug_info
from jax.api_util import flatten_fun_nokwargs as _flatten_fun_nokwargs
from jax.extend import linear_util as lu
from jax.extend.core import (
    ClosedJaxpr,
    Effect,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    new_jaxpr_eqn,
)
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

__all__ = [
    "ClosedJaxpr", "Effect", "Jaxpr", "JaxprEqn", "Literal", "Primitive", "Var",
    "ad", "batching", "mlir", "pe", "lu", "new_jaxpr_eqn",
    "jit_p", "scan_p", "while_p", "cond_p", "remat_p", "closed_call_p", "call_p",
    "custom_jvp_call_p", "custom_vjp_call_p", "shard_map_p",
]

Zero = ad.Zero
UNSPECIFIED = _sharding_impls.UNSPECIFIED


# --- JAX's higher-order primitives, as objects (rule tables are keyed by them) ---

def _primitives() -> dict[str, Primitive]:
    from jax._src import shard_map as _shard_map
    from jax.extend.core import primitives as _prims

    return {
        "jit_p": _prims.jit_p, "scan_p": _prims.scan_p, "while_p": _prims.while_p,
        "cond_p": _prims.cond_p, "remat_p": _prims.remat_p,
        "closed_call_p": _prims.closed_call_p, "call_p": _prims.call_p,
        "custom_jvp_call_p": _prims.custom_jvp_call_p,
        "custom_vjp_call_p": _prims.custom_vjp_call_p,
        "shard_map_p": _shard_map.shard_map_p,
    }


_P = _primitives()
jit_p = _P["jit_p"]
scan_p = _P["scan_p"]
while_p = _P["while_p"]
cond_p = _P["cond_p"]
remat_p = _P["remat_p"]
closed_call_p = _P["closed_call_p"]
call_p = _P["call_p"]
custom_jvp_call_p = _P["custom_jvp_call_p"]
custom_vjp_call_p = _P["custom_vjp_call_p"]
shard_map_p = _P["shard_map_p"]


# --- tracebacks: hide the library's frames from users, as JAX does its own ---

def hide_frames_below(path: str) -> None:
    """Frames from files under `path` are dropped from users' tracebacks."""
    _traceback_util.register_exclusion(path)


api_boundary = _traceback_util.api_boundary


def closed_call(fn: Callable, *args: Any) -> list:
    """Calls `fn` through JAX's `closed_call` primitive (tests use it)."""
    from jax.extend.core import primitives as _prims

    flat = list(args)
    jaxpr, consts = trace_flat(lambda *a: list(fn(*a)), [jax.typeof(x) for x in flat])
    params = _prims.closed_call_p.get_bind_params(
        {"call_jaxpr": ClosedJaxpr(jaxpr, consts)})
    return _prims.closed_call_p.bind(*flat, **params)


def register_effect(effect_type: type) -> None:
    """Allow an unordered effect everywhere a site may appear."""
    mlir.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)
    _effects.partial_eval_kept_effects.add_type(effect_type)


def register_batcher(prim: Primitive, rule: Callable) -> None:
    batching.primitive_batchers[prim] = rule


def register_remat_rule(prim: Primitive, rule: Callable) -> None:
    pe.partial_eval_jaxpr_custom_rules[prim] = rule


def remat_rule(prim: Primitive) -> Callable:
    """The rule `register_remat_rule` registered for `prim`."""
    return pe.partial_eval_jaxpr_custom_rules[prim]


def replace_eqn_params(eqn: JaxprEqn, **params: Any) -> JaxprEqn:
    return new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive,
                         dict(eqn.params, **params), eqn.effects,
                         eqn.source_info, eqn.ctx)


def in_eager_mode() -> bool:
    """True when no transformation or tracing is active."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def is_tracer(x: Any) -> bool:
    return isinstance(x, _core.Tracer)


def any_tracer(xs: Sequence[Any]) -> bool:
    tracer = _core.Tracer
    for x in xs:  # noqa: SIM110  (a plain loop: this runs on every call)
        if isinstance(x, tracer):
            return True
    return False


def tracer_is_dead(x: Any) -> bool:
    """A tracer whose trace is not among the active ones (it has ended)."""
    if not isinstance(x, _core.Tracer):
        return False
    if not x._trace.is_valid():
        return True
    t = _core.trace_ctx.trace
    while t is not None:
        if t is x._trace:
            return False
        t = getattr(t, "parent_trace", None)
    return True


def trace_context() -> Any:
    """The part of JAX's configuration that jit keys its trace cache on."""
    return _config.trace_context()


def trace_flat(fn: Callable, in_avals: Sequence[Any], name: str = "lazyharvest"
               ) -> tuple[Jaxpr, list[Any]]:
    """Traces `fn(*flat) -> list` to an open jaxpr and the consts it closed over.

    Closed-over values (outer tracers included) come back as consts so callers
    can pass them explicitly; nothing is evaluated.
    """
    dbg = _debug_info(name, fn, tuple(in_avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=dbg),
                                                 list(in_avals))
    return jaxpr, list(consts)


def trace_pytree(fn: Callable, in_tree: Any, in_avals: Sequence[Any],
                 name: str = "lazyharvest") -> tuple[ClosedJaxpr, Any]:
    """Traces a pytree function on flat avals; returns (closed jaxpr, out tree)."""
    dbg = _debug_info(name, fn, tuple(in_avals), {})
    flat_fn, out_tree = _flatten_fun_nokwargs(lu.wrap_init(fn, debug_info=dbg), in_tree)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(flat_fn, list(in_avals))
    return ClosedJaxpr(jaxpr, consts), out_tree()


def consts_as_invars(jaxpr: Jaxpr) -> Jaxpr:
    """Moves constvars to the front of invars."""
    return _pe.convert_constvars_jaxpr(jaxpr)


def dce(jaxpr: Jaxpr, used_outputs: Sequence[bool]) -> tuple[Jaxpr, list[bool]]:
    return pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=True)


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def bind_params(eqn: JaxprEqn, params: dict | None = None) -> dict:
    """The parameters to re-bind `eqn`'s primitive with (subfuns for custom calls)."""
    return eqn.primitive.get_bind_params(eqn.params if params is None else params)


def eqn_context(eqn: JaxprEqn):
    """The context to re-bind `eqn` in: its source info and name stack (so
    `jax.named_scope` names reach the HLO) and its JAX eqn context."""
    import contextlib

    stack = contextlib.ExitStack()
    info = eqn.source_info
    stack.enter_context(_source_info_util.user_context(
        info.traceback, name_stack=_source_info_util.current_name_stack()
        + info.name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def effects_of(jaxpr: Jaxpr) -> Any:
    return jaxpr.effects


def shard_map_body_context(mesh: Any, manual_axes: frozenset, check_vma: bool):
    """The context JAX traces a shard_map body in (axis names, manual mesh)."""
    import contextlib

    from jax._src import mesh as _mesh
    from jax._src import shard_map as _shard_map

    stack = contextlib.ExitStack()
    stack.enter_context(_shard_map._extend_axis_env(mesh, manual_axes))
    stack.enter_context(_mesh.use_abstract_mesh(
        _shard_map._as_manual_mesh(mesh, manual_axes)))
    stack.enter_context(_config._check_vma(check_vma))
    return stack


def varying_axes(aval: Any) -> frozenset:
    """Mesh axes over which a value (given by its aval) varies inside shard_map."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def local_aval(mesh: Any, manual_axes: frozenset, check_vma: bool, spec: Any,
               value: Any) -> Any:
    """The per-device aval, inside shard_map, of a global value with `spec`."""
    return _core.shard_aval(mesh, manual_axes, check_vma, spec, jax.typeof(value))


def wrap_cond_batcher(make_rule: Callable[[Callable], Callable]) -> None:
    """Replaces the vmap rule of `lax.cond` by `make_rule(original_rule)`."""
    from jax._src.lax.control_flow import conditionals as _cond

    batchers = _jax_batching_private().fancy_primitive_batchers
    original = batchers[_cond.cond_p]
    if getattr(original, "_lazyharvest", False):
        return
    rule = make_rule(original)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    batchers[_cond.cond_p] = rule


def _jax_batching_private():
    from jax._src.interpreters import batching as _batching
    return _batching


# --- constant and dead sites under JAX's own differentiation ------------------
# JAX calls a primitive's differentiation rule only when some input carries a
# nonzero tangent, and drops effect-free eqns whose outputs nobody uses (the
# tangent traces of linearize hold such eqns weakly; its DCE passes remove
# them). The helpers below let `sow` give a constant site a (zero) tangent and
# keep a tangent site alive in the linear program until its trace ends.

def register_bind_hook(prim: Primitive, make_rule: Callable[[Callable], Callable]) -> None:
    """Every bind of `prim` goes through `make_rule(default)(trace, args, avals,
    params)`; `default` is JAX's own `bind_with_trace`."""
    default = _core.Primitive.bind_with_trace

    def base(trace, args, avals, params):
        return default(prim, trace, args, avals, params)
    prim.def_bind_with_trace(make_rule(base))
    # The hook's frames are not the user's: keep them out of eqns' source info.
    for path in (__file__, make_rule.__code__.co_filename):
        if path not in _source_info_util._exclude_paths:
            _source_info_util.register_exclusion(path)


def register_linearization(prim: Primitive, rule: Callable) -> None:
    """`rule(is_vjp, nonzeros, *primals, **params) -> (primals_out,
    nonzeros_out, residuals, linearized)`; `linearized(residuals, *tangents)`
    runs on the tangent trace."""
    _ad.primitive_linearizations[prim] = rule


def register_dce_rule(prim: Primitive, rule: Callable) -> None:
    """`rule(used_outputs, eqn) -> (used_inputs, eqn or None)`."""
    pe.dce_rules[prim] = rule


def default_dce_rule(used_outputs: Sequence[bool], eqn: JaxprEqn) -> tuple[list, Any]:
    return _pe._default_dce_rule(list(used_outputs), eqn)


def differentiation_kind(trace: Any) -> str | None:
    """"jvp" for a `jax.jvp` trace, "linearize" / "vjp" for the traces of
    `jax.linearize` / `jax.vjp` and `jax.grad`; None for any other trace."""
    if isinstance(trace, _ad.JVPTrace):
        return "jvp"
    if isinstance(trace, _ad.LinearizeTrace):
        return "vjp" if trace.is_vjp else "linearize"
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


def parent_trace(trace: Any) -> Any:
    return trace.parent_trace


def tangent_trace(trace: Any) -> Any:
    """The trace tangents of a differentiation trace are computed on."""
    return getattr(trace, "tangent_trace", None) or trace.parent_trace


def current_trace(trace: Any):
    return _core.set_current_trace(trace)


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
    return _core.freeze(_core.new_ref(zeros_tangent(aval)))


def with_tangent(trace: Any, primal: Any, tangent: Any) -> Any:
    """The tracer of the `jax.linearize`/`jax.vjp` trace `trace` for a primal
    value (on its parent trace) and its tangent (on its tangent trace)."""
    return _ad.LinearizeTracer(trace, primal, tangent)


def with_zero_tangent(trace: Any, x: Any, linear: bool) -> Any:
    """`x` as a tracer of the differentiation trace `trace` with a zero
    tangent (one the backward pass treats as linear, with `linear`)."""
    x = primal_of(trace, x)
    aval = jax.typeof(x)
    if isinstance(trace, _ad.JVPTrace):
        with _core.set_current_trace(trace.parent_trace):
            return _ad.JVPTracer(trace, x, zeros_tangent(aval))
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


def under_eager_shard_map(trace: Any) -> bool:
    """Whether an eager (un-jitted) `shard_map` is among the traces below."""
    from jax._src import shard_map as _shard_map

    while trace is not None:
        if isinstance(trace, _shard_map.ShardMapTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


class _KeepEffect(Effect):
    """Shown transiently to JAX's DCE rules of jit/scan/cond so they look
    inside an eqn none of whose outputs is used; never stored in a jaxpr."""


_keep_effect = _KeepEffect()


@contextlib.contextmanager
def keep_staged(keep: Callable[[JaxprEqn], bool]):
    """Eqns staged inside the block for which `keep(eqn)` holds stay in the
    current jaxpr trace until it ends, even if nothing uses their outputs.

    JAX's tangent traces (`auto_dce`) hold effect-free eqns by weak reference:
    this turns those references into strong ones, as for effectful eqns.
    """
    frame = getattr(_core.trace_ctx.trace, "frame", None)
    if frame is None or not frame.auto_dce:
        yield
        return
    start = len(frame.tracing_eqns)
    frame.auto_dce = False  # hold every eqn staged in the block, even output-less ones
    try:
        yield
    finally:
        frame.auto_dce = True
        staged = frame.tracing_eqns
        for i in range(start, len(staged)):
            eqn = staged[i]
            if not isinstance(eqn, weakref.ReferenceType) and not eqn.effects \
                    and not keep(eqn):
                staged[i] = weakref.ref(eqn)  # as JAX would have held it


def wrap_linearization(prim: Primitive, keep: Callable[[JaxprEqn], bool]) -> None:
    """`prim`'s linearization keeps the tangent eqns `keep` selects (a jit,
    scan or cond holding tangent sites whose outputs nobody uses)."""
    original = _ad.primitive_linearizations.get(prim)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def rule(*args, **params):
        primals_out, nzs_out, residuals, linearized = original(*args, **params)

        def kept(*a, **k):
            with keep_staged(keep):
                return linearized(*a, **k)
        return primals_out, nzs_out, residuals, kept
    rule._lazyharvest = True  # type: ignore[attr-defined]
    _ad.primitive_linearizations[prim] = rule


def wrap_dce_rule(prim: Primitive, keep: Callable[[JaxprEqn], bool]) -> None:
    """`prim`'s DCE rule looks inside an eqn `keep` selects even when none of
    its outputs is used (JAX's rules drop such an effect-free eqn whole)."""
    original = pe.dce_rules.get(prim)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def rule(used_outputs, eqn):
        if not any(used_outputs) and keep(eqn):
            shown = new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive, eqn.params,
                                  eqn.effects | {_keep_effect}, eqn.source_info, eqn.ctx)
            used_inputs, new_eqn = original(used_outputs, shown)
            if new_eqn is None:  # (jit drops a body that uses no input): keep it whole
                return [True] * len(eqn.invars), eqn
            return used_inputs, new_eqn
        return original(used_outputs, eqn)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    pe.dce_rules[prim] = rule


def register_partial_eval_rule(prim: Primitive, rule: Callable) -> None:
    """`rule(trace, *tracers, **params)` for JAX's partial evaluation
    (`JaxprTrace`: `jax.checkpoint`'s transpose, `jax.linear_transpose`...)."""
    _pe.custom_partial_eval_rules[prim] = rule


def partial_eval_kept(trace: Any, prim: Primitive, tracers: Sequence[Any],
                      params: dict) -> list:
    """Partial evaluation of `prim` as JAX does it by default, except that an
    eqn it stages stays in the jaxpr even if no output is used (as an eqn
    with an effect would)."""
    outs = trace.default_process_primitive(prim, list(tracers), params)
    recipe = getattr(outs[0], "recipe", None) if outs else None
    if isinstance(recipe, _pe.JaxprEqnRecipe):
        trace.effect_handles.append(_pe.EffectHandle(list(recipe.in_tracers), recipe))
    return outs


def folds_constants(trace: Any, args: Sequence[Any]) -> bool:
    """Whether `trace` would evaluate an op on `args` right away instead of
    staging it (inside `jax.ensure_compile_time_eval`)."""
    return (isinstance(trace, _pe.DynamicJaxprTrace)
            and _config.eager_constant_folding.value and not any_tracer(args))


def stage_unfolded(trace: Any, prim: Primitive, args: Sequence[Any], params: dict) -> Any:
    """Stages `prim` on the jaxpr trace `trace` even where constant folding
    would evaluate it."""
    info = _source_info_util.current()
    tracers = [trace.to_jaxpr_tracer(x, info) for x in args]
    return trace.default_process_primitive(prim, tracers, params, info)


def no_constant_folding():
    return _config.eager_constant_folding(False)


def wrap_transpose(prim: Primitive, keep: Callable[[dict], bool]) -> None:
    """`prim`'s transpose (jit, scan, cond) runs the backward pass of its body even
    when every cotangent reaching it is zero, if `keep(params)`: JAX skips a
    body whose cotangents are all zero unless it has effects, and a site
    there still records its (zero) cotangent."""
    original = _ad.fancy_transposes.get(prim)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def shown(x: Any) -> Any:
        if isinstance(x, ClosedJaxpr):
            inner = x.jaxpr.replace(effects=x.jaxpr.effects | {_keep_effect})
            return ClosedJaxpr(inner, x.consts)
        if isinstance(x, tuple):
            return tuple(shown(y) for y in x)
        return x

    def rule(cts_in, *args, **params):
        if all(type(c) is Zero for c in cts_in) and keep(params):
            params = {n: shown(v) for n, v in params.items()}
        return original(cts_in, *args, **params)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    _ad.fancy_transposes[prim] = rule
