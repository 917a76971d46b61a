"""Partial evaluation and dead-code elimination: DCE rules (and JAX's own,
wrapped to look inside eqns holding sites), eqns kept staged on a tangent
trace, partial-eval rules that keep staged bodies, cond's partial eval, and
sites kept inside scan loops when JAX hoists loop invariants."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import util as _util
from jax._src.interpreters import partial_eval as _pe
from jax.interpreters import partial_eval as pe

from lazyharvest._jax.control_flow import scan_counts, scan_params
from lazyharvest._jax.core import (
    ClosedJaxpr,
    Effect,
    Jaxpr,
    JaxprEqn,
    Primitive,
    binds,
    call_hi_primitive_p,
    cond_p,
    jit_p,
    new_jaxpr_eqn,
    remat_p,
    scan_p,
    trace_flat,
)
from lazyharvest._jax.versions import DCE_LIVE_INPUTS


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


def _to_jax_dce(rule: Callable) -> Callable:
    """A `rule(used_outputs, eqn)` as the running JAX calls DCE rules."""
    if not DCE_LIVE_INPUTS:
        return rule
    return lambda used_outputs, live_inputs, eqn: rule(used_outputs, eqn)


def _call_jax_dce(rule: Callable, used_outputs: Sequence[bool], eqn: JaxprEqn,
                  live_inputs: Sequence[bool] | None = None) -> tuple[list, Any]:
    """JAX's DCE `rule` on `eqn` (every Ref input live unless told)."""
    if not DCE_LIVE_INPUTS:
        return rule(list(used_outputs), eqn)
    live = [True] * len(eqn.invars) if live_inputs is None else list(live_inputs)
    return rule(list(used_outputs), live, eqn)


def register_dce_rule(prim: Primitive, rule: Callable) -> None:
    """`rule(used_outputs, eqn) -> (used_inputs, eqn or None)`."""
    pe.dce_rules[prim] = _to_jax_dce(rule)


def default_dce_rule(used_outputs: Sequence[bool], eqn: JaxprEqn) -> tuple[list, Any]:
    return _call_jax_dce(_pe._default_dce_rule, used_outputs, eqn)


class _KeepEffect(Effect):
    """Shown transiently to JAX's DCE rules of jit/scan/cond so they look
    inside an eqn none of whose outputs is used; never stored in a jaxpr."""


keep_effect = _KeepEffect()


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
                                  eqn.effects | {keep_effect}, eqn.source_info, eqn.ctx)
        used_inputs, new_eqn = _call_jax_dce(original, used_outputs, shown, live_inputs)
        if new_eqn is shown:  # JAX's default rule: kept whole
            return used_inputs, eqn
        if new_eqn is None:  # a jit whose body uses no input: kept whole
            return [True] * len(eqn.invars), eqn
        # The backward pass transposes an eqn only if one of its inputs is
        # linear; otherwise it evaluates it forward: the sites inside get no
        # cotangent, and a custom_vjp's linear part inside cannot run. DCE
        # may drop every linear input (it cannot tell them from residuals)
        # when the body's only linear values are made inside (a constant
        # site's zero tangent; in a jit, also the zero tangent given to a
        # cond or scan holding sites): keep them all, but those that carry
        # no cotangent (`_no_cotangent`).
        kept = [u or not _no_cotangent(v) for u, v in zip(used_inputs, eqn.invars)]
        if kept == list(used_inputs) or not (prim is jit_p or made_linear(eqn)):
            return used_inputs, new_eqn
        return _keeping_inputs(used_outputs, eqn, new_eqn, kept)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    pe.dce_rules[prim] = rule


def _no_cotangent(v: Any) -> bool:
    """Whether input `v` carries no cotangent: a float0 value or a Ref of one
    (the tangent of an integer value or Ref). Such an input never makes an
    eqn transposed, and JAX's scan transpose cannot make the accumulator of
    a float0 Ref nothing wrote (`new_ref` of a NumPy zero fails on jax 0.12):
    one DCE dropped stays dropped."""
    return getattr(getattr(v, "aval", None), "dtype", None) == jax.dtypes.float0


