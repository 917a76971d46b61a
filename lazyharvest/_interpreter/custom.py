"""Rules for `custom_jvp_call` and `custom_vjp_call`: the user's rule stays.

Sites of the primal function are reaped from an inline copy of it (DCE drops
the copy when no reaped value is used); the outputs still come from the
custom call, so the user's derivative rule stays in force.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial, update_wrapper
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from lazyharvest import _jax
from lazyharvest._identity_cache import MISSING, IdentityCache
from lazyharvest._interpreter.plumbing import PlantOperands, split_list
from lazyharvest._interpreter.run import EVAL_RULES, Replay, Run, bind
from lazyharvest._interpreter.sites import (
    ANY_TAG,
    HIGH_LEVEL_BINDS,
    HIGH_LEVEL_RULES,
    Harvest,
    RawKey,
    count_occurrences,
    jaxpr_has_sites,
)
from lazyharvest.keys import PRIMAL, VJP
from lazyharvest.primitive import (
    RULE_COPY,
    active_tags,
    at_scopes,
    collected_cotangents,
    consuming,
    count_staged_sows,
    current_scopes,
    harvested_sows,
    planting,
    sow_p,
)


def _custom(run: Run, eqn: _jax.JaxprEqn, invals: list, *, call_jaxpr, **_) -> list:
    counts = count_occurrences(call_jaxpr.jaxpr, run.harvest)
    if any(k in run.plants for k in counts):
        stripped = dict(_jax.unshared_thunks(eqn.params), call_jaxpr=_function(run, call_jaxpr))
        # The leading operands are values the user's function closes over
        # (a custom_vjp call bound again from a jaxpr, a `Scan3` body's, keeps
        # count of them in its backward function only): like the plants,
        # operands the user's rule does not differentiate.
        is_jvp = eqn.primitive is _jax.custom_jvp_call_p
        return _custom_planted(run, invals, call_jaxpr, lambda *xs: bind(eqn, list(xs), stripped),
                               is_jvp, eqn.params.get("num_consts", 0) if is_jvp
                               else _jax.closed_over_operands(eqn.params))
    if any(run.want(k) for k in counts):
        run.eval(call_jaxpr.jaxpr, call_jaxpr.consts, invals)
    return bind(eqn, invals, dict(eqn.params, call_jaxpr=_function(run, call_jaxpr)))


def _function(run: Run, call_jaxpr: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
    # (a body harvested as an ordinary primitive, a `Scan3`'s, may leave JAX's
    # Refs in the function, which JAX cannot lower inside a custom call)
    return _jax.without_internal_refs(run.stripped(call_jaxpr))


EVAL_RULES[_jax.custom_jvp_call_p] = _custom
EVAL_RULES[_jax.custom_vjp_call_p] = _custom


def _custom_high_level(run: Run, eqn: _jax.JaxprEqn, invals: list, *, _prim, **_) -> list:
    """A custom_jvp/custom_vjp staged as one of JAX's high-level primitives
    (`CustomJVPTraced`, `CustomVJPTraced`: under the `jax_custom_*3` flags,
    and with every flag off for `defvjp(..., generic_batching=True)`; jax
    >= 0.12). Its function's sites are reaped from the object's expansion
    (the function), its outputs come from the primitive as it is, so the
    user's rule stays in force; a planted one becomes a custom function of
    (inputs, plants) whose rule is the user's (`_custom_planted`)."""
    impl = _jax.implementation(eqn)
    if impl is None:
        return run.opaque(eqn, invals, what=f"{type(_prim).__name__} (its function could "
                          "not be traced at these types)")
    if not any(k in run.plants for k in count_occurrences(impl.jaxpr, run.harvest)):
        return run.through_implementation(eqn, invals, impl, keep_unstripped=True)
    # (the operands of the function's closure, and of a custom_vjp's forward
    # rule only, lead: operands the user's rule does not differentiate)
    return _custom_planted(run, invals, impl, lambda *xs: bind(eqn, list(xs)),
                           _jax.hi_prim_flag(_prim) == "jax_custom_jvp3",
                           _jax.custom_hi_prim_leading(_prim))


for _cls, _flag in _jax.HI_PRIM_FLAGS.items():
    if _flag in ("jax_custom_jvp3", "jax_custom_vjp3") and _jax.CUSTOM_HI_PRIMS:
        HIGH_LEVEL_RULES[_cls] = _custom_high_level


def _linearized(run: Run, eqn: _jax.JaxprEqn, invals: list, *, _prim, **_) -> list:
    """The linear part JAX's differentiation makes of a custom function
    staged as a high-level primitive (`call_hi_primitive_linearized`: the
    user's rule applied to tangents or cotangents) does not run the function
    whose sites its object holds: bound as it is. That of another (a
    `RematTraced`'s runs its body) is not looked into yet: refused, naming
    the flag, where it holds a site the harvest takes."""
    if HIGH_LEVEL_RULES.get(type(_prim)) is _custom_high_level:
        return bind(eqn, invals)
    flag = _jax.hi_prim_flag(_prim)
    what = f"the linear part of a {type(_prim).__name__}" + (
        f", which JAX stages with {flag} on," if flag else ",")
    return run.opaque(eqn, invals, what=what, flag=flag, yet=True)


