"""The rule for `cond`/`switch`: the taken branch's sites.

Every branch is re-traced with its sites as extra outputs, in one order, so
`cond` selects them like any output. The sites of a cond are the union over
its branches. A `"clobber"` site that some branch does not sow keeps the
value it had before the cond (zeros if none): that value enters the cond as
an operand and such a branch outputs it unchanged. `"append"` and `"strict"`
sites must be sown alike in every branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import (
    Body,
    carried,
    incoming,
    invar_avals,
    merge,
    per_site,
    split_list,
    trace_body,
)
from lazyharvest._interpreter.run import EVAL_RULES, Run, Site, bind, is_sown, runs_backward
from lazyharvest._interpreter.sites import Harvest, sowing_branches
from lazyharvest.errors import HarvestError


def branch_name(i: int, n: int) -> str:
    """How the user wrote branch `i` of `n`."""
    if n == 2:
        return f"branch {i} (the {'true' if i else 'false'}_fun of lax.cond)"
    return f"branch {i} of lax.switch"


def _shapes(s: Site) -> list:
    return [(a.shape, a.dtype) for a in s.avals]


def union_sites(h: Harvest, sites: list[list[Site]]) -> list[Site]:
    """The sites of a cond whose branches sow `sites[i]`, in first-seen order.

    `"clobber"` sites may be missing from some branches; every branch that
    sows one must agree on its structure, shapes and dtypes. `"append"` and
    `"strict"` sites must be sown alike in every branch.
    """
    n = len(sites)
    first: dict = {}  # key -> (branch, Site)
    for i, ss in enumerate(sites):
        for s in ss:
            j, ref = first.setdefault(s.key, (i, s))
            if j == i:
                continue
            if s.mode != ref.mode:
                raise HarvestError(
                    f"{h.where(s.key)}: sown with mode {ref.mode!r} in "
                    f"{branch_name(j, n)} and with mode {s.mode!r} in "
                    f"{branch_name(i, n)}. The branches of lax.cond/switch must "
                    f"sow the same names with the same modes: use one mode for "
                    f"every sow of a name.")
            if s.tree != ref.tree or _shapes(s) != _shapes(ref):
                raise HarvestError(
                    f"{h.where(s.key)}: {branch_name(j, n)} and "
                    f"{branch_name(i, n)} sow it with different structures, "
                    f"shapes or dtypes ({_shapes(ref)} vs {_shapes(s)}). The "
                    f"site holds the taken branch's value: the branches of "
                    f"lax.cond/switch must sow the same names with the same "
                    f"shapes and dtypes.")
    for key, (j, ref) in first.items():
        if ref.mode == "clobber":
            continue
        for i, ss in enumerate(sites):
            if all(s.key != key for s in ss):
                raise HarvestError(
                    f"{h.where(key)}: mode={ref.mode!r} is sown in "
                    f"{branch_name(j, n)} but not in {branch_name(i, n)}. The "
                    f"branches of lax.cond/switch must sow the same names with "
                    f"the same shapes and dtypes for mode='strict' and "
                    f"mode='append' sites; use mode='clobber' for a site only "
                    f"some branches sow (the others keep its earlier value).")
    return [ref for _, ref in first.values()]


def _branch(b: Body, i: int, const_sizes: list[int], order: list[Site],
            passed: list[Site], flagged: list[Site], pending: list,
            in_avals: list, shapes: dict) -> _jax.ClosedJaxpr:
    """Branch `i` taking every branch's consts, then the earlier values of
    `passed`; it outputs its own outputs, whether each plant in `pending` is
    still owed after it, its sites in `order` (an earlier value where it does
    not sow one), then per site in `flagged` where it sows it. Those flags
    have the `shapes` every branch gives them (a masked site's mask)."""
    def fn(*args):
        *chunks, through, ops = split_list(
            args, [*const_sizes, sum(len(s.avals) for s in passed)])
        outs, leaves = b.split_outs(_jax.eval_jaxpr(b.jaxpr, (), *chunks[i], *ops))
        outs, owed, where = carried(b, outs)
        outs = [*outs, *(jnp.broadcast_to(owed.get(k, np.bool_(False)), shapes.get(k, ()))
                         for k in pending)]
        per = dict(zip([s.key for s in passed], per_site(passed, through)))
        per.update(zip([s.key for s in b.sites], per_site(b.sites, leaves)))
        own = {s.key for s in b.sites}
        return [*outs, *[x for s in order for x in per[s.key]],
                *[jnp.broadcast_to(where.get(s.key, np.bool_(s.key in own)), shapes.get(s.key, ()))
                  for s in flagged]]
    jaxpr, consts = _jax.trace_flat(fn, in_avals)
    assert not consts
    return _jax.ClosedJaxpr(jaxpr, ())


def _cond(run: Run, eqn: _jax.JaxprEqn, invals: list, *, branches, **_) -> list:
    index, ops = invals[0], invals[1:]
    avals = invar_avals(branches[0].jaxpr)
    traced = [trace_body(run, b.jaxpr, b.consts, avals, carry_pending=True)
              for b in branches]
    bodies = [b for b, _ in traced]
    order = union_sites(run.harvest, [b.sites for b in bodies])
    passed = [s for s in order
              if any(all(t.key != s.key for t in b.sites) for b in bodies)]
    through = [x for s in passed for x in incoming(run, s)]
    # A clobber site evaluated backward (a cotangent) that some branch does not
    # sow: where the taken branch does not, the cotangent is an earlier
    # occurrence's (one evaluated after this cond), so the record says where.
    # (Or that a branch sows only where a cond or jit inside it does.)
    flagged = [s for s in order if s.mode == "clobber" and runs_backward(s.key)
               and not is_sown(s.key)
               and (s in passed or any(s.key in b.flagged for b in bodies))]
    all_consts = [c for b in bodies for c in b.consts]
    sizes = [len(b.consts) for b in bodies]
    in_avals = [jax.typeof(c) for c in [*all_consts, *through]] + avals
    # plants owed to the next occurrence evaluated, before or after the cond
    pending = list(dict.fromkeys(k for b in bodies for k in b.pending or ()))
    shapes = _flag_shapes(bodies)
    new_branches = tuple(_branch(b, i, sizes, order, passed, flagged, pending, in_avals,
                                 shapes) for i, b in enumerate(bodies))
    outs = bind(eqn, [index, *all_consts, *through, *ops],
                dict(eqn.params, branches=new_branches))
    n_own = bodies[0].n_own
    n_out = n_own + len(pending)
    run.pending = dict(zip(pending, outs[n_own:n_out]))
    _owe_plants(run, index, branches)
    for _body, branch_run in traced:
        run.begin_passes(branch_run.primal_sown)
    n_flags = len(flagged)
    leaves, sown = outs[n_out:len(outs) - n_flags], outs[len(outs) - n_flags:]
    merge(run, order, leaves, flags={s.key: f for s, f in zip(flagged, sown)})
    for _body, branch_run in traced:
        run.end_inner_passes(branch_run.primal_sown)
    # Append sites are sown alike in every branch; a planted clobber site
    # counts as often as the branch that sows it most (`count_occurrences`).
    for _body, branch_run in traced:
        for k, n in branch_run.cursor.items():
            run.cursor[k] = max(run.cursor.get(k, 0), n)
    return list(outs[:n_own])


def _flag_shapes(bodies: list[Body]) -> dict:
    """Per key, the shape of its still-owed or sown-here flag over every
    branch: a scalar, or where some branch holds a masked site, its mask's."""
    shapes: dict = {}
    for b in bodies:
        _own, owed, flags = carried(b, [v.aval for v in b.jaxpr.outvars[:b.n_out]])
        for k, a in [*owed.items(), *flags.items()]:
            shapes[k] = np.broadcast_shapes(shapes.get(k, ()), a.shape)
    return shapes


def _owe_plants(run: Run, index, branches) -> None:
    """A cotangent planted at a clobber site belongs to its last occurrence
    in program order, the first evaluated backward. Where that is in this
    cond but the taken branch does not sow the site, the occurrence before
    the cond takes it (`Run.pending`)."""
    for key, pl in run.plants.items():
        if not (pl.additive and pl.mode == "clobber" and runs_backward(key)
                and run.cursor.get(key, 0) == 0):
            continue
        sowing = sowing_branches(branches, run.harvest, key)
        if 0 < len(sowing) < len(branches):
            # (or where a masked site in the taken branch does not sow it)
            owed = ~jnp.isin(index, jnp.array(sowing, index.dtype))
            run.pending[key] = owed | run.pending[key] if key in run.pending else owed


EVAL_RULES[_jax.cond_p] = _cond
