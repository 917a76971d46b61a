"""Every use of JAX internals lives here, so a JAX upgrade touches one file.

Supports jax 0.8.3 to 0.10.x (tested: 0.8.3, 0.9.2, 0.10.2; docs/compat.md).
`jax.extend` and `jax.interpreters` carry no compatibility guarantee;
`jax._src` even less. Nothing else in the package may import from them
(tests/test_compat.py checks), and every line that depends on JAX's version
is here: it branches on the presence of the feature where it can (so the
releases between the tested ones take the right branch), on `JAX_VERSION`
otherwise, and raises `require`'s error where an older JAX lacks a feature.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from lazyharvest.errors import HarvestError

# --- versions -------------------------------------------------------------------


def parse_version(version: str) -> tuple[int, ...]:
    """(major, minor, micro) of a version string: "0.9.0.1" and "0.10.3.dev20260101"
    give (0, 9, 0) and (0, 10, 3)."""
    out = []
    for part in version.split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    return tuple(out)


JAX_VERSION = parse_version(jax.__version__)
MIN_JAX_VERSION = (0, 8, 3)  # pyproject.toml: jax>=0.8.3,<0.13
TESTED_JAX_VERSIONS = ((0, 8, 3), (0, 9, 2), (0, 10, 2), (0, 11, 2), (0, 12, 0))  # scripts/compat.py


def _spell(version: Sequence[int]) -> str:
    return ".".join(map(str, version))


def require(version: Sequence[int], feature: str) -> None:
    """Raises a `HarvestError` naming `version` if this JAX is older."""
    if JAX_VERSION < tuple(version):
        raise HarvestError(
            f"{feature} needs jax >= {_spell(version)}; this is jax "
            f"{jax.__version__}. Upgrade JAX (pip install -U 'jax>={_spell(version)}').")


require(MIN_JAX_VERSION, "lazyharvest")

# Dead and constant sites keep their tangent/cotangent sites through rules that
# use differentiation internals jax 0.8 lacks (LinearizeTrace.is_vjp, bind
# hooks with avals); on it those sites behave as before (docs/compat.md).
DERIVATIVE_SITES = JAX_VERSION >= (0, 9)

# --- imports (from here on, names present in every supported version) ------------

from jax._src import array as _array  # noqa: E402
from jax._src import config as _config  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src import effects as _effects  # noqa: E402
from jax._src import sharding_impls as _sharding_impls  # noqa: E402
from jax._src import source_info_util as _source_info_util  # noqa: E402
from jax._src import traceback_util as _traceback_util  # noqa: E402
from jax._src import tree_util as _tree_util  # noqa: E402
from jax._src import util as _util  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax.api_util import debug_info as _debug_info  # noqa: E402
from jax.api_util import flatten_fun_nokwargs as _flatten_fun_nokwargs  # noqa: E402
from jax.extend import linear_util as lu  # noqa: E402
from jax.extend.core import (  # noqa: E402, F401  (re-exported to the package)
    ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var)
from jax.interpreters import ad, batching, mlir  # noqa: E402, F401  (re-exported)
from jax.interpreters import partial_eval as pe  # noqa: E402

# jax 0.10 exports these from jax.extend.core; 0.8 and 0.9 keep them in _src.
try:
    from jax.extend.core import Effect, new_jaxpr_eqn  # noqa: F401
except ImportError:  # jax < 0.10
    from jax._src.core import new_jaxpr_eqn
    from jax._src.effects import Effect  # noqa: F401

Zero = ad.Zero

# jax >= 0.12 merged `ClosedJaxpr` into `Jaxpr`: a jaxpr's constvars are its
# leading inputs that have values attached (`jaxpr.consts`); without them
# attached, they are plain leading invars.
MERGED_JAXPR = ClosedJaxpr is Jaxpr


def _open(jaxpr: Jaxpr, consts: Sequence[Any]) -> Jaxpr:
    """A traced jaxpr as jax < 0.12 gives it: its constvars apart from its
    invars (on jax >= 0.12, by attaching `consts`)."""
    if MERGED_JAXPR and consts and not jaxpr.consts:
        return jaxpr.with_consts(list(consts))
    return jaxpr
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
    params = _get_bind_params(_prims.closed_call_p,
                              {"call_jaxpr": ClosedJaxpr(jaxpr, consts)})
    return _bind(_prims.closed_call_p, flat, params)


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
        table.update({p: _to_jax_dce(r) for p, r in rules.items()})
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
    """The parameters to re-bind `eqn`'s primitive with (subfuns for custom calls).

    Always in jax >= 0.9's form: a dict, with a call's functions under
    `"subfuns"`; `bind_eqn` binds it on every version.
    """
    return _get_bind_params(eqn.primitive, eqn.params if params is None else params)


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> Any:
    """`eqn`'s primitive bound on `invals` (with `params` instead of its own)."""
    return _bind(eqn.primitive, invals, bind_params(eqn, params))