def _keeping_inputs(used_outputs: Sequence[bool], eqn: JaxprEqn, dced: JaxprEqn,
                    keep: Sequence[bool]) -> tuple[list[bool], JaxprEqn]:
    """`dced` (a jit, scan, cond or remat eqn after JAX's DCE rule) reading
    again the inputs of `eqn` that `keep` selects (and any its bodies still
    read): its bodies' binders for them are kept, and writes into a Ref
    input not kept are dead. Returns (the inputs read, the eqn).

    Not `eqn` whole: a scan kept whole (or a jit holding one) would keep
    unused extensive outputs, whose symbolic zero cotangents JAX's scan
    transpose cannot take.
    """
    p = eqn.params
    used, keep = list(used_outputs), list(keep)
    if eqn.primitive is cond_p:  # (operand 0, the index, is read)
        ins = [True] + _union(_dce_keeping_binders(b.jaxpr, used, keep[1:])[1]
                              for b in p["branches"])
        params = dict(dced.params, branches=tuple(
            ClosedJaxpr(_dce_keeping_binders(b.jaxpr, used, ins[1:])[0], b.consts)
            for b in p["branches"]))
    elif eqn.primitive is scan_p:  # every carry stays: a carry in needs its carry out
        num_consts, num_carry = scan_counts(p)
        used[:num_carry] = [True] * num_carry
        keep[num_consts:num_consts + num_carry] = [True] * num_carry
        body, ins = _dce_keeping_binders(p["jaxpr"].jaxpr, used, keep)
        params = scan_params(p, ClosedJaxpr(body, p["jaxpr"].consts), sum(ins[:num_consts]),
                             num_carry,
                             linear=lambda lin: tuple(x for x, i in zip(lin, ins) if i))
    elif eqn.primitive is remat_p:  # (its body is a Jaxpr without consts)
        body, ins = _dce_keeping_binders(p["jaxpr"], used, keep)
        params = dict(dced.params, jaxpr=body)
    else:  # jit: the per-output parameters as DCE left them, per-input ones kept
        body, ins = _dce_keeping_binders(p["jaxpr"].jaxpr, used, keep)
        params = dict(dced.params, jaxpr=ClosedJaxpr(body, p["jaxpr"].consts), **{
            k: tuple(x for x, i in zip(p[k], ins) if i)
            for k in ("in_shardings", "in_layouts", "donated_invars")})
    invars = [v for v, i in zip(eqn.invars, ins) if i]
    outvars = [v for v, u in zip(eqn.outvars, used) if u]
    return ins, new_jaxpr_eqn(invars, outvars, eqn.primitive, params, dced.effects,
                              eqn.source_info, eqn.ctx)


def _union(masks: Any) -> list[bool]:
    return [any(bits) for bits in zip(*masks)]


def _dce_keeping_binders(jaxpr: Jaxpr, used_outputs: Sequence[bool],
                         keep: Sequence[bool]) -> tuple[Jaxpr, list[bool]]:
    """`jaxpr` computing `used_outputs` with the binders `keep` selects and
    those it reads; writes into a Ref binder not kept are dead. Returns (the
    jaxpr, which binders it has)."""
    live = {"live_inputs": list(keep)} if DCE_LIVE_INPUTS else {}
    return pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=list(keep), **live)


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


def read_from_a_fresh_ref(x: Any) -> Any:
    """`x`, written into a fresh reference and read back (on the current
    trace): JAX's backward pass treats the value as linear, as it does its
    own references, so the eqns that use it are transposed."""
    return _core.freeze(_core.new_ref(x))


