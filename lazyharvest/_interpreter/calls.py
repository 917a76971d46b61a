"""Rules for call-like primitives: `jit`, `closed_call`/`call`, `remat2`, and
the high-level primitives of JAX's opt-in `jax_*3` implementations.

`jit` keeps its boundary (a nested jit stays a jit call in the harvested
program, so compile caches keep working); calls without semantics of their
own are evaluated in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import finish, invar_avals, trace_body
from lazyharvest._interpreter.run import EVAL_RULES, Run, bind
from lazyharvest._interpreter.sites import (
    ANY_TAG,
    HIGH_LEVEL_BINDS,
    HIGH_LEVEL_RULES,
    jaxpr_has_sites,
    selected_site,
)


def _jit(run: Run, eqn: _jax.JaxprEqn, invals: list, *, jaxpr, in_shardings,
         in_layouts, donated_invars, out_shardings, out_layouts, **_) -> list:
    body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, invar_avals(jaxpr.jaxpr),
                             carry_pending=True)
    # (the body's extra outputs: flags carried out of it, then its site leaves)
    nc, ns = len(body.consts), len(body.jaxpr.outvars) - len(out_shardings)
    params = dict(
        eqn.params, jaxpr=_jax.ClosedJaxpr(body.jaxpr, ()),
        in_shardings=(_jax.UNSPECIFIED,) * nc + tuple(in_shardings),
        in_layouts=(None,) * nc + tuple(in_layouts),
        donated_invars=(False,) * nc + tuple(donated_invars),
        out_shardings=tuple(out_shardings) + (_jax.UNSPECIFIED,) * ns,
        out_layouts=tuple(out_layouts) + (None,) * ns)
    outs = bind(eqn, [*body.consts, *invals], params)
    return finish(run, body, outs, inner)


EVAL_RULES[_jax.jit_p] = _jit


def _call(run: Run, eqn: _jax.JaxprEqn, invals: list, *, call_jaxpr, **_) -> list:
    consts: Sequence[Any]
    if isinstance(call_jaxpr, _jax.ClosedJaxpr):
        jaxpr, consts = call_jaxpr.jaxpr, call_jaxpr.consts
    else:
        jaxpr, consts = call_jaxpr, ()
    # Calls carry no semantics a harvest must keep: evaluate the body in place.
    return run.eval(jaxpr, consts, invals)


EVAL_RULES[_jax.closed_call_p] = _call
EVAL_RULES[_jax.call_p] = _call


def _remat(run: Run, eqn: _jax.JaxprEqn, invals: list, *, jaxpr, **_) -> list:
    body, inner = trace_body(run, jaxpr, (), invar_avals(jaxpr), carry_pending=True)
    outs = bind(eqn, [*body.consts, *invals], dict(eqn.params, jaxpr=body.jaxpr))
    return finish(run, body, outs, inner)


EVAL_RULES[_jax.remat_p] = _remat


def _high_level(run: Run, eqn: _jax.JaxprEqn, invals: list, *, _prim, **_) -> list:
    """A high-level primitive holding sites the harvest takes. One a flag
    stages in place of an ordinary primitive (`Scan3`: `scan`; `RematTraced`:
    `remat2`) is harvested as that primitive, which the harvested program runs
    in its place (docs/semantics.md, section 10d); the custom functions' have
    rules of their own (`HIGH_LEVEL_RULES`); JAX's others (`CustomRoot`,
    `Nonzero`...) are harvested through their implementation where it can be
    traced. Any other is refused, naming the flag that made JAX stage it,
    rather than left unreaped. One holding only sites the filters leave out
    is bound as it is."""
    ordinary = _jax.as_ordinary_eqn(eqn)
    if ordinary is not None:
        if selected_site(eqn, run.harvest) is None:
            return bind(eqn, invals)
        new, order = ordinary
        return EVAL_RULES[new.primitive](run, new, [invals[i] for i in order], **new.params)
    rule = HIGH_LEVEL_RULES.get(type(_prim))
    if rule is not None:
        return rule(run, eqn, invals, _prim=_prim)
    flag = _jax.hi_prim_flag(_prim)
    if flag is None:  # (CustomRoot, Nonzero...: JAX stages them with every flag off)
        impl = _jax.implementation(eqn)
        if impl is not None:
            return run.through_implementation(eqn, invals, impl, keep_unstripped=True)
    what = (f"{type(_prim).__name__} (from {type(_prim).__module__})"
            + (f", which JAX stages with {flag} on," if flag else ""))
    return run.opaque(eqn, invals, what=what, flag=flag, yet=True)


def _make_ordinary_bind(default):
    """call_hi_primitive's bind hook: a high-level primitive that stands for
    an ordinary one (`_jax.stands_for`) and holds sites, bound under a
    transformation (JAX's differentiation, vmap; inside a harvest or not), is
    bound as that primitive, as a harvest binds it (`_high_level`): its sites
    then meet the transformation through that primitive's rules (dead and
    constant sites, derivative_sites.py), as with the flag off, and where JAX
    0.12 has no rule of its own (`Scan3`'s reverse mode and batching). The
    custom functions' objects have bind rules of their own (`HIGH_LEVEL_BINDS`)."""
    def bind_with_trace(trace, args, avals, params):
        own = HIGH_LEVEL_BINDS.get(type(params["_prim"]))
        if own is not None:
            return own(default, trace, args, avals, params)
        found = _jax.stands_for(params["_prim"]) if _jax.transforms(trace) else None
        if found is None or not any(jaxpr_has_sites(j, ANY_TAG)
                                    for j in _jax.sub_jaxprs(found[1])):
            return default(trace, args, avals, params)
        prim, ordinary, order = found
        with _jax.current_trace(trace):
            return prim.bind(*[args[i] for i in order], **ordinary)
    return bind_with_trace


if _jax.call_hi_primitive_p is not None:  # (jax >= 0.10)
    EVAL_RULES[_jax.call_hi_primitive_p] = _high_level
    # (from the first site on: a program that only imported lazyharvest
    # binds its custom functions' objects with no frame of ours)
    _jax.register_bind_hook(_jax.call_hi_primitive_p, _make_ordinary_bind, from_first_use=True)