if _jax.call_hi_primitive_linearized_p is not None:
    EVAL_RULES[_jax.call_hi_primitive_linearized_p] = _linearized


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
    if not active_tags():
        return None
    jaxpr, consts = _jax.trace_wrapped(fun, primals)
    return _jax.ClosedJaxpr(jaxpr, consts) if _sows_harvested(jaxpr) else None


def _sows_harvested(jaxpr: _jax.Jaxpr) -> bool:
    return any(jaxpr_has_sites(jaxpr, t) for t in active_tags())


def _run_rule(rule: Callable[[], Any], sow_function: Callable[[], None]) -> Any:
    """`rule()`, the custom calls it binds (most often of the function itself)
    bound as they are, then `sow_function()` unless the rule sowed a harvested
    tag: a rule that sows (most call the function) has its own sites."""
    before = harvested_sows()
    with _in_rule():
        out = rule()
    if harvested_sows() == before:
        sow_function()
    return out


def _sow_function(jaxpr: _jax.Jaxpr, consts: Sequence[Any], primals: Sequence[Any],
                  tangents: Sequence[Any] | None = None) -> None:
    """Evaluates a custom function's jaxpr for its sites only (under
    `jax.jvp`, for their tangents, where `tangents` are given)."""
    def f(*p: Any) -> list:
        return _jax.eval_jaxpr(jaxpr, consts, *p)
    if tangents is None:
        f(*primals)
    else:
        jax.jvp(f, tuple(primals), tuple(map(_jax.dense_tangent, tangents)))


def _sow_traced(fun: Any, primals: Sequence[Any], tangents: Sequence[Any] | None = None
                ) -> None:
    """`_sow_function` of the wrapped function `fun`, if it sows a harvested tag."""
    closed = _harvested_sites(fun, primals)
    if closed is not None:
        _sow_function(closed.jaxpr, closed.consts, primals, tangents)


def _jvp_with_sites(fun: Any, jvp: Any) -> tuple:
    def rule(*xs: Any) -> Any:
        n = len(xs) // 2
        return _run_rule(lambda: jvp.call_wrapped(*xs), lambda: _sow_traced(fun, xs[:n], xs[n:]))
    return fun, _jax.wrapped_like(rule, jvp)


def _fwd_with_sites(fun: Any, fwd: Any, bwd: Any) -> tuple:
    # JAX runs the forward rule on the primal values, outside the
    # differentiation: its sites are given the path of this level's primal
    # sites (in every body it runs). Its names are recomputations where the
    # backward rule, which JAX runs later (outside the call's nest scopes),
    # sows them again (a checkpointing rule re-runs the body).
    sown: set = set()
    scopes = current_scopes()

    def rule(*xs: Any) -> Any:  # (primal, perturbed) pairs
        def call(*pairs: Any) -> Any:
            return _run_rule(lambda: fwd.call_wrapped(*pairs),
                             lambda: _sow_traced(fun, pairs[::2]))
        return _rewritten(call, xs, lambda p: _as_primal(p, sown))
    return fun, _jax.wrapped_like(rule, fwd), _recomputing_bwd(bwd, sown, scopes)


def _recomputing_bwd(bwd: Any, sown: set, scopes: tuple) -> Any:
    """`bwd` (JAX's wrapped backward function), its sows of the names in
    `sown` (filled by the time JAX runs it) marked as recomputations."""
    def rule_bwd(*args: Any) -> Any:
        return _recomputing_sown(bwd.call_wrapped, args, sown, scopes)
    rule_bwd._recomputing = True  # type: ignore[attr-defined]
    return _jax.wrapped_like(rule_bwd, bwd)


def _recomputing_sown(bwd: Callable, args: Sequence[Any], sown: set, scopes: tuple) -> Any:
    with at_scopes(scopes):
        return _rewritten(bwd, args, lambda p: _as_recomputed(p, sown))


def _bwd_after_the_forward(bwd: Any) -> Any:
    """A backward rule JAX runs in a harvest whose forward pass ran before it
    (`reap(jax.vjp(f, x)[1])`): the names it differentiates itself (it sows
    their cotangents) are recomputations where it sows their values, as the
    forward pass sowed them (a checkpointing rule re-runs the body)."""
    if not active_tags() or getattr(getattr(bwd, "f", None), "_recomputing", False):
        return None

    def rule_bwd(*args: Any) -> Any:
        return _recomputing_what_it_differentiates(bwd.call_wrapped, args)
    return _jax.wrapped_like(rule_bwd, bwd)


def _recomputing_what_it_differentiates(bwd: Callable, args: Sequence[Any]) -> Any:
    differentiated: set = set()
    return _rewritten(bwd, args, lambda p: _as_recomputed(p, differentiated),
                      lambda jaxpr: _differentiated_names(jaxpr, differentiated))