def linear_unknown(trace: Any, x: Any) -> Any:
    """The known value `x` as an unknown of the partial evaluation `trace`,
    read from a fresh reference: staged, and linear for the backward pass."""
    with _core.set_current_trace(trace):
        return read_from_a_fresh_ref(trace.instantiate_const(trace.new_const(x)))


def partial_eval_kept(trace: Any, prim: Primitive, tracers: Sequence[Any],
                      params: dict, linear: bool = False, primal: int = 0) -> list:
    """Partial evaluation of `prim` as JAX does it by default, except that an
    eqn it stages stays in the jaxpr even if no output is used (as an eqn
    with an effect would). With `linear`, an eqn whose inputs are all known
    is staged too, its inputs read from fresh references: the backward pass
    that transposes the staged jaxpr then treats it as linear (a cotangent
    reaches it), as it treats JAX's own references. The last `primal`
    inputs (a mask) are staged as they are: they stay primal values."""
    tracers = list(tracers)
    if linear and all(t.is_known() for t in tracers):
        n = len(tracers) - primal
        with _core.set_current_trace(trace):
            tracers = [read_from_a_fresh_ref(trace.instantiate_const(t)) if i < n
                       else trace.instantiate_const(t) for i, t in enumerate(tracers)]
    outs = trace.default_process_primitive(prim, tracers, params)
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
        if not keep(params):
            return previous(trace, *tracers, **params)
        # (the staged eqn is found among the recipes made, not from the
        # outputs: a loop of dead sites has none)
        with _recipes_made(trace) as made:
            outs = previous(trace, *tracers, **params)
        held = {id(h.recipe) for h in trace.effect_handles}
        for recipe in made:
            if id(recipe) not in held and keep(recipe.params):
                held.add(id(recipe))
                trace.effect_handles.append(_pe.EffectHandle(list(recipe.in_tracers), recipe))
        return outs
    return rule


# The eqn recipes a rule makes on its trace while `_made` holds that trace and
# a list (`_recipes_made`): jax.checkpoint's partial-eval rule stages the
# unknown half of its body as one recipe but, unlike an ordinary primitive's,
# does not register it with the trace's effect handles, and a half with no
# outputs (a dead site's tangent copy, in a checkpoint nested in another) is
# returned by nothing. Only the rule's own trace is recorded: the traces it
# opens inside (a scan's body, a nested partial evaluation) end before it
# returns, and a list holding their recipes would keep their tracers alive
# (`jax_check_tracer_leaks` reports those traces as leaked).
_made: contextvars.ContextVar = contextvars.ContextVar("lazyharvest_recipes", default=None)
_new_eqn_recipe = _pe.new_eqn_recipe


def _recording_new_eqn_recipe(*args: Any, **kwargs: Any) -> Any:
    recipe = _new_eqn_recipe(*args, **kwargs)
    made = _made.get()
    if made is not None and made[0] is (args[0] if args else kwargs.get("trace")):
        made[1].append(recipe)
    return recipe


_pe.new_eqn_recipe = _recording_new_eqn_recipe


@contextlib.contextmanager
def _recipes_made(trace: Any):
    """Collects the eqn recipes made on `trace` inside into the list it
    yields; a rule around this one on the same trace sees them too, less
    those removed from the list."""
    made: list = []
    token = _made.set((trace, made))
    try:
        yield made
    finally:
        _made.reset(token)
        outer = _made.get()
        if outer is not None and outer[0] is trace:
            outer[1].extend(made)


