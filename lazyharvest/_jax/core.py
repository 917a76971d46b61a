"""JAX's core, as the package uses it: jaxpr types, JAX's higher-order
primitives as objects, tracing a function to a jaxpr, evaluating and
re-binding eqns, tracers and traces, and registering effects and batchers."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import array as _array
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src import tree_util as _tree_util
from jax._src.interpreters import partial_eval as _pe
from jax._src.state import discharge as _discharge
from jax.api_util import debug_info as _debug_info
from jax.api_util import flatten_fun_nokwargs as _flatten_fun_nokwargs
from jax.extend import linear_util as lu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var  # noqa: F401  (re-exported to the package)
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

# jax >= 0.10 exports these from jax.extend.core; 0.8 and 0.9 keep them in _src.
try:
    from jax.extend.core import Effect, new_jaxpr_eqn  # type: ignore[attr-defined]  # noqa: F401
except ImportError:  # jax < 0.10
    from jax._src.core import new_jaxpr_eqn
    from jax._src.effects import Effect  # noqa: F401

from lazyharvest._identity_cache import MISSING, IdentityCache
from lazyharvest._jax.versions import BIND_PARAMS_SPLIT, CUSTOM_HI_PRIMS, MERGED_JAXPR

Zero = ad.Zero
ShapedArray = _core.ShapedArray


def _open(jaxpr: Jaxpr, consts: Sequence[Any]) -> Jaxpr:
    """A traced jaxpr as jax < 0.11 gives it: its constvars apart from its
    invars (on jax >= 0.11, by attaching `consts`)."""
    if MERGED_JAXPR and consts and not jaxpr.consts:  # type: ignore[attr-defined]
        return jaxpr.with_consts(list(consts))  # type: ignore[attr-defined]
    return jaxpr


UNSPECIFIED = _sharding_impls.UNSPECIFIED



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


def internals() -> dict[str, Any]:
    """The JAX modules this module imports inside functions, by dotted name
    (for the contract tests, tests/jax_contracts/)."""
    from jax._src import ad_util as _ad_util
    from jax._src import custom_batching as _custom_batching
    from jax._src import custom_derivatives as _custom_derivatives
    from jax._src import shard_map as _shard_map
    from jax.extend.core import primitives as _prims

    out = {"jax._src.ad_util": _ad_util, "jax._src.custom_batching": _custom_batching,
           "jax._src.custom_derivatives": _custom_derivatives,
           "jax._src.shard_map": _shard_map, "jax.extend.core.primitives": _prims}
    try:
        from jax._src import hijax as _hijax
    except ImportError:  # (older JAX)
        return out
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src.lax.control_flow import loops as _loops

    out.update({"jax._src.hijax": _hijax, "jax._src.ad_checkpoint": _ad_checkpoint,
                "jax._src.lax.control_flow.loops": _loops})
    return out


# --- high-level primitives (jax >= 0.10; the jax_*3 flags) -----------------------
# With `jax_scan3`, `jax_remat3`, `jax_custom_vjp3` or `jax_custom_jvp3` on,
# `lax.scan`, `jax.checkpoint`, `jax.custom_vjp` and `jax.custom_jvp` stage a
# `call_hi_primitive` eqn whose `_prim` param is a `HiPrim` object holding the
# body's jaxprs. Older JAX has neither.

def _high_level() -> tuple[Primitive | None, type | None, dict[type, str]]:
    try:
        from jax._src import hijax as _hijax
    except ImportError:  # (older JAX)
        return None, None, {}
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src.lax.control_flow import loops as _loops

    flags = {}
    for module, cls, flag in ((_loops, "Scan3", "jax_scan3"),
                              (_ad_checkpoint, "RematTraced", "jax_remat3"),
                              (_hijax, "CustomVJPTraced", "jax_custom_vjp3"),
                              (_hijax, "CustomJVPTraced", "jax_custom_jvp3")):
        if hasattr(module, cls) and flag in jax.config.values:
            flags[getattr(module, cls)] = flag
    # (the base class is `HiPrim` from jax 0.11, `VJPHiPrimitive` before)
    base = getattr(_hijax, "HiPrim", None) or getattr(_hijax, "VJPHiPrimitive", None)
    return getattr(_hijax, "call_hi_primitive_p", None), base, flags


# `call_hi_primitive_p` (None where JAX lacks it), the class of the `_prim`
# objects it carries, and the flag that makes JAX stage each kind of them.
call_hi_primitive_p, _HI_PRIM, HI_PRIM_FLAGS = _high_level()
# the linear part JAX's differentiation makes of one (`HiPrim.linearized`,
# transposed by its `vjp_bwd`): its `_prim` param holds the object
call_hi_primitive_linearized_p: Primitive | None = None
if call_hi_primitive_p is not None:
    from jax._src import hijax as _hijax_module

    call_hi_primitive_linearized_p = getattr(
        _hijax_module, "call_hi_primitive_linearized_p", None)


def hi_prim_jaxprs(x: Any) -> list:
    """The jaxprs a high-level primitive object (the `_prim` param of a
    `call_hi_primitive` eqn) holds, at any depth; [] for anything else."""
    if _HI_PRIM is None or not isinstance(x, _HI_PRIM):
        return []
    from jax._src import hijax as _hijax

    nested = getattr(_hijax, "_pp_hi_subjaxprs", None)  # (jax >= 0.12)
    if nested is not None:
        return [j for _name, j in nested(x)]
    # (jax < 0.12: among its attributes: a jaxpr, a params dict, a `Traced`)
    return [j for v in getattr(x, "__dict__", {}).values() for j in _jaxprs_in(v)]


def rebuilt_hi_prim(x: Any, fn: Callable[[Any], Any]) -> Any:
    """A high-level primitive object built again from its params, each as
    `fn` maps it (`x` itself where none changed); None where its class is
    not built from its params (the custom functions' objects hold traced
    functions): `Scan3`, `RematTraced`. JAX rebuilds them the same way in
    their `jvp`/`batch` methods."""
    params = getattr(x, "params", None)
    if not hi_prim_jaxprs(x) or not isinstance(params, dict):
        return None
    if is_custom_hi_prim(x):
        traced = params["traced"]
        jaxpr = fn(traced.jaxpr)
        return x if jaxpr is traced.jaxpr else with_custom_rules(
            x, traced=_traced_with_jaxpr(traced, jaxpr))
    accepted = inspect.signature(type(x).__init__).parameters
    if not set(params) <= set(accepted) or any(
            p.default is p.empty and n not in params
            for n, p in list(accepted.items())[1:]):
        return None
    new = {k: fn(v) for k, v in params.items()}
    if all(new[k] is v for k, v in params.items()):
        return x
    return type(x)(**new)


def _traced_with_jaxpr(traced: Any, jaxpr: Any) -> Any:
    """A copy of a `stages.Traced` (a custom function's object holds one)
    whose jaxpr is `jaxpr` (JAX's `Traced.with_consts_as_arg` swaps it in the
    same way); what it derives from its jaxpr, lowered, is made again."""
    new = copy.copy(traced)
    new._params = dict(traced._params, jaxpr=jaxpr)
    new._lojax = new._closure_converted = None
    return new


def _jaxprs_in(v: Any) -> list:
    if isinstance(v, (Jaxpr, ClosedJaxpr)):
        return [v]
    if isinstance(v, dict):
        return list(_core.jaxprs_in_params(v))
    inner = getattr(v, "jaxpr", None)  # a `stages.Traced`
    return [inner] if isinstance(inner, (Jaxpr, ClosedJaxpr)) else []


def sub_jaxprs(params: dict) -> Iterator[Jaxpr]:
    """Every jaxpr an eqn's params carry, at any depth of tuples, lists and
    dicts (a library's primitive may carry them among its static params, a
    batched one in the params of the primitive that wraps it), and inside
    JAX's high-level primitive objects."""
    for v in params.values():
        yield from _jaxprs_at(v)


def _jaxprs_at(v: Any) -> Iterator[Jaxpr]:
    if isinstance(v, ClosedJaxpr):
        yield v.jaxpr
    elif isinstance(v, Jaxpr):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _jaxprs_at(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _jaxprs_at(x)
    else:
        yield from (getattr(j, "jaxpr", j) for j in hi_prim_jaxprs(v))


def replace_jaxprs(params: dict, fn: Callable[[ClosedJaxpr], ClosedJaxpr],
                   which: Callable[[Jaxpr], bool]) -> dict | None:
    """`params` with each jaxpr among them (in tuples, lists and dicts) that
    `which` selects as `fn` rewrites it, the same signature; None where one
    cannot be put back (an open jaxpr whose rewrite has consts, a high-level
    primitive object)."""
    def put(v: Any) -> Any:
        if isinstance(v, (Jaxpr, ClosedJaxpr)) and not which(
                v.jaxpr if isinstance(v, ClosedJaxpr) else v):
            return v
        if isinstance(v, ClosedJaxpr):
            return fn(v)
        if isinstance(v, Jaxpr):  # (its constvars: operands given where it is run)
            n = len(v.constvars)
            new = fn(ClosedJaxpr(consts_as_invars(v), ()))
            if new.consts:
                raise _CannotReplace
            return new.jaxpr.replace(constvars=new.jaxpr.invars[:n],
                                     invars=new.jaxpr.invars[n:])
        if isinstance(v, (tuple, list)):
            return type(v)(put(x) for x in v)
        if isinstance(v, dict):
            return {k: put(x) for k, x in v.items()}
        if hi_prim_jaxprs(v):
            raise _CannotReplace
        return v
    try:
        return {k: put(v) for k, v in params.items()}
    except _CannotReplace:
        return None


class _CannotReplace(Exception):
    pass


_IMPLEMENTATIONS = IdentityCache()  # (eqn,) -> ClosedJaxpr | None


def implementation(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The jaxpr of `eqn`'s primitive's implementation (`impl`, traced at its
    input avals) where that is a Python function that does not bind the
    primitive again: a library's primitive (lineax's `linear_solve`, any
    Equinox `filter_primitive`) runs and lowers through it. None where it
    has none (JAX's own primitives dispatch themselves)."""
    hit = _IMPLEMENTATIONS.get((eqn,))
    if hit is not MISSING:
        return hit
    prim, found = eqn.primitive, None
    try:
        def impl(*args: Any) -> list:
            if prim is call_hi_primitive_p:  # (its object's own lowering)
                hi = eqn.params["_prim"]
                return jax.tree_util.tree_leaves(hi.expand(*hi.in_tree.unflatten(args)))
            out = prim.impl(*args, **eqn.params)
            return list(out) if prim.multiple_results else [out]
        jaxpr, consts = trace_flat(impl, [v.aval for v in eqn.invars])
        # (an object's expansion may hold other high-level primitives: a
        # custom function calling another)
        if prim is call_hi_primitive_p or not binds(jaxpr, prim):
            found = ClosedJaxpr(jaxpr, consts)
    except Exception:  # (no impl, or one that cannot be traced: no implementation)
        pass
    _IMPLEMENTATIONS.put((eqn,), None, found)
    return found


def binds(jaxpr: Jaxpr, prim: Primitive) -> bool:
    return any(e.primitive is prim or any(binds(j, prim) for j in sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def custom_hi_prim_leading(prim: Any) -> int:
    """How many leading flat operands of a `CustomJVPTraced` /
    `CustomVJPTraced` application (jax >= 0.12: `(consts, fwd_consts, *args)`
    / `(consts, *args)`) are not the user's arguments: the function's
    closure, and a custom_vjp's `fwd_consts`."""
    n = 2 if hi_prim_flag(prim) == "jax_custom_vjp3" else 1
    return sum(c.num_leaves for c in prim.in_tree.children()[:n])


# The rules of a `CustomJVPTraced` (`jvp_rule`) and of a `CustomVJPTraced`
# (`fwd`, `bwd`) are params of the object, called with arguments structured
# like the application's (jax >= 0.12): a harvest rebuilds the object with
# its rules wrapped, as JAX's own `batch` methods rebuild it.
_CUSTOM_RULES = {"jax_custom_jvp3": ("jvp_rule",), "jax_custom_vjp3": ("fwd", "bwd")}


def custom_hi_rules(prim: Any) -> dict[str, Callable]:
    """The user's rules a custom function's object holds, by param name."""
    return {k: prim.params[k] for k in _CUSTOM_RULES[hi_prim_flag(prim) or ""]}


def custom_hi_remat_rules(prim: Any) -> tuple | None:
    """A `CustomVJPTraced`'s rules from `custom_vjp.defremat`, as the object
    calls them: `(fwd(*args) -> (out, res), rem(res, *args) -> (out, res),
    bwd(res, ct))`; None without them. (Its `fwd` rule runs the first two.)"""
    rules = prim.params.get("remat_rules")
    return None if rules is None else tuple(rules[:3])


def with_custom_rules(prim: Any, **rules: Any) -> Any:
    """A copy of a `CustomJVPTraced` / `CustomVJPTraced` with some of its
    rules (`custom_hi_rules`' names) replaced."""
    p = dict(prim.params, **rules)
    if hi_prim_flag(prim) == "jax_custom_jvp3":
        return type(prim)(p["traced"], p["jvp_rule"], prim.in_avals, p["symbolic_zeros"])
    traced, fwd, bwd = p.pop("traced"), p.pop("fwd"), p.pop("bwd")
    return type(prim)(traced, fwd, bwd, prim.in_avals, p.pop("symbolic_zeros"),
                      p.pop("opt_remat"), **p)


def custom_hi_function(prim: Any) -> Jaxpr:
    """The function of a custom function's object: a jaxpr over its flat
    operands, the closure's first (a custom_vjp's `fwd_consts` dropped)."""
    return prim.traced.jaxpr


def custom_hi_primal(prim: Any, args: Sequence[Any]) -> tuple[Jaxpr, list]:
    """The function of a custom function's object (a jaxpr over its flat
    operands, closure first) and its operands, from arguments structured as
    its rules take them (a custom_vjp's `fwd_consts` dropped)."""
    flat = prim.in_tree.flatten_up_to(tuple(args))  # (zeros are leaves here)
    if hi_prim_flag(prim) == "jax_custom_vjp3":
        closure, fwd_consts = (c.num_leaves for c in prim.in_tree.children()[:2])
        flat = flat[:closure] + flat[closure + fwd_consts:]
    return custom_hi_function(prim), list(flat)


def custom_hi_tree(prim: Any) -> Any:
    """The tree of a custom function's object's operands (`unflatten` builds
    its rules' arguments from flat ones)."""
    return prim.in_tree


def is_zero(t: Any) -> bool:
    """`t` is one of JAX's symbolic zeros (a rule's output cotangent)."""
    from jax._src import ad_util as _ad_util

    return isinstance(t, (_ad_util.Zero, _ad_util.SymbolicZero))


def dense_tangent(t: Any) -> Any:
    """A tangent as an array: JAX's symbolic zeros (internal `Zero` or the
    rules' `SymbolicZero`) instantiated, float0 ones as numpy arrays."""
    if not is_zero(t):
        return t
    aval = t.aval
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, aval.dtype)
    return jax.numpy.zeros(aval.shape, aval.dtype)


def hi_prim_flag(x: Any) -> str | None:
    """The `jax_*3` flag under which JAX stages this `HiPrim`, if one does."""
    for cls, flag in HI_PRIM_FLAGS.items():
        if isinstance(x, cls):
            return flag
    return None


# --- where a primitive comes from (for error messages) ---------------------------

_NOT_A_LIBRARY = ("jax", "jaxlib", "functools", "builtins")


def _outside_jax(module: Any) -> bool:
    return isinstance(module, str) and module.split(".")[0] not in _NOT_A_LIBRARY


def primitive_origin(prim: Primitive) -> str | None:
    """The module that defines `prim`: its class's, for a class of its own
    outside JAX; else that of the innermost function outside JAX its
    implementation (`prim.impl`, set by `def_impl`) calls through wrappers
    (`functools.partial`, `__wrapped__`, closures: Equinox's
    `filter_primitive_def` wraps the library's function in its own), or
    its abstract evaluation calls (a primitive that only lowers). None where
    none is found (a primitive defined by JAX)."""
    if _outside_jax(type(prim).__module__):
        return type(prim).__module__
    found, seen = None, set()
    layer = [getattr(prim, "impl", None), getattr(prim, "abstract_eval", None)]
    for _ in range(4):  # wrappers are shallow; a closure may hold anything
        deeper: list = []
        for f in layer:
            if not callable(f) or id(f) in seen:
                continue
            seen.add(id(f))
            if isinstance(f, functools.partial):
                deeper.append(f.func)
                continue
            if _outside_jax(getattr(f, "__module__", None)):
                found = f.__module__
            deeper.append(getattr(f, "__wrapped__", None))
            for cell in getattr(f, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    deeper.append(cell.cell_contents)
        layer = deeper
    return found



def hide_frames_below(path: str) -> None:
    """Frames from files under `path` are dropped from users' tracebacks."""
    _traceback_util.register_exclusion(path)


api_boundary = _traceback_util.api_boundary


def closed_call(fn: Callable, *args: Any) -> list:
    """Calls `fn` through JAX's `closed_call` primitive (tests use it)."""
    from jax.extend.core import primitives as _prims

    flat = list(args)
    jaxpr, consts = trace_flat(lambda *a: list(fn(*a)), [jax.typeof(x) for x in flat])
    params = get_bind_params(_prims.closed_call_p,
                              {"call_jaxpr": ClosedJaxpr(jaxpr, consts)})
    return bind_with_params(_prims.closed_call_p, flat, params)


def register_effect(effect_type: type) -> None:
    """Allow an unordered effect everywhere a site may appear."""
    mlir.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)
    _effects.partial_eval_kept_effects.add_type(effect_type)


def register_batcher(prim: Primitive, rule: Callable) -> None:
    batching.primitive_batchers[prim] = rule


def replace_eqn_params(eqn: JaxprEqn, **params: Any) -> JaxprEqn:
    return new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive,
                         dict(eqn.params, **params), eqn.effects,
                         eqn.source_info, eqn.ctx)


def map_params(jaxpr: Jaxpr, prim: Primitive, fn: Callable[[dict], dict],
               effect: Effect | None = None) -> Jaxpr:
    """`jaxpr` with the params of every eqn of `prim`, in it and in the
    bodies among its eqns' params (loops, calls, branches), replaced by
    `fn(params)`. Unchanged parts are shared. With `effect`, each changed
    jaxpr also lists `effect` among its effects (the primitives that hold a
    body read its effects from there when they are bound again)."""
    eqns, changed = [], False
    for e in jaxpr.eqns:
        params = {k: _map_param(v, prim, fn, effect) for k, v in e.params.items()}
        if e.primitive is prim:
            params = fn(params)
        if any(params[k] is not e.params.get(k) for k in params):
            e, changed = e.replace(params=params), True
        eqns.append(e)
    if not changed:
        return jaxpr
    if effect is None:
        return jaxpr.replace(eqns=eqns)
    return jaxpr.replace(eqns=eqns, effects=jaxpr.effects | {effect})


def _map_param(v: Any, prim: Primitive, fn: Callable[[dict], dict],
               effect: Effect | None) -> Any:
    if isinstance(v, Jaxpr):
        return map_params(v, prim, fn, effect)
    if isinstance(v, ClosedJaxpr):
        j = map_params(v.jaxpr, prim, fn, effect)
        return v if j is v.jaxpr else ClosedJaxpr(j, v.consts)
    if isinstance(v, (tuple, list)) and any(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in v):
        new = [_map_param(x, prim, fn, effect) for x in v]
        return v if all(a is b for a, b in zip(new, v)) else type(v)(new)
    rebuilt = rebuilt_hi_prim(v, lambda x: _map_param(x, prim, fn, effect))
    return v if rebuilt is None else rebuilt


def map_eqn_params(eqn: JaxprEqn, prim: Primitive, fn: Callable[[dict], dict]) -> JaxprEqn:
    """`eqn` with the params of every eqn of `prim` in its bodies (a
    high-level primitive object's included) replaced by `fn(params)`."""
    params = {k: _map_param(v, prim, fn, None) for k, v in eqn.params.items()}
    return eqn if all(params[k] is v for k, v in eqn.params.items()) else eqn.replace(
        params=params)


def is_custom_hi_prim(x: Any) -> bool:
    """`x` is a custom function's object (`CustomJVPTraced`, `CustomVJPTraced`)
    whose sites lazyharvest harvests (jax >= 0.12)."""
    return CUSTOM_HI_PRIMS and hi_prim_flag(x) in _CUSTOM_RULES


def identity_eqn(eqn: JaxprEqn) -> JaxprEqn:
    """An eqn with `eqn`'s inputs and outputs that passes its inputs on: a
    `closed_call` of a jaxpr with no eqns."""
    body = _identity_jaxpr(tuple(v.aval for v in eqn.invars))
    return new_jaxpr_eqn(eqn.invars, eqn.outvars, closed_call_p, {"call_jaxpr": body},
                         set(), eqn.source_info, eqn.ctx)


@functools.lru_cache(maxsize=256)
def _identity_jaxpr(avals: tuple) -> ClosedJaxpr:
    jaxpr, consts = trace_flat(lambda *a: list(a), list(avals))
    return ClosedJaxpr(jaxpr, consts)


def traced_for() -> str | None:
    """What the jaxpr being traced now is for (its debug info's `traced_for`:
    "jit", "scan"..., or a library's own label); None when none is traced."""
    frame = getattr(_core.trace_ctx.trace, "frame", None)
    return getattr(getattr(frame, "debug_info", None), "traced_for", None)


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


# The part of JAX's configuration that jit keys its trace cache on (user
# contexts, lazyharvest's harvest state among them). Bound directly: it runs
# on every call of a reaped function.
trace_context: Callable[[], Any] = _config.trace_context

# The type of concrete jax.Arrays: pytree leaves.
ArrayImpl: type = _array.ArrayImpl

# `jax.tree_util.tree_flatten(tree)` without its Python frame (hot path).
tree_flatten: Callable[[Any], tuple[list, Any]] = _tree_util.default_registry.flatten


def trace_flat(fn: Callable, in_avals: Sequence[Any], name: str = "lazyharvest"
               ) -> tuple[Jaxpr, list[Any]]:
    """Traces `fn(*flat) -> list` to an open jaxpr and the consts it closed over.

    Closed-over values (outer tracers included) come back as consts so callers
    can pass them explicitly; nothing is evaluated.
    """
    dbg = _debug_info(name, fn, tuple(in_avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=dbg),
                                                 list(in_avals))
    return _open(jaxpr, consts), list(consts)


def trace_pytree(fn: Callable, in_tree: Any, in_avals: Sequence[Any],
                 name: str = "lazyharvest") -> tuple[ClosedJaxpr, Any]:
    """Traces a pytree function on flat avals; returns (closed jaxpr, out tree)."""
    dbg = _debug_info(name, fn, tuple(in_avals), {})
    flat_fn, out_tree = _flatten_fun_nokwargs(lu.wrap_init(fn, debug_info=dbg), in_tree)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(flat_fn, list(in_avals))
    return ClosedJaxpr(jaxpr, consts), out_tree()


def without_internal_refs(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with the Refs it makes and uses inside itself turned into
    values (its Ref operands, if any, left as they are). JAX lowers a custom
    function whose jaxpr makes Refs only while that jaxpr also holds a
    high-level primitive (it then inlines the call: a `Scan3`'s carry Refs);
    once that primitive is harvested as an ordinary one the Refs stay, and
    JAX has no state-discharge rule for `custom_jvp_call` / `custom_vjp_call`."""
    effect = getattr(_core, "InternalMutableArrayEffect", None)
    if effect is None or not any(isinstance(e, effect) for e in closed.jaxpr.effects):
        return closed
    keep = [False] * len(closed.jaxpr.invars)
    discharge: Any = _discharge.discharge_state
    if "closed_jaxpr" in inspect.signature(discharge).parameters:  # (jax >= 0.10)
        return discharge(closed, should_discharge=keep)
    jaxpr, consts = discharge(closed.jaxpr, closed.consts, should_discharge=keep)
    return ClosedJaxpr(jaxpr, consts)


def without_internal_refs_fn(fn: Callable[..., list]) -> Callable[..., list]:
    """`fn(*flat) -> list`, traced at its operands' types and run as
    `without_internal_refs` of that trace."""
    def call(*args: Any) -> list:
        jaxpr, consts = trace_flat(fn, [jax.typeof(a) for a in args])
        pure = without_internal_refs(ClosedJaxpr(jaxpr, consts))
        return eval_jaxpr(pure.jaxpr, pure.consts, *args)
    return call


def consts_as_invars(jaxpr: Jaxpr) -> Jaxpr:
    """Moves constvars to the front of invars."""
    return _pe.convert_constvars_jaxpr(jaxpr)


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def bind_params(eqn: JaxprEqn, params: dict | None = None) -> dict:
    """The parameters to re-bind `eqn`'s primitive with (subfuns for custom calls).

    Always in jax >= 0.9's form: a dict, with a call's functions under
    `"subfuns"`; `bind_eqn` binds it on every version.
    """
    return get_bind_params(eqn.primitive, eqn.params if params is None else params)


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> Any:
    """`eqn`'s primitive bound on `invals` (with `params` instead of its own)."""
    return bind_with_params(eqn.primitive, invals, bind_params(eqn, params))


def get_bind_params(prim: Primitive, params: dict) -> dict:
    out = prim.get_bind_params(params)
    if BIND_PARAMS_SPLIT:
        subfuns, out = out
        if subfuns:
            out = dict(out, subfuns=tuple(subfuns))
    return out


def unshared_thunks(params: dict) -> dict:
    """A custom call's `params` whose memoized rule-jaxpr thunks (a
    custom_vjp's forward, a custom_jvp's jvp) keep a cache of their own.
    JAX's thunk caches the rule's jaxpr on the call's eqn: traced where the
    function's sites take planted values, it would close over them, and a
    later program made from the same eqn would read those values (tracers
    of a trace that has ended)."""
    return {k: _unshared(v) for k, v in params.items()}


def _unshared(v: Any) -> Any:
    f: Any = getattr(v, "f", None)
    code = getattr(f, "__code__", None)
    if (not isinstance(v, lu.WrappedFun) or code is None or v.transforms
            or set(code.co_freevars) != {"cells", "fn", "sentinel"}):
        return v  # (not JAX's `_memoize`: as it is)
    fn = f.__closure__[code.co_freevars.index("fn")].cell_contents
    return lu.wrap_init(_pe._memoize(fn), debug_info=v.debug_info)


def bind_with_params(prim: Primitive, invals: Sequence[Any], bind_params: dict) -> Any:
    if BIND_PARAMS_SPLIT and "subfuns" in bind_params:
        bind_params = dict(bind_params)
        subfuns = bind_params.pop("subfuns")
        return prim.bind(*subfuns, *invals, **bind_params)
    return prim.bind(*invals, **bind_params)


def eval_eqns(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
              eval_eqn: Callable[[JaxprEqn, list], list], in_context: bool = False) -> list:
    """Evaluates `jaxpr`, each eqn by `eval_eqn(eqn, invals) -> outvals`; with
    `in_context`, under the eqn's source info and JAX context (as re-binding)."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    # (jax >= 0.11: constvars without attached values are leading invars)
    env.update(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))
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


def axis_env(name_sizes: Sequence[tuple[Any, int]]):
    """Binds vmap axis names (for collectives) while tracing a per-example body."""

    if not name_sizes:
        return contextlib.nullcontext()
    return _core.extend_axis_env_nd(list(name_sizes))


def parent_trace(trace: Any) -> Any:
    return trace.parent_trace


def traces_below(trace: Any) -> list:
    """`trace`, its parent trace, that one's parent, and so on."""
    out = []
    while trace is not None:
        out.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return out


def current_trace(trace: Any):
    return _core.set_current_trace(trace)


def transforms(trace: Any) -> bool:
    """Whether `trace` transforms what is bound on it (differentiation,
    vmap...), rather than evaluating or staging it."""
    return not isinstance(trace, (_core.EvalTrace, _pe.DynamicJaxprTrace))


def zeros_like_aval(aval: Any) -> Any:
    """Zeros of `aval` exactly (weak type, float0, key dtypes), on the
    current trace: a stand-in for a value only its aval matters of."""
    from jax._src import ad_util as _ad_util

    return _ad_util.zeros_like_aval(aval)


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