def _differentiated_names(jaxpr: _jax.Jaxpr, out: set) -> None:
    """Adds to `out` the (tag, scopes, name) of the cotangent sites in `jaxpr`."""
    def visit(params: dict) -> dict:
        if params["path"] and params["path"][-1] == VJP:
            out.add((params["tag"], params["scopes"], params["name"]))
        return params
    _jax.map_params(jaxpr, sow_p, visit)


_jax.wrap_custom_lin_bwd(_bwd_after_the_forward)


def _as_primal(params: dict, sown: set) -> dict:
    """A harvested site of a forward rule: a primal site of this level."""
    if params["path"] or params["tag"] not in active_tags():
        return params
    sown.add((params["tag"], params["scopes"], params["name"]))
    return dict(params, path=(PRIMAL,))


def _as_recomputed(params: dict, sown: set) -> dict:
    """A value of a backward rule under a name its forward pass sowed."""
    path = params["path"]
    if ((path and path[-1] != PRIMAL) or params["recompute"]
            or (params["tag"], params["scopes"], params["name"]) not in sown):
        return params
    return dict(params, recompute=RULE_COPY)


def _rewritten(fn: Callable, args: Sequence[Any], rewrite: Callable[[dict], dict],
               inspect: Callable[[_jax.Jaxpr], None] | None = None) -> Any:
    """`fn(*args)`, traced and evaluated with the params of its sows (in
    every body it runs, also those traced before) replaced by `rewrite`
    (after `inspect` has seen the traced jaxpr). Arguments are pytrees; their
    leaves and the outputs' other than arrays (flags, symbolic zeros) pass as
    they are."""
    args, in_tree = jax.tree_util.tree_flatten(args, is_leaf=lambda x: x is None)
    arrays = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
    out_tree: list = []

    def traced(*xs: Any) -> list:
        it = iter(xs)
        leaves, tree = jax.tree_util.tree_flatten(
            fn(*jax.tree_util.tree_unflatten(
                in_tree, [next(it) if k else a for a, k in zip(args, arrays)])),
            is_leaf=lambda x: x is None)
        out_tree[:] = [tree, leaves]
        return [x for x in leaves if isinstance(x, jax.Array)]
    xs = [a for a, k in zip(args, arrays) if k]
    jaxpr, consts = _jax.trace_flat(traced, [jax.typeof(x) for x in xs], name="custom rule")
    if inspect is not None:
        inspect(jaxpr)
    outs = iter(_jax.eval_jaxpr(_jax.map_params(jaxpr, sow_p, rewrite), consts, *xs))
    tree, leaves = out_tree
    return jax.tree_util.tree_unflatten(
        tree, [next(outs) if isinstance(x, jax.Array) else x for x in leaves])


def _at_scopes_of_the_call(*subfuns: Any) -> tuple:
    """A custom call's functions (JAX's wrapped functions), traced under the
    nest scopes of the call whenever JAX traces them: a call staged into a
    jaxpr (`jax.jit`) has its rules traced later, when that jaxpr is
    differentiated, and a backward rule runs when the cotangents are known
    (`jax.vjp(f, x)[1]` called later), both outside the scopes, where their
    sites would lose them."""
    scopes = current_scopes()

    def scoped(f: Any) -> Any:
        def call(*args: Any) -> Any:
            with at_scopes(scopes):
                return _jax.call_fresh(f, *args)
        return _jax.wrapped_like(call, f)
    return tuple(map(scoped, subfuns))


def _make_custom_bind(with_sites: Callable[..., tuple],
                      rule_sites: Callable[..., list | None]) -> Callable:
    def make(default: Callable) -> Callable:
        def bind_with_trace(trace, args, avals, params):
            if current_scopes():
                params = _jax.replace_subfuns(params, _at_scopes_of_the_call)
            if not active_tags():
                return default(trace, args, avals, params)
            if _jax.differentiation_kind(trace) is None:
                with _jax.current_trace(trace):
                    outs = rule_sites(args, avals, params)
                if outs is not None:
                    return outs
            elif any(_jax.has_tangent(trace, x) for x in args):
                params = _jax.replace_subfuns(params, with_sites)
            return default(trace, args, avals, params)
        return bind_with_trace
    return make


# --- sites of a rule JAX runs after the harvest ----------------------------------
#
# A custom function traced by a harvest keeps its call in the harvested
# program; JAX runs the user's rule only when it differentiates that program,
# after the harvest has returned. Where the rule sows names of a harvested tag
# that the function does not, the call is replaced by one of a custom
# function with the same rule and one more output per such site: the rule's
# value of the site where JAX runs the rule, zeros where it does not. Those
# outputs are sown right after the call, so they are ordinary sites of the
# harvested program (keys, slices, compute) whatever transformation comes
# later; the rule's own sows are consumed where it runs.

@attrs.frozen
class _RuleSite:
    key: RawKey
    mode: str
    tree: Any
    avals: tuple  # per leaf; append: stacked, one row per occurrence