def partial_eval_keeping_staged(previous: Callable, keep: Callable[[Jaxpr], bool]) -> Callable:
    """`previous` (jax.checkpoint's partial-eval rule), except that the eqn
    it stages for the unknown half stays in the jaxpr even if it has no
    output that anything uses, when `keep(body)` says its body must (it
    holds tangent sites), as an ordinary primitive with an effect stays."""
    def rule(trace, *tracers, **params):
        with _recipes_made(trace) as made:
            outs = previous(trace, *tracers, **params)
        held = {id(h.recipe) for h in trace.effect_handles}
        for recipe in made:
            body = recipe.params.get("jaxpr")
            outs_of = [r() for r in recipe.out_tracer_refs]
            if (id(recipe) not in held and isinstance(body, Jaxpr) and keep(body)
                    and all(getattr(t, "_trace", trace) is trace for t in recipe.in_tracers)
                    # (not one a rule replaced: `partial_eval_with_a_linear_input`)
                    and all(o is None or o.recipe is recipe for o in outs_of)):
                trace.effect_handles.append(_pe.EffectHandle(list(recipe.in_tracers), recipe))
        return outs
    return rule


def partial_eval_with_a_linear_input(previous: Callable,
                                     needs: Callable[[Jaxpr], bool]) -> Callable:
    """`previous` (jax.checkpoint's partial-eval rule), except that a staged
    eqn that reads no unknown input, though its body `needs` a cotangent (it
    holds the zero tangent of a constant site), reads one more: an unused
    scalar read from a fresh reference. The backward pass transposes only
    eqns with a linear input, and treats such a value as linear (as it does
    JAX's own references), so the cotangent reaches the body instead of the
    body being evaluated forward. (The split of a body that reads no input
    with a tangent leaves its staged half with none.)"""
    def rule(trace, *tracers, **params):
        with _recipes_made(trace) as made:
            outs = previous(trace, *tracers, **params)
            recipe = next((r for r in (getattr(o, "recipe", None) for o in outs)
                           if isinstance(r, _pe.JaxprEqnRecipe)), None)
            if recipe is None and made and not made[-1].out_tracer_refs:
                # a staged half with no outputs (newer JAX drops the outputs
                # it does not instantiate) is the last recipe the rule made
                recipe = made[-1]
            if (recipe is None or not isinstance(recipe.params.get("jaxpr"), Jaxpr)
                    or not needs(recipe.params["jaxpr"])):
                return outs
            unknown = {id(t) for t in tracers if not t.pval.is_known()}
            if any(id(t) in unknown for t in recipe.in_tracers):
                return outs
            # replaced below: no rule around this one is to keep it
            made[:] = [r for r in made if r is not recipe]
        aval = _core.ShapedArray((), jax.numpy.float32)
        with _core.set_current_trace(trace):
            zero = trace.instantiate_const(trace.new_const(jax.numpy.zeros((), "float32")))
            linear = read_from_a_fresh_ref(zero)
        jaxpr = recipe.params["jaxpr"]
        params = dict(recipe.params, jaxpr=jaxpr.replace(
            invars=[*jaxpr.invars, _core.Var(aval)]))
        if isinstance(params.get("prevent_cse"), tuple):
            params["prevent_cse"] = (*params["prevent_cse"], True)
        out_tracers = [o for o in outs if getattr(o, "recipe", None) is recipe]
        staged = _pe.new_eqn_recipe(trace, [*recipe.in_tracers, linear], out_tracers,
                                    recipe.primitive, params, recipe.effects,
                                    recipe.source_info, recipe.ctx)
        for o in out_tracers:
            o.recipe = staged
        return outs
    return rule


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
            # (a call with some unknown input would split its body, and
            # hoist the known half, sites included)
            if _hoisting.value and keep(params) and any(t.pval.is_known() for t in tracers):
                tracers = tuple(trace.instantiate_const(t) for t in tracers)
            return previous(trace, *tracers, **params)
        return rule

    register_partial_eval_rule(prim, make_rule)