# jax 0.8: `get_bind_params` returns `(subfuns, params)` and `bind` takes the
# subfuns as leading positional arguments. jax >= 0.9: it returns params with
# the subfuns under "subfuns", and `bind` takes them there.
_BIND_PARAMS_SPLIT = isinstance(Primitive("lazyharvest_probe").get_bind_params({}),
                                tuple)


def _get_bind_params(prim: Primitive, params: dict) -> dict:
    out = prim.get_bind_params(params)
    if _BIND_PARAMS_SPLIT:
        subfuns, out = out
        if subfuns:
            out = dict(out, subfuns=tuple(subfuns))
    return out


def _bind(prim: Primitive, invals: Sequence[Any], bind_params: dict) -> Any:
    if _BIND_PARAMS_SPLIT and "subfuns" in bind_params:
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

    # (jax >= 0.12: constvars without attached values are leading invars)
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


def shard_map_params(eqn: JaxprEqn) -> tuple[Jaxpr, Any, frozenset, bool]:
    """A shard_map eqn's (body jaxpr, mesh, manual axes, check_vma).

    jax 0.10 calls the manual axes `newly_manual_axes`; 0.8 and 0.9 call them
    `manual_axes`.
    """
    p = eqn.params
    manual = p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
    return p["jaxpr"], p["mesh"], manual, p["check_vma"]


def scan_counts(params: dict) -> tuple[int, int]:
    """A scan eqn's (number of consts, number of carries).

    jax < 0.11 has them as params `num_consts`, `num_carry`; jax >= 0.11
    describes the operands by a flat tree `ft_in` of (consts, carry, xs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _xs = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params: dict, jaxpr: Any, num_consts: int, num_carry: int,
                linear: Callable[[tuple], tuple] | None = None) -> dict:
    """`params` of a scan with the body `jaxpr` (closed), `num_consts` consts
    and `num_carry` carries (the rest of its inputs are xs, of its outputs
    ys). `linear(old)` gives the new per-input `linear` flags where JAX has
    them (jax < 0.11; all False if not given)."""
    if "num_consts" in params:
        out = dict(params, jaxpr=jaxpr, num_consts=num_consts, num_carry=num_carry)
        if "linear" in params:
            n = len(jaxpr.in_avals)
            out["linear"] = (tuple(linear(tuple(params["linear"]))) if linear
                             else (False,) * n)
        return out
    from jax._src import flattree as _ft

    n_xs = len(jaxpr.in_avals) - num_consts - num_carry
    n_ys = len(jaxpr.out_avals) - num_carry
    return dict(params, jaxpr=jaxpr,
                ft_in=_ft.pack((_ft.nones(num_consts), _ft.nones(num_carry),
                                _ft.nones(n_xs))),
                ft_out=_ft.pack((_ft.nones(num_carry), _ft.nones(n_ys))))


def varying_axes(aval: Any) -> frozenset:
    """Mesh axes over which a value (given by its aval) varies inside shard_map.

    jax 0.10 keeps them in `aval.manual_axis_type.varying`; 0.8 and 0.9 in
    `aval.vma`.
    """
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


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

_BIND_TAKES_AVALS = "avals" in inspect.signature(
    _core.Primitive.bind_with_trace).parameters


def register_bind_hook(prim: Primitive, make_rule: Callable[[Callable], Callable]) -> None:
    """Every bind of `prim` goes through `make_rule(default)(trace, args, avals,
    params)`; `default` is JAX's own `bind_with_trace`."""
    default = type(prim).bind_with_trace  # a custom call's class has its own
    if _BIND_TAKES_AVALS:
        def base(trace, args, avals, params):
            return default(prim, trace, args, avals, params)
        prim.def_bind_with_trace(make_rule(base))
    else:  # jax < 0.9: bind_with_trace(trace, args, params), no avals
        def base(trace, args, avals, params):
            return default(prim, trace, args, params)
        rule = make_rule(base)
        prim.def_bind_with_trace(lambda trace, args, params: rule(
            trace, args, tuple(jax.typeof(x) for x in args), params))
    # The hook's frames are not the user's: keep them out of eqns' source info.
    for path in (__file__, make_rule.__code__.co_filename):
        if path not in _source_info_util._exclude_paths:
            _source_info_util.register_exclusion(path)


