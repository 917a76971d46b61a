"""Every use of JAX internals lives here, so a JAX upgrade touches one file.

Pinned to jax 0.10.2. `jax.extend` and `jax.interpreters` carry no
compatibility guarantee; `jax._src` even less. Nothing else in the package may
import from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src import util as _util
from jax._src.interpreters import partial_eval as _pe
from jax.api_util import debug_info as _debug_info
from jax.api_util import flatten_fun_nokwargs as _flatten_fun_nokwargs
from jax.extend import linear_util as lu
from jax.extend.core import (  # noqa: F401  (re-exported to the package)
    ClosedJaxpr,
    Effect,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    new_jaxpr_eqn,
)
from jax.interpreters import ad, batching, mlir  # noqa: F401  (re-exported)
from jax.interpreters import partial_eval as pe

Zero = ad.Zero
UNSPECIFIED = _sharding_impls.UNSPECIFIED


# --- JAX's higher-order primitives, as objects (rule tables are keyed by them) ---

def _primitives() -> dict[str, Primitive]:
    from jax._src import custom_batching as _custom_batching
    from jax._src import custom_derivatives as _custom_derivatives
    from jax._src import shard_map as _shard_map
    from jax.extend.core import primitives as _prims

    return {
        "jit_p": _prims.jit_p, "scan_p": _prims.scan_p, "while_p": _prims.while_p,
        "cond_p": _prims.cond_p, "remat_p": _prims.remat_p,
        "closed_call_p": _prims.closed_call_p, "call_p": _prims.call_p,
        "custom_jvp_call_p": _prims.custom_jvp_call_p,
        "custom_vjp_call_p": _prims.custom_vjp_call_p,
        "shard_map_p": _shard_map.shard_map_p,
        "custom_vmap_p": _custom_batching.custom_vmap_p,
        "remat_opt_p": _custom_derivatives.remat_opt_p,
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
custom_vmap_p = _P["custom_vmap_p"]  # jax.custom_batching.custom_vmap / sequential_vmap
remat_opt_p = _P["remat_opt_p"]  # custom_vjp(optimize_remat=True), once differentiated


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


def dce(jaxpr: Jaxpr, used_outputs: Sequence[bool],
        instantiate: bool | Sequence[bool] = True) -> tuple[Jaxpr, list[bool]]:
    """JAX's DCE: (the jaxpr computing `used_outputs`, which inputs it uses)."""
    if not isinstance(instantiate, bool):
        instantiate = list(instantiate)
    return pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=instantiate)


def extra_dce_rules(rules: dict):
    """DCE rules in force only inside this block (for primitives JAX has none for)."""
    import contextlib

    @contextlib.contextmanager
    def installed():
        table = pe.dce_rules
        saved = {p: table[p] for p in rules if p in table}
        table.update(rules)
        try:
            yield
        finally:
            for p in rules:
                if p in saved:
                    table[p] = saved[p]
                else:
                    table.pop(p, None)
    return installed()


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def bind_params(eqn: JaxprEqn, params: dict | None = None) -> dict:
    """The parameters to re-bind `eqn`'s primitive with (subfuns for custom calls)."""
    return eqn.primitive.get_bind_params(eqn.params if params is None else params)


def eval_eqns(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
              eval_eqn: Callable[[JaxprEqn, list], list], in_context: bool = False) -> list:
    """Evaluates `jaxpr`, each eqn by `eval_eqn(eqn, invals) -> outvals`; with
    `in_context`, under the eqn's source info and JAX context (as re-binding)."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if in_context:
            with eqn_source(eqn), eqn.ctx.manager:
                outs = eval_eqn(eqn, invals)
        else:
            outs = eval_eqn(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def eqn_source(eqn: JaxprEqn) -> Any:
    """The context to re-bind `eqn` in, part 1: its source info and name stack
    (so `jax.named_scope` names reach the HLO), as `jax.core.eval_jaxpr` does."""
    info = eqn.source_info
    return _source_info_util.user_context(
        info.traceback, name_stack=_source_info_util.current_name_stack() + info.name_stack)


def eqn_context(eqn: JaxprEqn) -> Any:
    """Part 2: JAX's per-eqn context (compute type, xla metadata, ...)."""
    return eqn.ctx.manager


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


