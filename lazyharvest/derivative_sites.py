"""Dead and constant sites under JAX's own differentiation.

A site is a site of every program a transformation makes, whether or not the
output uses it (*dead*) and whether or not it depends on the differentiated
inputs (*constant*), also when the transformation runs outside the harvest
(`reap(jax.linearize(f, x)[1])`, `reap(jax.vjp(f, x)[1])`). Outside a harvest
`sow` eqns carry no effect, so JAX would drop dead ones (its tangent traces
hold effect-free eqns weakly, its DCE passes remove unused ones) and never
differentiate constant ones (it skips the rules of an eqn whose inputs all have
zero tangents). The rules here prevent both, at trace time only: a cached jit
dispatch binds nothing. docs/semantics.md section 2a says what each does and
what stays unsupported, and why.

Importing this module registers the rules (`lazyharvest/__init__.py` does).
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

from lazyharvest import _jax
from lazyharvest._identity_cache import MISSING, IdentityCache
from lazyharvest.keys import JVP, PRIMAL, VJP
from lazyharvest.primitive import (
    active_tags,
    given_a_zero_tangent,
    is_masked,
    planting_bind,
    sow_effect,
    sow_p,
    sub_jaxprs,
    tangent_params,
)

__all__: list[str] = []


def _is_derivative(params: dict) -> bool:
    path = params["path"]
    return bool(path) and path[-1] in (JVP, VJP)


def _linearize(is_vjp, nonzeros, *primals, path, **params):
    """`jax.linearize`/`jax.vjp`: the primal site now, the tangent site on the
    tangent trace, kept there until the trace ends even if nothing uses it."""
    del is_vjp, nonzeros
    outs = sow_p.bind(*primals, path=path + (PRIMAL,), **params)
    masked = is_masked(params)  # the tangent site reads the primal mask
    mask = outs[-1:] if masked else []
    floats = _has_float_leaf(primals[:len(primals) - masked])

    def linearized(residuals, *tangents):
        n = len(tangents) - len(residuals)
        tangents = [_jax.ad.instantiate_zeros(t) for t in tangents[:n]]
        if not floats:  # (section 2b of docs/semantics.md: `_has_float_leaf`)
            return [*tangents, *(_jax.Zero(m.aval.to_tangent_aval()) for m in residuals)]
        with _jax.keep_staged(_holds_tangent_sites):
            outs_t = sow_p.bind(*tangents, *residuals, path=path + (JVP,),
                                **tangent_params(params))
        return [*outs_t[:n], *(_jax.Zero(m.aval.to_tangent_aval()) for m in residuals)]
    return outs, [True] * (len(outs) - masked) + [False] * masked, mask, linearized


def _has_float_leaf(leaves) -> bool:
    """Whether a site with these leaves has a tangent site: an integer or
    boolean site has none (docs/semantics.md, section 2b), also where its
    tangent is not a symbolic zero but a float0 value (read from the tangent
    of an integer Ref), which JAX differentiates like any other."""
    return any(_jax.differentiable(jax.typeof(x)) for x in leaves)


def _dce(used_outputs, eqn):
    # A tangent or cotangent site is kept even when nothing uses it: the linear
    # and backward functions of jax.linearize / jax.vjp made outside a harvest
    # still hold it; so does the linear function the copy of a value sown
    # before a while loop (`_make_while_bind`). Primal sites without an
    # effect go as usual.
    if _is_derivative(eqn.params) or eqn.params.get("earlier"):
        return [True] * len(eqn.invars), eqn
    return _jax.default_dce_rule(used_outputs, eqn)


_HOLDS = IdentityCache()  # (jaxpr, which) -> found

# Which sites `_jaxpr_holds` looks for: any site; a tangent or cotangent site;
# the zero tangent of a constant site under reverse mode (`_constant_site`);
# or not a site but a while loop (which reverse mode cannot differentiate).
_ANY, _DERIVATIVE, _CONSTANT, _WHILE = "any", "derivative", "constant", "while"


def _jaxpr_holds(jaxpr, which: str) -> bool:
    hit = _HOLDS.get((jaxpr,), which)
    if hit is not MISSING:
        return hit
    found = any(_eqn_holds(e, which) for e in jaxpr.eqns)
    _HOLDS.put((jaxpr,), which, found)
    return found


def _eqn_holds(eqn, which: str) -> bool:
    if which == _WHILE:
        return eqn.primitive is _jax.while_p or _bodies_hold(eqn.params, which)
    if eqn.primitive is sow_p:
        if which == _CONSTANT:
            return bool(eqn.params.get("constant")) and eqn.params["path"][-1:] == (JVP,)
        return which == _ANY or _is_derivative(eqn.params)
    return _bodies_hold(eqn.params, which)


def _bodies_hold(params: dict, which: str) -> bool:
    """Some body among `params` holds a site of the kind `which` selects."""
    return any(_jaxpr_holds(j, which) for j in sub_jaxprs(params))


def _holds_tangent_sites(eqn) -> bool:
    """`eqn` is, or holds in a body, a tangent/cotangent site."""
    return _eqn_holds(eqn, _DERIVATIVE)


def _holds_constant_sites(eqn) -> bool:
    """`eqn` holds in a body the zero tangent of a constant site made under
    reverse mode: a value the backward pass treats as linear, made inside."""
    return _bodies_hold(eqn.params, _CONSTANT)


def _bodies_hold_tangent_sites(params: dict) -> bool:
    return _bodies_hold(params, _DERIVATIVE)


def _make_bind(default):
    def bind_with_trace(trace, args, avals, params):
        kind = _jax.differentiation_kind(trace)
        if kind is None:
            if _jax.folds_constants(trace, args) and (
                    params["effect"] or _is_derivative(params)):
                # jax.ensure_compile_time_eval: a harvested site (or a
                # derivative site) is staged, so it can be reaped and planted.
                return _jax.stage_unfolded(trace, sow_p, args, params)
            return default(trace, args, avals, params)
        if (any(_jax.has_tangent(trace, x) for x in args)
                or not any(_jax.differentiable(a) for a in avals)):
            return default(trace, args, avals, params)
        return _constant_site(default, kind, trace, args, avals, params)
    return bind_with_trace


def _constant_site(default, kind, trace, args, avals, params):
    """A site none of whose inputs has a tangent at this level of
    differentiation: JAX would bind it on the parent trace and skip its rules.
    It gets a zero tangent instead, like any site whose tangent is zero."""
    if kind == "vjp" and _jax.under_eager_shard_map(trace):
        return default(trace, args, avals, params)  # eager shard_map refuses refs
    args = [_jax.primal_of(trace, x) for x in args]  # tracers of `trace` with zero tangents
    path = params["path"]
    rest = {k: v for k, v in params.items() if k != "path"}
    with _jax.current_trace(_jax.parent_trace(trace)):
        outs = sow_p.bind(*args, path=path + (PRIMAL,), **rest)
    if kind == "jvp" and not _jax.records_program(trace):
        return outs  # eager jax.jvp: nothing could record the zero
    floats = [_jax.differentiable(a) for a in avals]
    mask = outs[-1:] if is_masked(params) else []  # the tangent site reads it
    leaves = avals[:len(avals) - len(mask)]
    with _jax.current_trace(_jax.tangent_trace(trace)), _jax.no_constant_folding(), \
            _jax.keep_staged(_holds_tangent_sites):
        if kind == "vjp" or _jax.splitting_checkpoint():
            # Reverse mode: a zero the backward pass treats as linear, flowing
            # on as the site's tangent, so the site's cotangent (d out / d site)
            # arrives and is recorded like any other. (jax.checkpoint's body
            # is differentiated by jvp: its zero flows on too, and the split
            # makes it linear: `_checkpointed`.)
            linear = kind == "vjp"
            zeros = [_jax.linear_zero(a) if f and linear else _jax.zeros_tangent(a)
                     for a, f in zip(leaves, floats)]
            tangents = sow_p.bind(*zeros, *mask, **dict(rest, path=path + (JVP,), constant=True))
            return [_jax.with_tangent(trace, x, t) if f else x
                    for x, t, f in zip(outs, tangents[:len(leaves)] + mask, floats)]
        # Forward mode: record a zero tangent; downstream the tangent stays a
        # symbolic zero, so the program does no arithmetic on it.
        zeros = [_jax.zeros_tangent(a) for a in leaves]
        sow_p.bind(*zeros, *mask, path=path + (JVP,), **rest)
    return outs


def _make_partial_eval(previous):
    """JAX's partial evaluation (jax.checkpoint's transpose,
    jax.linear_transpose) keeps tangent and cotangent sites nobody uses;
    primal sites keep `previous`, which holds them inside scan loops."""
    def partial_eval(trace, *tracers, **params):
        if _is_derivative(params):
            return _jax.partial_eval_kept(trace, sow_p, tracers, params,
                                          linear=bool(params.get("constant")),
                                          primal=int(is_masked(params)))
        return previous(trace, *tracers, **params)
    return partial_eval


def _checkpointed(rule):
    """sow's rule for jax.checkpoint's partial evaluation, given `rule`.

    jax.checkpoint differentiates its body with jvp, then splits it into a
    forward part and a (rematerialized) linear part. A tangent site with no
    unknown input (the zero tangent recorded for a constant site by
    `_constant_site`, or one in a loop given a zero tangent by
    `_make_body_bind`) would land in the forward part, where no cotangent can
    reach it. Where the zero flows on (marked `constant` by `_constant_site`
    while the body is split) it is staged in the linear part, the zero passed
    as a residual: the transpose of that part reads it from a fresh reference
    (`_make_partial_eval`), so the site's cotangent arrives, as for a
    constant site outside jax.checkpoint. Otherwise (a body that reads no
    input with a tangent) it passes its value on without being a site.
    """
    def remat_rule(saveable, unks_in, inst_in, eqn):
        path = eqn.params["path"]
        if path and path[-1] == JVP and not any(unks_in):
            n = len(eqn.outvars)
            res = [v for v, inst in zip(eqn.invars, inst_in)
                   if not inst and not isinstance(v, _jax.Literal)]
            if not eqn.params.get("constant"):  # a zero that does not flow on
                # recomputed like any pure eqn (a while loop's split body
                # must need no residual)
                same = _jax.identity_eqn(eqn)
                return same, same, [False] * n, [True] * n, res
            return None, eqn, [True] * n, [True] * n, res
        return rule(saveable, unks_in, inst_in, eqn)
    return remat_rule


def _make_body_bind(default):
    """The bind hook of jit, scan and cond: one none of whose inputs has a
    tangent at a level of differentiation is skipped by JAX's rules as a
    whole, so the sites in its body would never meet that level. If the body
    holds sites, one input gets a zero tangent, and the sites inside are then
    dead or constant sites of that level like any other."""
    def bind_with_trace(trace, args, avals, params):
        kind = _jax.differentiation_kind(trace)
        # the body may sow the names remembered so far; a while loop in it
        # starts from their values (`_make_while_bind`)
        found = _forget(trace, params)
        in_loops = _sown_keys(params, only_in_loops=True) if found else set()
        _copy_earlier(trace, args, [f for f in found if _site_key(f[0]) in in_loops])
        given = False
        if kind is not None:
            given_args = _differentiated(trace, kind, args, avals, params)
            given, args = given_args is not args, given_args
        with given_a_zero_tangent(given):
            return default(trace, args, avals, params)
    return bind_with_trace


# --- the zero given to a construct inside jax.checkpoint, for reverse mode -------
# jax.checkpoint differentiates its body with jvp, then splits the jvp into a
# forward part and a linear part by what depends on its tangent inputs. A zero
# tangent made by `zeros_tangent` depends on none: the construct's tangent
# half (and its tangent sites) would land in the forward part, where no
# cotangent reaches them. This zero is made by its own primitive, which the
# split puts in the linear part (an unknown, as a tangent input is), and
# whose transpose-time partial evaluation reads it from a fresh reference (a
# value the backward pass treats as linear): the construct's tangent half is
# then split and transposed like one fed a real tangent.

given_zero_p = _jax.Primitive("given_zero_tangent")


def _zeros(*, shape, dtype):
    return jnp.zeros(shape, dtype)


def _given_zero(aval):
    aval = aval.to_tangent_aval()
    return given_zero_p.bind(shape=aval.shape, dtype=aval.dtype)


given_zero_p.def_impl(_zeros)
given_zero_p.def_abstract_eval(lambda *, shape, dtype: _jax.ShapedArray(shape, dtype))
_jax.mlir.register_lowering(given_zero_p, _jax.mlir.lower_fun(_zeros, multiple_results=False))
_jax.ad.primitive_jvps[given_zero_p] = lambda primals, tangents, **params: (
    given_zero_p.bind(**params), _jax.Zero(_jax.ShapedArray(params["shape"], params["dtype"])))
_jax.register_remat_rule(given_zero_p, lambda saveable, unks_in, inst_in, eqn: (
    None, eqn, [True], [True], []))
_jax.register_partial_eval_rule(given_zero_p, lambda previous: lambda trace, **params: (
    _jax.linear_unknown(trace, _zeros(**params))))


def _differentiated(trace, kind: str, args, avals, params: dict):
    """`args`, one of them given a zero tangent at `trace` when none has a
    tangent and the bodies among `params` hold sites (else JAX would skip the
    eqn's rules and its sites would never meet this level)."""
    if any(_jax.has_tangent(trace, x) for x in args) or not _bodies_hold(params, _ANY):
        return args
    if (kind == "vjp" or _jax.splitting_checkpoint()) and _bodies_hold(params, _WHILE):
        # the zero could reach a while loop that reverse mode (or the
        # checkpoint's split, which puts it in the linear part) would transpose
        return args
    if kind == "jvp" and not (active_tags() or _jax.under_linearization(trace)):
        # jax.jvp's values are recorded only by a harvest (a jitted jvp is
        # retraced when one starts): no arithmetic on zeros outside one.
        return args
    floats = [i for i, a in enumerate(avals) if _jax.differentiable(a)]
    if floats:
        # (the first float input that reaches no custom_vjp call, else the
        # one reaching the latest operand of one: its leading operands may
        # be values its function closes over, which JAX refuses to
        # differentiate, and a call traced again from a harvest's rebuilt
        # program no longer says how many)
        reached = {i: _rule_operand(params, i) for i in floats}
        i = max(floats, key=lambda i: (reached[i], -i))
        if reached[i] >= 0:
            args = list(args)
            args[i] = _jax.with_zero_tangent(
                trace, args[i], linear=kind == "vjp",
                zeros=_given_zero if _jax.splitting_checkpoint() else _jax.zeros_tangent)
    return args


_NO_RULE = float("inf")


def _rule_operand(params: dict, i: int) -> float:
    """The lowest operand position of a custom_vjp call in the body of a
    jit, scan, cond or while loop (`params`) that its operand `i` reaches
    (-1: one its function closes over; inf: none)."""
    if "branches" in params:  # cond: operand 0 is the index
        return _NO_RULE if i == 0 else min(
            _reached(b.jaxpr, {b.jaxpr.invars[i - 1]}) for b in params["branches"])
    if "jaxpr" not in params:  # a while loop: any input of its bodies
        return min((_reached(j, set(j.invars)) for j in sub_jaxprs(params)), default=_NO_RULE)
    body = next(sub_jaxprs({"jaxpr": params["jaxpr"]}))  # (remat's is open)
    return _reached(body, {body.invars[i]})


# Calls whose body's inputs are the eqn's operands, one for one.
_CALLS = (_jax.jit_p, _jax.remat_p, _jax.custom_jvp_call_p, _jax.custom_vjp_call_p)


def _reached(jaxpr, tainted: set) -> float:
    tainted, low = set(tainted), _NO_RULE
    for e in jaxpr.eqns:
        hit = [not isinstance(v, _jax.Literal) and v in tainted for v in e.invars]
        if not any(hit):
            continue
        closure = _closure_operands(e)
        if closure is not None:
            first = hit.index(True)
            low = min(low, -1 if first < closure else first)
        for j in sub_jaxprs(e.params):
            one_for_one = e.primitive in _CALLS and len(j.invars) == len(hit)
            # (elsewhere an operand may reach any input of a body: a loop's carry)
            low = min(low, _reached(j, {v for v, h in zip(j.invars, hit) if h}
                                    if one_for_one else set(j.invars)))
        tainted.update(e.outvars)
    return low


def _closure_operands(eqn) -> int | None:
    """How many leading operands of a custom_vjp call are values its function
    closes over (None for another eqn): JAX's `custom_vjp_call`, or the
    object `jax_custom_vjp3` stages (and `generic_batching`)."""
    if eqn.primitive is _jax.custom_vjp_call_p:
        return _jax.closed_over_operands(eqn.params)
    prim = eqn.params.get("_prim") if eqn.primitive is _jax.call_hi_primitive_p else None
    if _jax.hi_prim_flag(prim) == "jax_custom_vjp3" and _jax.CUSTOM_HI_PRIMS:
        return _jax.custom_hi_prim_leading(prim)
    return None


# --- a clobber name sown before a while_loop, under jax.linearize ---------------
# JAX cannot split a while_loop, so the linear function holds the whole loop
# and its primal sites (docs/laws.md, law 1), but not a clobber site sown
# before the loop: that one is in the primal part. A loop that never runs
# keeps the earlier value (docs/semantics.md), so the linear function gets a
# copy of it just before the loop: a sow marked `earlier`, which a harvest
# takes as the loop's earlier value, not as a site (`Run.copy_of_earlier`).
# A jit, scan or cond whose body runs such a loop gets the copy before it too
# (its body's run reads it as the value its sites had before).

# jax.checkpoint's body is differentiated by jvp (then split), jax.linearize's
# directly: the traces of both remember sites.
_FORWARD = ("jvp", "linearize")
# trace -> {(tag, scopes, name, path): (params, primal values)}
_EARLIER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _site_key(params: dict) -> tuple:
    return params["tag"], params["scopes"], params["name"], params["path"]


def _sown_keys(params: dict, only_in_loops: bool = False) -> set:
    """The keys of the sites in the bodies among `params`, but a while
    loop's condition (whose sites are not reaped); with `only_in_loops`,
    only those inside a while loop's body."""
    keys: set = set()
    for name, v in params.items():
        for x in () if name == "cond_jaxpr" else v if isinstance(v, (tuple, list)) else (v,):
            j = getattr(x, "jaxpr", x)  # a ClosedJaxpr's jaxpr, or a Jaxpr
            for e in j.eqns if isinstance(j, _jax.Jaxpr) else ():
                if e.primitive is sow_p:
                    keys |= set() if only_in_loops else {_site_key(e.params)}
                else:
                    keys |= _sown_keys(e.params,
                                       only_in_loops and e.primitive is not _jax.while_p)
    return keys


def _make_remembering_bind(default):
    """sow's bind hook: planting's (`planting_bind`), and under jax.linearize
    it also remembers the primal value of a clobber site, for a while loop
    that follows (`_make_while_bind`)."""
    bind = _make_bind(default)

    def bind_with_trace(trace, args, avals, params):
        outs = bind(trace, args, avals, params)
        kind = _jax.differentiation_kind(trace)
        if kind is not None:
            _sown_elsewhere(trace, _site_key(params))
        if params["mode"] == "clobber" and kind in _FORWARD:
            _EARLIER.setdefault(trace, {})[_site_key(params)] = (
                params, [_jax.primal_of(trace, x) for x in outs])
        return outs
    return planting_bind(bind_with_trace)


def _sown_elsewhere(trace, key: tuple) -> None:
    """A site differentiated at `trace` makes the value remembered at an
    unrelated trace stale: it runs inside an eqn bound there (a checkpoint,
    a custom rule). The traces below or above `trace` see the site too."""
    below = _jax.traces_below(trace)
    for other, earlier in list(_EARLIER.items()):
        if key in earlier and other not in below and trace not in _jax.traces_below(other):
            del earlier[key]


def _forget(trace, params: dict) -> list:
    """Drops (and returns) the values remembered at `trace` for the sites of
    the bodies among `params`: from here on those bodies hold the last ones."""
    earlier = _EARLIER.get(trace)
    if not earlier:
        return []
    return [earlier.pop(k) for k in _sown_keys(params) if k in earlier]


def _make_while_bind(default):
    """while_loop's bind hook: under jax.linearize, a loop that goes to the
    linear function (an input has a tangent) is preceded there by a primal
    copy of each remembered site it sows, so that a harvest of the linear
    function starts the loop's site carry from the value sown before it."""
    def bind_with_trace(trace, args, avals, params):
        _copy_earlier(trace, args, _forget(trace, params))
        if _jax.differentiation_kind(trace) == "jvp":
            # (forward mode only: JAX cannot transpose a while loop, nor
            # split one, so reverse mode must keep skipping a constant one)
            args = _differentiated(trace, "jvp", args, avals, params)
        return default(trace, args, avals, params)
    return bind_with_trace


def _copy_earlier(trace, args, found: list) -> None:
    """Before an eqn that goes to the linear function of jax.linearize (an
    input has a tangent) and runs a while loop sowing the remembered sites
    `found`: a primal copy of each there (a jit, scan or cond holding the
    loop carries it in, as the value its sites had before)."""
    target = _jax.tangent_trace(trace) if found else None
    # (a jvp trace's parent may differentiate again: the copy would get
    # a tangent there; only a staging trace takes it as it is)
    if (found and _jax.differentiation_kind(target) is None
            and any(_jax.has_tangent(trace, x) for x in args)):
        with _jax.current_trace(target), \
                _jax.no_constant_folding(), _jax.keep_staged(_is_copy):
            for p, primals in found:
                sow_p.bind(*primals, **dict(p, path=p["path"] + (PRIMAL,), earlier=True))


def _is_copy(eqn) -> bool:
    return eqn.primitive is sow_p and eqn.params.get("earlier", False)


_jax.register_linearization(sow_p, _linearize)
_jax.register_dce_rule(sow_p, _dce)
_jax.register_partial_eval_rule(sow_p, _make_partial_eval)
_jax.register_remat_rule(sow_p, _checkpointed(_jax.remat_rule(sow_p)))
_jax.register_bind_hook(sow_p, _make_remembering_bind)
_jax.register_bind_hook(_jax.while_p, _make_while_bind)
# A while loop whose outputs nobody uses stays in the linear function of
# jax.linearize, which holds the whole loop anyway (docs/laws.md, law 1): its
# sites are the last ones. Not under jax.vjp, which cannot transpose it.
_jax.wrap_linearization(_jax.while_p, _holds_tangent_sites, forward_only=True)
_jax.wrap_dce_rule(_jax.while_p, _holds_tangent_sites, lambda eqn: False)
# A rematerialized linear part (jax.checkpoint's) whose outputs nobody uses
# keeps its tangent sites too (a checkpointed block in a jitted layer whose
# later call is dead code).
_jax.wrap_dce_rule(_jax.remat_p, _holds_tangent_sites, _holds_constant_sites)
# Its split may leave a constant site's zero in a linear part that reads no
# linear input (a body that reads no input with a tangent): it gets one.
_jax.register_partial_eval_rule(_jax.remat_p, lambda previous: (
    _jax.partial_eval_with_a_linear_input(previous, lambda j: _jaxpr_holds(j, _CONSTANT))))
# Its unknown half stays when it holds tangent sites, outputs used or not (a
# dead site in a checkpoint nested in another: the outer one's transpose
# splits the body again).
_jax.register_partial_eval_rule(_jax.remat_p, lambda previous: (
    _jax.partial_eval_keeping_staged(previous, lambda j: _jaxpr_holds(j, _DERIVATIVE))))


# A backward function whose output cotangents are all zero (the output does
# not depend on the differentiated inputs) still records its sites' zeros
# (while a harvest is traced: the hook is in force only then).
_jax.show_to_backward_pass(
    lambda jaxpr: bool(active_tags()) and _jaxpr_holds(jaxpr, _DERIVATIVE))


def _transposes_sites(params: dict) -> bool:
    """A body holding tangent sites, transposed while a harvest is traced."""
    return bool(active_tags()) and _bodies_hold_tangent_sites(params)


def _harvested(params: dict) -> dict:
    """A site's params as they are while its tag is harvested (an effect)."""
    return dict(params, effect=True) if params["tag"] in active_tags() else params


# A checkpoint whose outputs nobody uses keeps its tangent sites in the linear
# part, and its transpose runs them (its body's sites then carry their effect:
# the transpose evaluates the body again, partially).
_jax.wrap_linearization(_jax.remat_p, _holds_tangent_sites)
_jax.wrap_transpose(_jax.remat_p, _transposes_sites,
                    lambda jaxpr: _jax.map_params(jaxpr, sow_p, _harvested, sow_effect))

# Bodies of jit, scan and cond. (Not while_loop: JAX cannot differentiate one
# in reverse mode, nor split one for jax.linearize; nor jax.checkpoint, whose
# split has its own rule: `_checkpointed`.)
for _prim in (_jax.jit_p, _jax.scan_p, _jax.cond_p):
    _jax.wrap_linearization(_prim, _holds_tangent_sites)
    _jax.wrap_dce_rule(_prim, _holds_tangent_sites, _holds_constant_sites)
    _jax.wrap_transpose(_prim, _transposes_sites)
    _jax.register_bind_hook(_prim, _make_body_bind)
    _jax.register_partial_eval_rule(
        _prim, lambda previous: _jax.partial_eval_keeping(previous, _bodies_hold_tangent_sites))
_jax.register_bind_hook(_jax.remat_p, _make_body_bind)