@attrs.frozen
class _Rule:
    """A custom function's rule traced at a call's types, and the sites of
    `tag` it sows that the function does not."""

    tag: Any
    jaxpr: _jax.ClosedJaxpr
    sites: tuple  # of _RuleSite, in program order

    def run(self, xs: Sequence[Any]) -> tuple[list, list]:
        """The rule's outputs at `xs` and its sites' leaves (its sows of the
        tag consumed)."""
        keys = {s.key for s in self.sites}
        run = Run(Harvest(self.tag), keys.__contains__)
        # (the rules JAX runs inside it, of the custom calls it makes, sow too)
        with _in_rule(), consuming(self.tag):
            outs = run.eval(self.jaxpr.jaxpr, self.jaxpr.consts, list(xs))
        return outs, [x for s in self.sites for x in run.records[s.key].leaves()]


class _RuleDepth(threading.local):
    depth = 0  # how many rules this thread is tracing or running (`_in_rule`)


_RULE = _RuleDepth()


@contextlib.contextmanager
def _in_rule() -> Iterator[None]:
    """Custom calls bound inside a rule (most call the function) are bound
    as they are: the rule's sites are the outer call's business."""
    before = _RULE.depth
    _RULE.depth = before + 1
    try:
        yield
    finally:
        _RULE.depth = before


# (function, rule; avals, tags, scopes) -> True: no sites
_NO_RULE_SITES = IdentityCache()


def _rule_of(fun: Any, rule: Any, avals: Sequence[Any], n: int,
             call: Callable | None = None) -> _Rule | None:
    """`rule` (JAX's wrapped function, called by `call`) traced at `avals`
    with the sites of the first harvested tag it sows apart from `fun` (whose
    arguments are the first `n`); None if there are none, or if the rule
    closes over values of a trace (it must run after that trace ends)."""
    fns = (getattr(fun, "f", None), getattr(rule, "f", None))
    context = (tuple(avals), active_tags(), current_scopes())
    if _NO_RULE_SITES.get(fns, context) is not MISSING:
        return None
    found = _find_rule_sites(fun, rule, avals, n, call)
    if found is None:
        _NO_RULE_SITES.put(fns, context, True)
    return found


def _find_rule_sites(fun: Any, rule: Any, avals: Sequence[Any], n: int,
                     call: Callable | None = None) -> _Rule | None:
    try:
        with _in_rule():
            jaxpr, consts = _jax.trace_wrapped_avals(rule, avals, call)
    except Exception:  # noqa: BLE001  (a rule may refuse to run: eqx.nondifferentiable)
        return None
    if _jax.any_tracer(consts):
        return None
    primal = None
    for tag in sorted(active_tags(), key=repr):
        names = {k[2] for k in count_occurrences(jaxpr, Harvest(tag))}
        if not names:
            continue
        if primal is None:
            primal, _ = _jax.trace_wrapped_avals(fun, avals[:n])
        own = _names_sown(primal, tag)
        if names - own:
            found = _Rule(tag, _jax.ClosedJaxpr(jaxpr, consts), ())
            return attrs.evolve(found, sites=_shapes(found, avals, own))
    return None


def _names_sown(jaxpr: _jax.Jaxpr, tag: Any) -> set:
    """The names `jaxpr` sows of `tag`, recomputations included (a function
    a rule recomputes sows them as such: they are not the rule's own)."""
    names: set = set()

    def visit(params: dict) -> dict:
        if params["tag"] == tag:
            names.add(params["name"])
        return params
    _jax.map_params(jaxpr, sow_p, visit)
    return names


def _shapes(rule: _Rule, avals: Sequence[Any], own: set) -> tuple:
    """The sites of `rule.tag` the rule sows at `avals` but the function does not."""
    found: list = []

    def probe(*xs):
        run = Run(Harvest(rule.tag), lambda k: k[2] not in own)
        run.eval(rule.jaxpr.jaxpr, rule.jaxpr.consts, list(xs))
        found.extend(_RuleSite(k, r.mode, r.tree, tuple(jax.typeof(x) for x in r.leaves()))
                     for k, r in run.records.items())
        return []
    with _in_rule():
        _jax.trace_flat(probe, avals)
    return tuple(found)


def _primal(fun: Any, avals: Sequence[Any]) -> _jax.ClosedJaxpr:
    """The function traced as JAX would, filling the output tree it stores
    (the caller reads it after the bind)."""
    return _jax.ClosedJaxpr(*_jax.trace_flat(lambda *a: list(fun.call_wrapped(*a)), avals))


def _sow_rule_sites(rule: _Rule, leaves: Sequence[Any]) -> None:
    """Sows the rule's sites, from the extra outputs of the call."""
    it = iter(leaves)
    for s in rule.sites:
        vals = [next(it) for _ in s.avals]
        rows = ([[v[i] for v in vals] for i in range(s.avals[0].shape[0])]
                if s.mode == "append" else [vals])
        for row in rows:
            sow_p.bind(*row, tag=rule.tag, name=s.key[2], mode=s.mode, scopes=s.key[1],
                       path=s.key[0], tree=s.tree, effect=True, recompute=False)