# jax >= 0.9 passes a custom call's functions in `params["subfuns"]`, which a
# bind hook can replace (`replace_subfuns`); jax 0.8 passes them as arguments.
CUSTOM_CALL_HOOKS = _BIND_TAKES_AVALS and not _BIND_PARAMS_SPLIT


def replace_subfuns(params: dict, make: Callable[..., tuple | None]) -> dict:
    """`params` of a custom call's bind with its functions (`fun, jvp` or `fun,
    fwd, bwd`, JAX's wrapped functions) replaced by `make(*subfuns)`, unless it
    returns None. jax 0.8 passes them outside `params`: left alone there."""
    subfuns = params.get("subfuns")
    new = None if subfuns is None else make(*subfuns)
    return params if new is None else dict(params, subfuns=new)


# jax >= 0.11: a custom_vjp call's wrapped backward function returns
# `(cotangents, logs)` (`defvjp_with_logs`); jax < 0.11 the cotangents.
def _bwd_returns_logs() -> bool:
    from jax._src import custom_derivatives as _cd
    return "with_logs" in inspect.signature(_cd._flatten_bwd).parameters


_BWD_RETURNS_LOGS = _bwd_returns_logs()


def call_bwd(bwd: Any, *args: Any) -> tuple:
    """The cotangents a custom_vjp call's wrapped backward function `bwd`
    (from `params["subfuns"]`) gives for `args` (residuals, then cotangents)."""
    out = bwd.call_wrapped(*args)
    return tuple(out[0] if _BWD_RETURNS_LOGS else out)


def wrapped_like(fn: Callable, like: Any) -> Any:
    """`fn` as a JAX wrapped function, for a custom call's `subfuns`."""
    return lu.wrap_init(fn, debug_info=like.debug_info)


def trace_wrapped(fun: Any, args: Sequence[Any]) -> tuple[Jaxpr, list[Any]]:
    """Traces the wrapped function `fun` at `args`' types (`trace_flat`),
    leaving the output stores it fills empty: JAX fills and reads them when it
    calls `fun` (or its rule) itself."""
    return trace_wrapped_avals(fun, [jax.typeof(x) for x in args])


def trace_wrapped_avals(fun: Any, avals: Sequence[Any], call: Callable | None = None
                        ) -> tuple[Jaxpr, list[Any]]:
    """`trace_wrapped` at these avals; `call(*args)` calls `fun` (default:
    `fun.call_wrapped`)."""
    empty = [s for s in fun.stores if s is not None and not _store_full(s)]
    try:
        return trace_flat(lambda *a: list((call or fun.call_wrapped)(*a)), avals,
                          name="custom function")
    finally:
        for s in empty:
            getattr(s, "_store", s).reset()


def _store_full(store: Any) -> bool:
    return bool(getattr(store, "_store", store))


# jax >= 0.11: a linearization rule returns one more value, structured
# residuals (None for ours), and `linearized` takes their binders after the
# residuals; jax < 0.11 returns four values.
_LINEARIZE_STRUCTURED = "structured_residuals" in getattr(
    _ad.LinearizeTrace, "__annotations__", {})


def _to_jax_linearization(rule: Callable) -> Callable:
    """A rule in the four-value form as the running JAX calls rules."""
    if not _LINEARIZE_STRUCTURED:
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


# jax >= 0.12 calls a DCE rule as `rule(used_outputs, live_inputs, eqn)`
# (`live_inputs`: which Ref inputs are read after the eqn); jax < 0.12 as
# `rule(used_outputs, eqn)`. The package writes rules in the older form.
_DCE_LIVE_INPUTS = len(inspect.signature(_pe._default_dce_rule).parameters) == 3


def _to_jax_dce(rule: Callable) -> Callable:
    """A `rule(used_outputs, eqn)` as the running JAX calls DCE rules."""
    if not _DCE_LIVE_INPUTS:
        return rule
    return lambda used_outputs, live_inputs, eqn: rule(used_outputs, eqn)


def _call_jax_dce(rule: Callable, used_outputs: Sequence[bool], eqn: JaxprEqn,
                  live_inputs: Sequence[bool] | None = None) -> tuple[list, Any]:
    """JAX's DCE `rule` on `eqn` (every Ref input live unless told)."""
    if not _DCE_LIVE_INPUTS:
        return rule(list(used_outputs), eqn)
    live = [True] * len(eqn.invars) if live_inputs is None else list(live_inputs)
    return rule(list(used_outputs), live, eqn)


def register_dce_rule(prim: Primitive, rule: Callable) -> None:
    """`rule(used_outputs, eqn) -> (used_inputs, eqn or None)`."""
    pe.dce_rules[prim] = _to_jax_dce(rule)