def keep_effects_in_call_partial_eval(effect_type: type) -> None:
    """A call (`closed_call`) whose body holds an eqn with `effect_type`
    stays in the unknown half of a partial evaluation even when none of its
    outputs is used, as a primitive with that effect does. jax < 0.11 stages
    such a call (`JaxprTrace.process_call`) without registering it with the
    trace's effect handles, so scan's loop-invariant hoisting lost the site
    of a scan nested in a checkpointed scan (jax 0.11 has no `process_call`:
    calls are ordinary primitives there)."""
    original = getattr(_pe.JaxprTrace, "process_call", None)
    if original is None or getattr(original, "_lazyharvest", False):
        return

    def process_call(trace, primitive, f, tracers, params, /):
        with _recipes_made(trace) as made:
            outs = original(trace, primitive, f, tracers, params)
        held = {id(h.recipe) for h in trace.effect_handles}
        for recipe in made:
            if (recipe.primitive is primitive and id(recipe) not in held
                    and any(isinstance(e, effect_type) for e in recipe.effects)):
                trace.effect_handles.append(_pe.EffectHandle(list(recipe.in_tracers), recipe))
        return outs

    process_call._lazyharvest = True  # type: ignore[attr-defined]
    _pe.JaxprTrace.process_call = process_call  # type: ignore[method-assign, attr-defined, unused-ignore]


def internals() -> dict[str, Any]:
    """The JAX modules this module imports inside functions, by dotted name
    (for the contract tests, tests/jax_contracts/)."""
    from jax._src.lax.control_flow import loops as _loops
    from jax._src.state import types as _state_types

    return {"jax._src.lax.control_flow.loops": _loops, "jax._src.state.types": _state_types}


class _Depth(threading.local):
    n = 0


_KEEPING = _Depth()  # how deep this thread is in `ref_writing_hi_prims_kept` blocks


class _RefWritingHiPrimsKept:
    # (a class, not a generator: entered on every call of a compiled slice)
    def __enter__(self) -> None:
        _KEEPING.n += 1

    def __exit__(self, *exc: Any) -> None:
        _KEEPING.n -= 1


_REF_WRITING_HI_PRIMS_KEPT = _RefWritingHiPrimsKept()


def ref_writing_hi_prims_kept() -> contextlib.AbstractContextManager:
    """jax 0.12's DCE drops a high-level primitive (`call_hi_primitive`, e.g.
    `Scan3` under `jax_scan3`) that has no outputs and declares no effects,
    even when it writes a Ref that is read later: `jax.jit` of a scan then
    returns the unwritten carry, in plain JAX. In this block (this thread)
    such an eqn with a live Ref input is kept whole, so the programs the
    harvest traces, slices and compiles compute what the eager one does.
    Outside, JAX's own rule decides: importing lazyharvest changes no program.
    (`keep_ref_writing_hi_prims` installs the rule that asks.)"""
    return _REF_WRITING_HI_PRIMS_KEPT


def holds_hi_prims(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` stages a high-level primitive at any depth."""
    return call_hi_primitive_p is not None and binds(jaxpr, call_hi_primitive_p)


def keep_ref_writing_hi_prims() -> None:
    """Installs the DCE rule of `call_hi_primitive` that keeps a Ref writer
    inside `ref_writing_hi_prims_kept` blocks and is JAX's rule elsewhere."""
    if call_hi_primitive_p is None:
        return
    original = pe.dce_rules.get(call_hi_primitive_p, _pe._default_dce_rule)
    if getattr(original, "_lazyharvest", False):
        return
    keeping = _keeping_ref_writers(original)

    def rule(*args):
        return (keeping if _KEEPING.n else original)(*args)
    rule._lazyharvest = True  # type: ignore[attr-defined]
    pe.dce_rules[call_hi_primitive_p] = rule


def _keeping_ref_writers(original: Callable) -> Callable:
    from jax._src.state import types as _state_types

    def rule(used_outputs, *live_and_eqn):
        *live, eqn = live_and_eqn  # (live inputs on jax >= 0.12)
        live_inputs = live[0] if live else [True] * len(eqn.invars)
        if any(isinstance(getattr(v, "aval", None), _state_types.AbstractRef) and alive
               for v, alive in zip(eqn.invars, live_inputs)):
            return [True] * len(eqn.invars), eqn
        return original(used_outputs, *live_and_eqn)
    return rule