def _with_zeros(primal: _jax.ClosedJaxpr, rule: _Rule) -> Callable:
    """The function with zeros for the rule's sites as extra outputs."""
    def call(*xs):
        outs = _jax.eval_jaxpr(primal.jaxpr, primal.consts, *xs)
        return [*outs, *(_jax.zeros_like_aval(a) for s in rule.sites for a in s.avals)]
    return call


def _call_and_sow(g: Callable, args: Sequence[Any], rule: _Rule, n_out: int) -> list:
    outs = g(*args)
    _sow_rule_sites(rule, outs[n_out:])
    return outs[:n_out]


def _jvp_rule_sites(args: Sequence[Any], avals: Sequence[Any], params: dict) -> list | None:
    """A `custom_jvp_call` bind under a harvest: its rule's sites (above)."""
    subfuns = params.get("subfuns")
    if subfuns is None or _RULE.depth:
        return None
    fun, jvp = subfuns
    rule = _rule_of(fun, jvp, [*avals, *(a.to_tangent_aval() for a in avals)], len(avals))
    return None if rule is None else _jvp_call_with_rule_sites(_primal(fun, avals), rule, args)


def _jvp_call_with_rule_sites(primal: _jax.ClosedJaxpr, rule: _Rule,
                              args: Sequence[Any]) -> list:
    n_out = len(primal.jaxpr.outvars)

    def call_jvp(ps, ts):
        outs, leaves = rule.run([*ps, *ts])
        zeros = [_jax.zeros_like_aval(jax.typeof(x).to_tangent_aval()) for x in leaves]
        return [*outs[:n_out], *leaves], [*map(_jax.dense_tangent, outs[n_out:]), *zeros]

    g = jax.custom_jvp(_with_zeros(primal, rule))
    g.defjvp(call_jvp)
    return _call_and_sow(g, args, rule, n_out)


def _vjp_rule_sites(args: Sequence[Any], avals: Sequence[Any], params: dict) -> list | None:
    """A `custom_vjp_call` bind under a harvest: the sites of its forward
    rule, as for a `custom_jvp` rule. (The backward rule runs when the
    cotangents are known, after any harvest of the forward pass returned.)"""
    subfuns = params.get("subfuns")
    if subfuns is None or _RULE.depth:
        return None
    fun, fwd, bwd = subfuns

    def paired(*xs):  # JAX's forward rule takes (value, perturbed) pairs
        return fwd.call_wrapped(*(v for x in xs for v in (x, True)))

    rule = _rule_of(fun, fwd, avals, len(avals), paired)
    if rule is None:
        return None
    primal = _jax.ClosedJaxpr(*_jax.trace_wrapped_avals(fun, avals))
    # traced again as JAX would (the first trace left JAX's stores empty, for
    # a rule without sites): this fills the output and residual trees the
    # caller and the backward rule read
    _jax.trace_flat(lambda *xs: list(paired(*xs)), avals)
    _, _, forwards = params["out_trees"]()

    def residuals(xs: Sequence[Any], pruned: list) -> list:
        it = iter(pruned)
        return [next(it) if i is None else xs[i] for i in forwards]
    return _vjp_call_with_rule_sites(primal, rule, args, residuals,
                                     lambda res, cts: _jax.call_bwd(bwd, *res, *cts))


def _vjp_call_with_rule_sites(primal: _jax.ClosedJaxpr, rule: _Rule, args: Sequence[Any],
                              residuals: Callable, bwd: Callable) -> list:
    """The call replaced by a custom_vjp with the rule's sites as extra
    outputs: the rule's jaxpr gives `[*residuals, *outputs]`, whose
    residuals `residuals(xs, them)` completes; `bwd(res, dense cts)`."""
    n_out = len(primal.jaxpr.outvars)

    def call_fwd(*xs):
        outs, leaves = rule.run(xs)
        return ([*outs[len(outs) - n_out:], *leaves],
                residuals(xs, outs[:len(outs) - n_out]))

    def call_bwd(res, cts):
        return bwd(res, list(map(_jax.dense_tangent, cts[:n_out])))

    g = jax.custom_vjp(_with_zeros(primal, rule))
    g.defvjp(call_fwd, call_bwd)
    return _call_and_sow(g, args, rule, n_out)


if _jax.CUSTOM_CALL_HOOKS:  # (jax 0.8: these sites stay unreaped)
    # (they act on a harvest's tags and nest scopes only: outside, JAX binds
    # its custom calls with no frame of ours, `_jax.hooks_in_force`)
    _jax.register_bind_hook(_jax.custom_jvp_call_p,
                            _make_custom_bind(_jvp_with_sites, _jvp_rule_sites),
                            only_in_force=True)
    _jax.register_bind_hook(_jax.custom_vjp_call_p,
                            _make_custom_bind(_fwd_with_sites, _vjp_rule_sites),
                            only_in_force=True)


