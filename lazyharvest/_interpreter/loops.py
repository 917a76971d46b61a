"""Rules for loops: `scan` stacks or carries its sites, `while` carries them.

In a `scan`, a `"clobber"` site becomes an extra carry (the value at the
highest index that sowed it), an `"append"` site an extra stacked output (one
row per sow, in iteration order). In a `while_loop` only `"clobber"` is
allowed: the number of iterations is unknown.

A clobber carry starts from the value the site had before the loop (zeros if
none), and each iteration's body starts from the carry (`trace_body(seeds=)`;
so the body is traced twice: once to find its sites, once with them seeded).
A loop that runs zero times, or an iteration that does not sow the site (a
cond branch, an inner loop that does not run), passes the value on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import (
    Body,
    PlantOperands,
    incoming,
    invar_avals,
    merge,
    merge_leading,
    per_site,
    split_list,
    trace_body,
    zeros,
)
from lazyharvest._interpreter.run import EVAL_RULES, Run, Site, bind, is_sown, sown_key
from lazyharvest._interpreter.sites import Counts, Harvest, count_occurrences
from lazyharvest.errors import HarvestError


def _scan_plants(run: Run, per_iter: Counts, length: int) -> tuple[PlantOperands, list]:
    """Plants a scan body needs, as per-iteration operands (scan `xs`).

    Append plants are sliced per iteration. So is a cotangent planted at a
    clobber site: it belongs to the value reaped, the one at the highest
    index, and is added there only.
    """
    keys = [k for k, pl in run.plants.items()
            if per_iter.get(k) and (pl.mode == "append" or pl.additive)]
    xs = []
    for k in keys:
        pl = run.plants[k]
        if pl.mode == "append":
            start, n = run.cursor.get(k, 0), per_iter[k] * length
            run.cursor[k] = start + n
            xs += [x[start:start + n].reshape(length, per_iter[k], *x.shape[1:])
                   for x in pl.leaves]
        else:
            xs += [jnp.zeros((length, *jnp.shape(x)), x.dtype).at[length - 1].set(x)
                   for x in pl.leaves]
    return PlantOperands.of(run, keys), xs


def _check_scan_modes(h: Harvest, body: Body) -> None:
    for s in body.sites:
        if s.mode == "strict":
            raise HarvestError(
                f"{h.where(s.key)}: mode='strict' inside lax.scan would sow the "
                f"name once per iteration. Use mode='append' to stack the "
                f"values over iterations or mode='clobber' to keep the last.")


def _scan_body(body: Body, clob: list[Site], app: list[Site], sizes: list[int],
               flags: dict | None, any_flag: bool):
    """`(consts', consts, carry, clobber carry, xs, plant xs)
    -> (carry, clobber carry, ys, appended)` around the re-traced body.

    The clobber carry seeds the body's run, so an iteration that does not sow
    a site passes its value on. In a reverse scan (`flags` given) the value
    kept is the one at the highest index that sowed, the first one seen: a
    site `k` with a flag `sown_key(k)` among `clob` keeps its value once the
    flag is set; one without (sown by code that keeps no flag) once
    `any_flag`, the last carry, says an iteration ran.
    """
    ncarry = sizes[2]
    n_clob = sum(len(s.avals) for s in clob)
    keys = [s.key for s in body.sites]
    reverse = flags is not None

    def new_body(*args):
        c0, c1, carry, old, xs, pxs, _rest = split_list(args, sizes)
        outs, leaves = body.split_outs(
            _jax.eval_jaxpr(body.jaxpr, (), *c0, *c1, *carry, *xs, *pxs, *old[:n_clob]))
        per = dict(zip(keys, per_site(body.sites, leaves)))
        if not reverse:
            new_clob = [x for s in clob for x in per[s.key]]
        else:
            was = dict(zip(keys, per_site(clob, old[:n_clob])))
            new_clob = []
            for s in clob:
                if is_sown(s.key):  # set once an iteration sows the site
                    new_clob += per[s.key]
                    continue
                flag = flags.get(s.key)
                seen = old[-1] if flag is None else was[flag][0]
                new_clob += [jnp.where(seen, o, n) for o, n in zip(was[s.key], per[s.key])]
            if any_flag:
                new_clob.append(jnp.ones((), bool))
        new_app = [x for s in app for x in per[s.key]]
        return [*outs[:ncarry], *new_clob, *outs[ncarry:], *new_app]
    return new_body


def _scan(run: Run, eqn: _jax.JaxprEqn, invals: list, *, jaxpr, length,
          num_consts, num_carry, reverse, **_) -> list:
    per_iter = count_occurrences(jaxpr.jaxpr, run.harvest)
    ops, plant_xs = _scan_plants(run, per_iter, length)
    body_avals = invar_avals(jaxpr.jaxpr)
    xs_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in plant_xs]
    # A reverse scan tracks which iterations sow each clobber site (`sown_key`).
    make_run = lambda extra: run.nested(ops.plants(run.plants, extra), {},
                                        track_sown=True if reverse else None)
    body, _inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, body_avals + xs_avals,
                              make_run, len(plant_xs))
    _check_scan_modes(run.harvest, body)
    clob = [s for s in body.sites if s.mode == "clobber"]
    if clob:  # again, with the clobber carry as the sites' earlier values
        body, _inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, body_avals + xs_avals,
                                  make_run, len(plant_xs), seeds=clob)
        assert [s.key for s in body.sites[:len(clob)]] == [s.key for s in clob]
        clob = body.sites[:len(clob)]
    app = [s for s in body.sites if s.mode == "append"]
    n_clob = sum(len(s.avals) for s in clob)
    flags, any_flag = None, False
    if reverse:
        keys = {s.key for s in clob}
        flags = {s.key: sown_key(s.key) for s in clob if sown_key(s.key) in keys}
        any_flag = any(s.key not in flags and not is_sown(s.key) for s in clob)
    clob_avals = [a for s in clob for a in s.avals]
    clob_avals += [jax.typeof(np.bool_(False))] * any_flag
    nb, n_xs = len(body.consts), len(body_avals) - num_consts - num_carry
    sizes = [nb, num_consts, num_carry, len(clob_avals), n_xs, len(plant_xs)]
    new_jaxpr, consts = _jax.trace_flat(
        _scan_body(body, clob, app, sizes, flags, any_flag),
        [jax.typeof(c) for c in body.consts] + body_avals[:num_consts + num_carry]
        + clob_avals + body_avals[num_consts + num_carry:] + xs_avals)
    assert not consts
    params = dict(eqn.params, jaxpr=_jax.ClosedJaxpr(new_jaxpr, ()),
                  num_consts=nb + num_consts, num_carry=num_carry + len(clob_avals))
    if "linear" in eqn.params:
        lin = tuple(eqn.params["linear"])
        params["linear"] = ((False,) * nb + lin[:num_consts + num_carry]
                            + (False,) * len(clob_avals) + lin[num_consts + num_carry:]
                            + (False,) * len(plant_xs))
    # The clobber carry starts from the sites' earlier values (a scan of
    # length 0 keeps them); a reverse scan's flags start unset.
    init = [x for s in clob for x in (
        zeros(s.avals) if reverse and is_sown(s.key) else incoming(run, s))]
    init += [np.bool_(False)] * any_flag
    consts_in, carry_in, xs_in = split_list(invals, [num_consts, num_carry])
    outs = bind(eqn, [*body.consts, *consts_in, *carry_in, *init,
                      *xs_in, *plant_xs], params)
    n_app = sum(len(s.avals) for s in app)
    carry_out, clob_out, ys, app_out = split_list(
        outs, [num_carry, len(clob_avals), len(outs) - num_carry - len(clob_avals) - n_app])
    for s, leaves in zip(clob, per_site(clob, clob_out[:n_clob])):
        if reverse and is_sown(s.key):
            if run.track_sown:  # sown here, or before the scan
                before = incoming(run, s)[0]
                run.record(s.key, s.mode, s.tree, [leaves[0] | before])
            continue
        run.record(s.key, s.mode, s.tree, leaves)
    for s, leaves in zip(app, per_site(app, app_out)):
        # (length, n per iteration, ...) -> (length * n, ...), by iteration index
        run.record(s.key, "append", s.tree, [merge_leading(x) for x in leaves])
    return [*carry_out, *ys]


EVAL_RULES[_jax.scan_p] = _scan


def _check_while_modes(h: Harvest, body: Body) -> None:
    for s in body.sites:
        if s.mode != "clobber":
            raise HarvestError(
                f"{h.where(s.key)}: mode={s.mode!r} inside lax.while_loop; the "
                f"number of iterations is unknown, so only mode='clobber' (keep "
                f"the last value) is allowed there.")


def _while(run: Run, eqn: _jax.JaxprEqn, invals: list, *, cond_jaxpr, body_jaxpr,
           cond_nconsts, body_nconsts, **_) -> list:
    cond_c, body_c, init = split_list(invals, [cond_nconsts, body_nconsts])
    body_avals = invar_avals(body_jaxpr.jaxpr)
    body, _inner = trace_body(run, body_jaxpr.jaxpr, body_jaxpr.consts, body_avals,
                              lambda extra: run.nested())
    _check_while_modes(run.harvest, body)
    sites = body.sites
    if sites:  # again, with the site carry as the sites' earlier values
        body, _inner = trace_body(run, body_jaxpr.jaxpr, body_jaxpr.consts, body_avals,
                                  lambda extra: run.nested(), seeds=sites)
        assert [s.key for s in body.sites] == [s.key for s in sites]
    # Sites in the loop condition are not reaped: the condition returns only a
    # predicate. They are consumed (identity) like filtered sites.
    cond, _inner = trace_body(run.nested(), cond_jaxpr.jaxpr, cond_jaxpr.consts,
                         invar_avals(cond_jaxpr.jaxpr))
    site_avals = [a for s in body.sites for a in s.avals]
    nb, ncc, ncarry = len(body.consts), len(cond.consts), len(init)
    carry_avals = body_avals[body_nconsts:] + site_avals

    def new_cond(*args):
        c, carry, _rest = split_list(args, [ncc + cond_nconsts, ncarry])
        return _jax.eval_jaxpr(cond.jaxpr, (), *c, *carry)[:1]

    def new_body(*args):
        # The body's last inputs are its sites' values from the last iteration.
        return _jax.eval_jaxpr(body.jaxpr, (), *args)

    cjaxpr, k1 = _jax.trace_flat(
        new_cond, [jax.typeof(c) for c in cond.consts]
        + invar_avals(cond_jaxpr.jaxpr)[:cond_nconsts] + carry_avals)
    bjaxpr, k2 = _jax.trace_flat(
        new_body, [jax.typeof(c) for c in body.consts]
        + body_avals[:body_nconsts] + carry_avals)
    assert not k1 and not k2
    params = dict(eqn.params, cond_jaxpr=_jax.ClosedJaxpr(cjaxpr, ()),
                  body_jaxpr=_jax.ClosedJaxpr(bjaxpr, ()),
                  cond_nconsts=ncc + cond_nconsts, body_nconsts=nb + body_nconsts)
    # The site carry starts from the sites' earlier values: a loop whose body
    # never runs keeps them, and so does a nested loop.
    earlier = [x for s in body.sites for x in incoming(run, s)]
    outs = bind(eqn, [*cond.consts, *cond_c, *body.consts, *body_c, *init,
                      *earlier], params)
    merge(run, body.sites, outs[ncarry:])
    return outs[:ncarry]


EVAL_RULES[_jax.while_p] = _while