def axis_env(name_sizes: Sequence[tuple[Any, int]]):
    """Binds vmap axis names (for collectives) while tracing a per-example body."""
    import contextlib

    if not name_sizes:
        return contextlib.nullcontext()
    return _core.extend_axis_env_nd(list(name_sizes))


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


# --- partial evaluation of lax.cond keeps effectful branches -------------------------
# JAX's partial-eval rule for `cond` (used by jax.linearize/grad and by the
# transpose of jax.checkpoint) stages the unknown half of the branches as one
# eqn recipe but, unlike an ordinary primitive, does not register it with the
# trace's effect handles: when none of its outputs is used (a dead site's
# tangent copy) the eqn is dropped, effects and all. The wrapper gives that
# recipe one extra, empty output (a slice of an unknown operand) so it can be
# found, registers it like JAX does for any effectful eqn, and returns the
# original outputs.

def keep_effects_in_cond_partial_eval(effect_type: type) -> None:
    """Makes `cond`'s partial eval keep staged branches with `effect_type`."""
    rules = pe.custom_partial_eval_rules
    original = rules[cond_p]
    if getattr(original, "_lazyharvest", False):
        return

    def rule(trace, *tracers, branches, **params):
        unknown = [not t.pval.is_known() for t in tracers]
        has_effect = any(isinstance(e, effect_type) for b in branches
                         for e in b.jaxpr.effects)
        ops = [i for i, uk in enumerate(unknown[1:], 1)
               if uk and isinstance(tracers[i].aval, _core.ShapedArray)]
        if unknown[0] or not has_effect or not ops:
            return original(trace, *tracers, branches=branches, **params)
        which = ops[0] - 1  # the branches' operand that feeds the empty output
        outs = original(trace, *tracers, branches=tuple(
            _with_empty_output(b, which) for b in branches), **params)
        *outs, marker = outs
        recipe = marker.recipe
        if recipe is not None and _effects.partial_eval_kept_effects.filter_in(
                recipe.effects):
            trace.effect_handles.append(_pe.EffectHandle(list(recipe.in_tracers), recipe))
        return outs

    rule._lazyharvest = True  # type: ignore[attr-defined]
    rules[cond_p] = rule


@_util.weakref_lru_cache
def _with_empty_output(branch: ClosedJaxpr, which: int) -> ClosedJaxpr:
    """`branch` with one more output: an empty slice of its operand `which`."""
    def fn(*args):
        outs = jax.core.eval_jaxpr(branch.jaxpr, branch.consts, *args)
        return [*outs, jax.numpy.ravel(args[which])[:0]]
    jaxpr, consts = trace_flat(fn, branch.in_avals)
    return ClosedJaxpr(jaxpr, consts)


# --- sites stay inside the scan loops they are sown in ------------------------------
# When JAX splits a scan for differentiation, it hoists the computations of the
# known (primal) scan that depend only on its constants out of the loop
# (`_scan_known_hoisting`, in both `_scan_partial_eval` and `_scan_linearize`):
# they run once. A site there would be sown once instead of once per
# iteration. While that hoisting runs, a flag (a user context: it is part of
# the keys of JAX's caches, which therefore never mix the two behaviours) asks
# the partial-eval rule of `prim` to stage such a site as unknown, so it stays
# in the loop; its (hoisted) input enters the loop as a constant.

_hoisting = jax.make_user_context(default_value=False)


def keep_in_scan_loops(prim: Primitive, effect_type: type,
                       keep: Callable[[dict], bool]) -> None:
    """Eqns of `prim` with `keep(params)` are not hoisted out of scans."""
    from jax._src.lax.control_flow import loops as _loops

    original = _loops._scan_known_hoisting
    if not getattr(original, "_lazyharvest", False):
        def hoisting(jaxpr_known, known_consts, num_res):
            if not any(isinstance(e, effect_type) for e in jaxpr_known.effects):
                return original(jaxpr_known, known_consts, num_res)
            with _hoisting(True):
                return original(jaxpr_known, known_consts, num_res)

        hoisting._lazyharvest = True  # type: ignore[attr-defined]
        _loops._scan_known_hoisting = hoisting

    def rule(trace, *tracers, **params):
        if _hoisting.value and keep(params) and all(t.pval.is_known() for t in tracers):
            tracers = tuple(trace.instantiate_const(t) for t in tracers)
        return trace.default_process_primitive(prim, tracers, params)

    pe.custom_partial_eval_rules[prim] = rule