# --- the same, for the objects of `jax_custom_jvp3` / `jax_custom_vjp3` -------
#
# Under those flags (jax >= 0.12) a custom function is a `CustomJVPTraced` /
# `CustomVJPTraced` object bound by `call_hi_primitive`, its rules params of
# the object: a bind in a harvest rebuilds the object with its rules wrapped
# as the hooks above wrap a `custom_jvp_call`'s.

def _sow_hi(prim: Any, primals: Any, tangents: Any = None) -> None:
    """`_sow_function` of the object's function, if it sows a harvested tag
    (`primals`, `tangents`: structured as its rules take them)."""
    jaxpr, ps = _jax.custom_hi_primal(prim, primals)
    if _sows_harvested(jaxpr):
        _sow_function(jaxpr, (), ps,
                      None if tangents is None else _jax.custom_hi_primal(prim, tangents)[1])


def _hi_jvp_with_sites(prim: Any) -> Any:
    jvp_rule = _jax.custom_hi_rules(prim)["jvp_rule"]

    def rule(primals: Any, tangents: Any) -> Any:
        return _run_rule(lambda: jvp_rule(primals, tangents),
                         lambda: _sow_hi(prim, primals, tangents))
    return _jax.with_custom_rules(prim, jvp_rule=update_wrapper(rule, jvp_rule))


def _hi_fwd_with_sites(prim: Any) -> Any:
    rules, scopes = _jax.custom_hi_rules(prim), current_scopes()
    sown: set = set()

    def forward(rule: Callable) -> Callable:
        """`rule(*args)`, a forward rule: the function's sites are primal sites."""
        def run(*args: Any) -> Any:
            def call(*xs: Any) -> Any:
                return _run_rule(lambda: rule(*xs), lambda: _sow_hi(prim, xs))
            return _rewritten(call, args, lambda p: _as_primal(p, sown))
        return update_wrapper(run, rule)

    def recomputing(rule: Callable) -> Callable:
        """`rule`, run after the forward rule: its sows of the names the
        forward rule sowed are recomputations."""
        def run(*args: Any) -> Any:
            return _recomputing_sown(rule, args, sown, scopes)
        return update_wrapper(run, rule)

    remat = _jax.custom_hi_remat_rules(prim)
    if remat is None:
        def fwd(nzs_in: Any, *args: Any) -> Any:
            return forward(partial(rules["fwd"], nzs_in))(*args)
        return _jax.with_custom_rules(prim, fwd=update_wrapper(fwd, rules["fwd"]),
                                      bwd=recomputing(rules["bwd"]))
    # `defremat`: a forward rule, then `rem` (right after it, as JAX's forward
    # rule for them runs it, or in the backward pass under jax.checkpoint),
    # which may call the function again: a recomputation
    rfwd, rem, rbwd = forward(remat[0]), recomputing(remat[1]), recomputing(remat[2])

    def fwd_then_rem(nzs_in: Any, *args: Any) -> Any:
        out, res = rfwd(*args)
        return out, rem(res, *args)[1]
    return _jax.with_custom_rules(prim, fwd=update_wrapper(fwd_then_rem, rules["fwd"]),
                                  bwd=recomputing(rules["bwd"]),
                                  remat_rules=(rfwd, rem, rbwd))


def _hi_bwd_after_the_forward(prim: Any) -> Any:
    """The object with its backward rule as `_bwd_after_the_forward` makes
    it, for a harvest that runs it after the forward pass."""
    bwd = _jax.custom_hi_rules(prim)["bwd"]

    def rule_bwd(res: Any, out_ct: Any) -> Any:
        if not active_tags():
            return bwd(res, out_ct)
        return _recomputing_what_it_differentiates(bwd, (res, out_ct))
    return _jax.with_custom_rules(prim, bwd=update_wrapper(rule_bwd, bwd))


def _hi_rule_sites(prim: Any, args: Sequence[Any], avals: Sequence[Any]) -> list | None:
    """A custom function's object bound in a harvest, not differentiated:
    its rule's sites, as `_jvp_rule_sites` / `_vjp_rule_sites` find them."""
    if _RULE.depth:
        return None
    rules, tree, n = _jax.custom_hi_rules(prim), _jax.custom_hi_tree(prim), len(avals)
    primal = _jax.ClosedJaxpr(_jax.custom_hi_function(prim), ())

    def fun(*xs: Any) -> list:
        return _jax.eval_jaxpr(primal.jaxpr, (), *xs)
    if "jvp_rule" in rules:
        def jvp(*xs: Any) -> list:
            outs, tangents = rules["jvp_rule"](tree.unflatten(xs[:n]), tree.unflatten(xs[n:]))
            return [*outs, *tangents]
        rule = _find_rule_sites(fun, jvp, [*avals, *(a.to_tangent_aval() for a in avals)], n)
        return None if rule is None else _jvp_call_with_rule_sites(primal, rule, args)
    if len(primal.jaxpr.invars) != n:  # (operands for the forward rule only)
        return None
    nonzeros = tree.unflatten([True] * n)
    res_tree: list = []  # (the residuals' tree, once the forward rule is traced)

    def fwd(*xs: Any) -> list:
        outs, (res, static) = rules["fwd"](nonzeros, *tree.unflatten(xs))
        res_tree[:] = [static]
        return [*res, *outs]
    rule = _find_rule_sites(fun, fwd, avals, n)
    if rule is None:
        return None
    leading = _jax.custom_hi_prim_leading(prim)

    def bwd(res: list, cts: list) -> list:
        in_cts, _ = rules["bwd"]((res, *res_tree), cts)
        return [None] * leading + [None if _jax.is_zero(c) else c for c in in_cts]
    return _vjp_call_with_rule_sites(primal, rule, args, lambda xs, res: res, bwd)