def default_dce_rule(used_outputs: Sequence[bool], eqn: JaxprEqn) -> tuple[list, Any]:
    return _call_jax_dce(_pe._default_dce_rule, used_outputs, eqn)


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


def traces_below(trace: Any) -> list:
    """`trace`, its parent trace, that one's parent, and so on."""
    out = []
    while trace is not None:
        out.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return out


def tangent_trace(trace: Any) -> Any:
    """The trace tangents of a differentiation trace are computed on."""
    return getattr(trace, "tangent_trace", None) or trace.parent_trace


def current_trace(trace: Any):
    return _core.set_current_trace(trace)


def zeros_tangent(aval: Any) -> Any:
    """Instantiated zeros of the tangent type of `aval`, on the current trace."""
    from jax._src import ad_util as _ad_util

    return _ad_util.zeros_like_aval(aval.to_tangent_aval())


def zeros_like_aval(aval: Any) -> Any:
    """Zeros of `aval` exactly (weak type, float0, key dtypes), on the
    current trace: a stand-in for a value only its aval matters of."""
    from jax._src import ad_util as _ad_util

    return _ad_util.zeros_like_aval(aval)


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
            held = staged[i]
            if isinstance(held, weakref.ReferenceType):
                continue
            # (jax < 0.10 holds an eqn strongly through a thunk, `lambda: eqn`)
            eqn = held() if callable(held) else held
            if not eqn.effects and not keep(eqn):
                staged[i] = weakref.ref(eqn)  # as JAX would have held it


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


def wrap_dce_rule(prim: Primitive, keep: Callable[[JaxprEqn], bool],
                  made_linear: Callable[[JaxprEqn], bool]) -> None:
    """`prim`'s DCE rule looks inside an eqn `keep` selects even when none of
    its outputs is used (JAX's rules drop such an effect-free eqn whole), and
    keeps every input of one whose body makes a value the backward pass
    treats as linear (`made_linear`)."""
    original = pe.dce_rules.get(prim, _pe._default_dce_rule)
    if getattr(original, "_lazyharvest", False):
        return

    def rule(used_outputs, *live_and_eqn):
        *live, eqn = live_and_eqn  # (live inputs on jax >= 0.12)
        live_inputs = live[0] if live else None
        if not keep(eqn):
            return _call_jax_dce(original, used_outputs, eqn, live_inputs)
        shown = eqn
        if not any(used_outputs):
            shown = new_jaxpr_eqn(eqn.invars, eqn.outvars, eqn.primitive, eqn.params,
                                  eqn.effects | {_keep_effect}, eqn.source_info, eqn.ctx)
        used_inputs, new_eqn = _call_jax_dce(original, used_outputs, shown, live_inputs)
        if new_eqn is shown:  # JAX's default rule: kept whole
            return used_inputs, eqn
        if new_eqn is None:  # a jit whose body uses no input: kept whole
            return [True] * len(eqn.invars), eqn
        if all(used_inputs) or not (prim is jit_p or made_linear(eqn)):
            return used_inputs, new_eqn
        # The backward pass transposes an eqn only if one of its inputs is
        # linear; otherwise it evaluates it forward: the sites inside get no
        # cotangent, and a custom_vjp's linear part inside cannot run. DCE
        # may drop every linear input (it cannot tell them from residuals)
        # when the body's only linear values are made inside (a constant
        # site's zero tangent; in a jit, also the zero tangent given to a
        # cond or scan holding sites): keep them all.
        return [True] * len(eqn.invars), _keeping_inputs(used_outputs, eqn, new_eqn)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    pe.dce_rules[prim] = rule


def _keeping_inputs(used_outputs: Sequence[bool], eqn: JaxprEqn,
                    dced: JaxprEqn) -> JaxprEqn:
    """`dced` (a jit, scan or cond eqn after JAX's DCE rule) reading every
    input of `eqn` again: its bodies' unused binders are kept.

    Not `eqn` whole: a scan kept whole (or a jit holding one) would keep
    unused extensive outputs, whose symbolic zero cotangents JAX's scan
    transpose cannot take.
    """
    p = eqn.params
    used = list(used_outputs)
    if eqn.primitive is cond_p:
        params = dict(dced.params, branches=tuple(_dce_keeping_binders(b, used)
                                                  for b in p["branches"]))
    elif eqn.primitive is scan_p:  # every carry stays: a carry in needs its carry out
        num_carry = scan_counts(p)[1]
        used[:num_carry] = [True] * num_carry
        params = scan_params(p, _dce_keeping_binders(p["jaxpr"], used), *scan_counts(p),
                             linear=lambda lin: lin)
    else:  # jit: the per-output parameters as DCE left them, per-input ones whole
        params = dict(dced.params, jaxpr=_dce_keeping_binders(p["jaxpr"], used),
                      **{k: p[k] for k in ("in_shardings", "in_layouts", "donated_invars")})
    outvars = [v for v, u in zip(eqn.outvars, used) if u]
    return new_jaxpr_eqn(eqn.invars, outvars, eqn.primitive, params, dced.effects,
                         eqn.source_info, eqn.ctx)


