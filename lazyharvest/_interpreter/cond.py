"""The rule for `cond`/`switch`: the taken branch's sites.

Every branch is re-traced with its sites as extra outputs, in one order, so
`cond` selects them like any output.
"""

from __future__ import annotations

import jax

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import (
    Body,
    finish,
    invar_avals,
    per_site,
    split_list,
    trace_body,
)
from lazyharvest._interpreter.run import EVAL_RULES, Run, bind
from lazyharvest._interpreter.sites import Harvest, describe
from lazyharvest.errors import HarvestError


def _check_same_sites(h: Harvest, bodies: list[Body]) -> None:
    sig = lambda b: {s.key: (s.mode, s.tree, s.avals) for s in b.sites}
    ref = sig(bodies[0])
    for i, b in enumerate(bodies[1:], 1):
        other = sig(b)
        if other == ref:
            continue
        names = sorted(set(ref) ^ set(other), key=str)
        diff = [describe(k) for k in names] or [
            describe(k) for k in ref if ref[k] != other.get(k)]
        raise HarvestError(
            f"harvest of tag {h.tag!r}: the branches of lax.cond/switch sow "
            f"different sites (branch 0 vs branch {i} differ in "
            f"{', '.join(diff)}: names, modes, shapes or dtypes). Sow the "
            f"same names with the same shapes and dtypes in every branch.")


def _branch(b: Body, i: int, const_sizes: list[int], order: list,
            in_avals: list) -> _jax.ClosedJaxpr:
    """Branch `i` taking every branch's consts, its sites output in `order`."""
    def fn(*args):
        chunks = split_list(args, const_sizes)
        outs, leaves = b.split_outs(_jax.eval_jaxpr(b.jaxpr, (), *chunks[i], *chunks[-1]))
        per = dict(zip([s.key for s in b.sites], per_site(b.sites, leaves)))
        return [*outs, *[x for k in order for x in per[k]]]
    jaxpr, consts = _jax.trace_flat(fn, in_avals)
    assert not consts
    return _jax.ClosedJaxpr(jaxpr, ())


def _cond(run: Run, eqn: _jax.JaxprEqn, invals: list, *, branches, **_) -> list:
    index, ops = invals[0], invals[1:]
    avals = invar_avals(branches[0].jaxpr)
    traced = [trace_body(run, b.jaxpr, b.consts, avals) for b in branches]
    bodies = [b for b, _ in traced]
    _check_same_sites(run.harvest, bodies)
    all_consts = [c for b in bodies for c in b.consts]
    sizes = [len(b.consts) for b in bodies]
    in_avals = [jax.typeof(c) for c in all_consts] + avals
    order = [s.key for s in bodies[0].sites]
    new_branches = tuple(_branch(b, i, sizes, order, in_avals)
                         for i, b in enumerate(bodies))
    outs = bind(eqn, [index, *all_consts, *ops], dict(eqn.params, branches=new_branches))
    return finish(run, bodies[0], outs, traced[0][1])


EVAL_RULES[_jax.cond_p] = _cond