def _hi_scoped(prim: Any) -> Any:
    """The object with its rules run under the current nest scopes
    (`_at_scopes_of_the_call`)."""
    scopes = current_scopes()

    def scoped(f: Callable) -> Callable:
        def call(*args: Any) -> Any:
            with at_scopes(scopes):
                return f(*args)
        return update_wrapper(call, f)
    return _jax.with_custom_rules(
        prim, **{k: scoped(f) for k, f in _jax.custom_hi_rules(prim).items()})


def _custom_hi_bind(default: Callable, trace: Any, args: Sequence[Any],
                    avals: Sequence[Any], params: dict) -> list:
    prim = params["_prim"]
    if active_tags() and _sows_harvested(_jax.custom_hi_function(prim)):
        count_staged_sows()  # (a rule that calls its function has its sites)
    if current_scopes():
        prim = _hi_scoped(prim)
    differentiated = _jax.differentiation_kind(trace) is not None
    if active_tags() and not differentiated:
        with _jax.current_trace(trace):
            outs = _hi_rule_sites(prim, args, avals)
        if outs is not None:
            return outs
    elif differentiated and any(_jax.has_tangent(trace, x) for x in args):
        jvp = _jax.hi_prim_flag(prim) == "jax_custom_jvp3"
        if active_tags():
            prim = (_hi_jvp_with_sites if jvp else _hi_fwd_with_sites)(prim)
        elif not jvp and jaxpr_has_sites(_jax.custom_hi_function(prim), ANY_TAG):
            # (a backward function made outside a harvest, which may run it)
            prim = _hi_bwd_after_the_forward(prim)
    return default(trace, args, avals, params if prim is params["_prim"]
                   else dict(params, _prim=prim))


for _cls, _flag in _jax.HI_PRIM_FLAGS.items():
    if _flag in ("jax_custom_jvp3", "jax_custom_vjp3") and _jax.CUSTOM_HI_PRIMS:
        HIGH_LEVEL_BINDS[_cls] = _custom_hi_bind


def _custom_vmap(run: Run, eqn: _jax.JaxprEqn, invals: list, *, call, **_) -> list:
    """`custom_vmap`: reaped from an inline copy; the user's batching rule stays
    for the outputs. A planted call runs its planted body inline (the rule, a
    statement about the unplanted function, no longer applies)."""
    counts = count_occurrences(call.jaxpr, run.harvest)
    if any(k in run.plants for k in counts):
        return run.eval(call.jaxpr, call.consts, invals)
    if any(run.want(k) for k in counts):
        run.eval(call.jaxpr, call.consts, invals)
    return bind(eqn, invals, dict(eqn.params, call=run.stripped(call)))


EVAL_RULES[_jax.custom_vmap_p] = _custom_vmap


def _remat_opt(run: Run, eqn: _jax.JaxprEqn, invals: list, *, fwd_jaxpr, **_) -> list:
    """The forward of a `custom_vjp(optimize_remat=True)`, once differentiated:
    evaluated inline under a harvest (same values and derivatives; the harvested
    program does not get the remat optimization)."""
    return run.eval(fwd_jaxpr.jaxpr, fwd_jaxpr.consts, invals)


EVAL_RULES[_jax.remat_opt_p] = _remat_opt


def _rule_plants(run: Run, ops: PlantOperands, counts: dict, start: dict) -> tuple:
    """For a planted custom call: `in_rule(plant leaves, collect)`, the block
    in which the user's rules sow the planted values, and
    `plant_cotangents(collected, plant leaves)`, each plant's cotangent."""
    # An append site the call sows once takes one row of its plant (the
    # cursor's: the row of this occurrence); sown several times in the call,
    # its rows cannot be told apart where the rule sows it (docs/semantics.md)
    rows = {k: start.get(k, 0) if run.plants[k].mode == "append" else None for k in ops.keys}
    # (a value key: its labels, if any, are those of differentiations inside
    # the call, where the rule's own sow of the name is that value's)
    in_rules = [k for k in ops.keys if all(label == PRIMAL for label in k[0])
                and not run.plants[k].additive and (rows[k] is None or counts[k] == 1)]

    def in_rule(leaves: Sequence[Any], collect: bool = False) -> Any:
        # the user's rules, run by JAX on the planted program, sow the planted
        # values: what they differentiate or recompute is the planted program
        plants = ops.plants(run.plants, leaves)
        return planting({(run.harvest.tag, k[1], k[2]): partial(Replay(rows[k]).apply, plants[k])
                         for k in in_rules}, collect)

    def plant_cotangents(collected: dict, leaves: Sequence[Any]) -> list:
        # A plant's cotangent is the one the rule's own differentiation gives
        # the site it replaces (a rule that recomputes the site); none where
        # the rule does not differentiate it.
        out: list = []
        for k, plant in zip(ops.keys, split_list(list(leaves), ops.sizes)):
            # (only a plant the rule sows has a cotangent of its own there)
            cts = collected_cotangents(collected.get((run.harvest.tag, k[1], k[2])) or []
                                       if k in in_rules else [])
            if cts is None:
                out += [None] * len(plant)
                continue
            cts = [c.astype(jnp.result_type(x)) for c, x in zip(cts, plant)]
            out += cts if rows[k] is None else [
                jnp.zeros(jnp.shape(x), c.dtype).at[rows[k]].set(c) for c, x in zip(cts, plant)]
        return out
    return in_rule, plant_cotangents