def _dce_keeping_binders(body: ClosedJaxpr, used_outputs: list[bool]) -> ClosedJaxpr:
    jaxpr, _ = pe.dce_jaxpr(body.jaxpr, used_outputs, instantiate=True)
    return ClosedJaxpr(jaxpr, body.consts)


def register_partial_eval_rule(prim: Primitive, make_rule: Callable) -> None:
    """`make_rule(previous)` gives `rule(trace, *tracers, **params)` for JAX's
    partial evaluation (`JaxprTrace`: `jax.checkpoint`'s transpose,
    `jax.linear_transpose`, scan's loop-invariant hoisting...). `previous` is
    the rule it replaces (JAX's default if none), so that rules compose."""
    previous = _pe.custom_partial_eval_rules.get(prim)
    if previous is None:
        def previous(trace, *tracers, **params):
            return trace.default_process_primitive(prim, list(tracers), params)
    _pe.custom_partial_eval_rules[prim] = make_rule(previous)


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


def partial_eval_keeping(previous: Callable, keep: Callable[[dict], bool]) -> Callable:
    """`previous` (a partial-eval rule of jit, scan or cond), except that the
    eqn it stages for the unknown part stays in the jaxpr even if no output
    is used, when `keep(params)` says its body must (the transpose of
    `jax.checkpoint` partially evaluates the body's jvp, and would drop a
    loop whose tangent sites nothing uses)."""
    def rule(trace, *tracers, **params):
        outs = previous(trace, *tracers, **params)
        if keep(params):
            seen: set = set()
            for out in outs:
                recipe = getattr(out, "recipe", None)
                if isinstance(recipe, _pe.JaxprEqnRecipe) and id(recipe) not in seen:
                    seen.add(id(recipe))
                    trace.effect_handles.append(
                        _pe.EffectHandle(list(recipe.in_tracers), recipe))
        return outs
    return rule


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
        if prim is scan_p and any(type(c) is Zero for c in cts_in):
            # A scan kept for its sites may get a symbolic-zero cotangent for
            # its stacked outputs (JAX's DCE would have dropped them), which
            # JAX's scan transpose does not slice per iteration.
            cts_in = [_ad.instantiate_zeros(c) for c in cts_in]
        return original(cts_in, *args, **params)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    _ad.fancy_transposes[prim] = rule


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
    """Eqns of `prim` with `keep(params)` are not hoisted out of scans (a
    site, or a cond whose body holds one)."""
    from jax._src.lax.control_flow import loops as _loops

    original = _loops._scan_known_hoisting
    if not getattr(original, "_lazyharvest", False):
        # (jax < 0.11: `(jaxpr_known, known_consts, num_res)`; jax >= 0.11
        # adds `num_sres`: only the first argument is read here)
        def hoisting(jaxpr_known, *args):
            if not any(isinstance(e, effect_type) for e in jaxpr_known.effects):
                return original(jaxpr_known, *args)
            with _hoisting(True):
                return original(jaxpr_known, *args)

        hoisting._lazyharvest = True  # type: ignore[attr-defined]
        _loops._scan_known_hoisting = hoisting
        # jax.checkpoint's split of a scan hoists loop invariants its own way
        # (`_scan_partial_eval_custom`): the flag is set around it too.
        custom = pe.partial_eval_jaxpr_custom_rules[scan_p]

        def custom_rule(saveable, unks_in, inst_in, eqn):
            if not any(isinstance(e, effect_type) for e in eqn.params["jaxpr"].effects):
                return custom(saveable, unks_in, inst_in, eqn)
            with _hoisting(True):
                return custom(saveable, unks_in, inst_in, eqn)
        pe.partial_eval_jaxpr_custom_rules[scan_p] = custom_rule

    def make_rule(previous: Callable) -> Callable:
        def rule(trace, *tracers, **params):
            if _hoisting.value and keep(params) and all(t.pval.is_known() for t in tracers):
                tracers = tuple(trace.instantiate_const(t) for t in tracers)
            return previous(trace, *tracers, **params)
        return rule

    register_partial_eval_rule(prim, make_rule)