def _custom_planted(run: Run, invals: list, closed: _jax.ClosedJaxpr, original: Callable,
                    is_jvp: bool, n_c: int) -> list:
    """A custom_jvp/vjp call with plants inside its primal function `closed`;
    `original(*invals)` binds the call (a custom_jvp's if `is_jvp`), whose
    first `n_c` operands its rule does not differentiate.

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
        run.end_inner_passes(inner.primal_sown)
    for k in ops.keys:
        run.cursor[k] = start.get(k, 0) + counts[k]
    primal = _jax.without_internal_refs_fn(lambda *a: planted(*a)[0])

    in_rule, plant_cotangents = _rule_plants(run, ops, counts, start)
    if is_jvp:
        fun = _with_jvp_of(original, primal, n_c, n_in, in_rule)
    else:
        fun = _with_vjp_of(original, primal, n_c, n_in, in_rule, plant_cotangents)
    return list(fun(*invals, *ops.leaves))


def _with_jvp_of(original: Callable, primal: Callable, n_c: int, n_in: int,
                 in_rule: Callable) -> Callable:
    """`primal(*consts, *xs, *plants)` whose JVP is `original`'s in `xs`
    (consts and plants: zero), run `in_rule(plants)`."""
    fun = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        consts = primals[:n_c]
        with in_rule(primals[n_in:]):
            _, t_out = jax.jvp(lambda *xs: original(*consts, *xs),
                               primals[n_c:n_in], tangents[n_c:n_in])
        return primal(*primals), t_out
    fun.defjvp(jvp)
    return fun


def _with_vjp_of(original: Callable, primal: Callable, n_c: int, n_in: int,
                 in_rule: Callable, plant_cotangents: Callable) -> Callable:
    """`primal(*consts, *xs, *plants)` whose VJP is `original`'s in the `xs` that
    are perturbed (consts and unperturbed inputs get none: libraries such as
    Equinox check that their non-differentiated inputs stay so), its rules run
    `in_rule(plants)`; a plant's cotangent is the one the backward rule gives
    the site it replaces (`plant_cotangents`).

    JAX traces the forward rule once per perturbation pattern but keeps one
    residual structure for the call, so the residuals have the same structure
    under every pattern: the operands, and the pattern itself written in the
    shapes of empty flags. The user's rule runs in the backward rule (its
    forward part then its backward part), under that pattern.
    """
    fun = jax.custom_vjp(primal)

    def differentiated(pattern: Sequence[bool], vals: Sequence[Any]) -> list[int]:
        idx = [i for i, p in zip(range(n_c, n_in), pattern) if p]
        if idx or not pattern[-1]:
            return idx
        # only a plant is differentiated: the rule still runs (with no input
        # cotangent asked for), so that its recomputed sites get theirs
        return [i for i in range(n_c, n_in) if _jax.differentiable(jax.typeof(vals[i]))]

    def fwd(*a: Any):
        vals = [x.value for x in a]
        pattern = [x.perturbed for x in a[n_c:n_in]] + [any(x.perturbed for x in a[n_in:])]
        flags = [np.zeros((int(p),), np.bool_) for p in pattern]
        return primal(*vals), (vals, flags)

    def bwd(res, cts):
        vals, flags = res
        pattern = [f.shape[0] == 1 for f in flags]
        run, n = differentiated(pattern, vals), len(vals)
        cts = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
               for c in cts]

        def part(*ps: Any) -> Any:
            full = list(vals[:n_in])
            for i, p in zip(run, ps):
                full[i] = p
            return original(*full)
        out: list = [None] * n
        with in_rule(vals[n_in:], collect=True) as collected:
            _, vjp = jax.vjp(part, *[vals[i] for i in run])
            grads = vjp(list(cts))
        for i, g in zip(run, grads):
            if pattern[i - n_c]:  # (not those run only for the plants)
                out[i] = g
        out[n_in:] = plant_cotangents(collected, vals[n_in:])
        return tuple(out)
    fun.defvjp(fwd, bwd, symbolic_zeros=True)
    return fun
