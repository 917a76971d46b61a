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

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lazyharvest import _jax
from lazyharvest._interpreter.plumbing import (
    Body,
    incoming,
    invar_avals,
    lookup,
    merge,
    merge_leading,
    per_site,
    split_list,
    trace_body,
    zeros,
)
from lazyharvest._interpreter.run import (
    EVAL_RULES,
    Plant,
    Record,
    Run,
    ScanReplay,
    Site,
    align,
    bind,
    is_sown,
    runs_backward,
    select,
    sown_key,
)
from lazyharvest._interpreter.sites import (
    Counts,
    Harvest,
    count_occurrences,
    has_masked_sites,
    may_owe,
    raw_key,
    sub_jaxprs,
)
from lazyharvest.errors import HarvestError
from lazyharvest.keys import PRIMAL
from lazyharvest.primitive import sow_p


@attrs.define
class _ScanPlants:
    """Plants a scan body needs, as per-iteration operands (scan `xs`).

    An append plant is sliced: the rows of the scan's occurrences, in program
    order, one block per iteration. A cotangent planted at a clobber site
    belongs to the occurrence whose value is reaped, the last in program
    order: the scan that has it gets it at its highest index only, the others
    none. Where the first occurrence the body evaluates may not sow the site
    (`may_owe`), the plant is `owed` instead: the whole plant is an operand
    of every iteration, with a bool saying whether the iteration still owes
    it. A `reverse=True` scan carries it (true until an iteration took the
    plant); a forward one, which reaches the highest index last, gets it per
    iteration from a scan that first finds where the site is sown
    (`_highest_sowing`). The next occurrence after the scan takes what no
    iteration took (`Run.pending`). Copies that
    `jax.checkpoint` rematerializes in this scan get the operands their
    originals had in theirs (`ScanReplay`).
    """

    run: Run
    length: int
    keys: list = attrs.field(factory=list)  # sliced plants, operand order
    slices: dict = attrs.field(factory=dict)  # key -> (start, n, per iteration)
    dropped: set = attrs.field(factory=set)  # keys the body does not plant
    pairs: list = attrs.field(factory=list)  # (token, key) of sliced replays
    replays: dict = attrs.field(factory=dict)  # (token, key) -> body's replays
    xs: list = attrs.field(factory=list)
    owed: list = attrs.field(factory=list)  # keys of owed plants
    owed_init: list = attrs.field(factory=list)  # whether the scan owes each
    # the avals of those flags: scalars, or a masked site's mask
    owed_avals: list = attrs.field(factory=list)

    @classmethod
    def of(cls, run: Run, jaxpr: _jax.Jaxpr, per_iter: Counts, length: int) -> _ScanPlants:
        self = cls(run, length)
        for k, n_it in per_iter.items():  # (before this scan's cotangents)
            run.count_primal(k, n_it * length)
        for k, pl in run.plants.items():
            n_it = per_iter.get(k)
            if not n_it or not (pl.mode == "append" or pl.additive):
                continue
            done, n = run.cursor.get(k, 0), n_it * length
            total = pl.total()
            start = run.backward_end(k, pl, done) - n if runs_backward(k) else done
            run.cursor[k] = done + n
            # owed: a cond before the scan was to take the plant but may not
            # sow (`Run.pending`), or the scan takes it and may not sow
            owes = n > 0 and pl.mode == "clobber" and runs_backward(k) and (
                k in run.pending or start + n == total and may_owe(jaxpr, run.harvest, k))
            if pl.mode != "append" and not owes and (
                    n == 0 or not start <= pl.last() < start + n):
                # (a scan of length 0 has no occurrence to add a cotangent at)
                self.dropped.add(k)
                continue
            self.slices[k] = (start, n, n_it)
            if owes:
                self.owed.append(k)
                self.owed_init.append(run.pending.pop(k, np.bool_(True)))
                self.owed_avals.append(jax.typeof(self.owed_init[-1]))
                continue
            self.keys.append(k)
            self.xs += self._slice(pl, start, n, n_it)
        for pair in _copies(jaxpr, run) if run.replays else ():
            stack = run.replays.get(pair)
            if not stack or not isinstance(stack[-1], ScanReplay) or stack[-1].length != length:
                continue
            entry = stack.pop()
            self.replays[pair] = list(entry.entries)
            if entry.start is not None:
                self.pairs.append((pair, entry.per_iter))
                self.xs += self._slice(_plant_of(run, pair), entry.start, entry.n,
                                       entry.per_iter)
        return self

    def _slice(self, pl: Plant, start: int, n: int, n_it: int) -> list:
        if pl.mode == "append":
            rows = slice(start, start + n) if pl.order is None else np.asarray(
                pl.order[start:start + n])
            return [x[rows].reshape(self.length, n_it, *x.shape[1:]) for x in pl.leaves]
        at = self.length - 1 if pl.order is None else (pl.last() - start) // n_it
        return [jnp.zeros((self.length, *jnp.shape(x)), x.dtype).at[at].set(x)
                for x in pl.leaves]

    def owed_leaves(self) -> list:
        """The owed plants' leaves: operands of every iteration (scan consts)."""
        return [x for k in self.owed for x in self.run.plants[k].leaves]

    def extra_avals(self) -> list:
        """The body's extra inputs: the plants' slices of one iteration, then
        whether each owed plant is still owed, then the owed plants."""
        return ([jax.typeof(x).update(shape=x.shape[1:]) for x in self.xs]
                + list(self.owed_avals)
                + [jax.typeof(x) for x in self.owed_leaves()])

    def body_run(self, extra: list, track_sown: bool | None = None,
                 finding: bool = False) -> Run:
        """The run of one iteration; `finding`: one that only finds where the
        owed plants' sites are sown (`_highest_sowing`), without them."""
        run = self.run
        plants = {k: p for k, p in run.plants.items()
                  if k not in self.dropped and not (finding and k in self.owed)}
        replay_plants = dict(run.replay_plants)
        sizes = [len(run.plants[k].leaves) for k in self.keys]
        sizes += [len(_plant_of(run, pair).leaves) for pair, _ in self.pairs]
        if not finding:
            sizes += [len(self.owed)] + [len(run.plants[k].leaves) for k in self.owed]
        chunks = split_list(extra, sizes)
        for k, leaves in zip(self.keys, chunks):
            start, _, n_it = self.slices[k]
            plants[k] = attrs.evolve(run.plants[k], leaves=leaves, count=n_it,
                                     order=run.plants[k].within(start, n_it * self.length, n_it))
        n = len(self.keys) + len(self.pairs)
        for (pair, n_it), leaves in zip(self.pairs, chunks[len(self.keys):n]):
            replay_plants[pair] = attrs.evolve(_plant_of(run, pair), leaves=leaves,
                                               count=n_it, order=None)
        if finding:  # a side computation: it sows nothing
            inner = run.nested(plants, {}, lambda k: k in self.owed, pass_through=False,
                               track_sown=True, replay_plants=replay_plants)
            inner.keep_other_tags, inner.side_pass = False, True
            return inner
        owed = dict(zip(self.owed, chunks[n]))
        for k, leaves in zip(self.owed, chunks[n + 1:]):
            plants[k] = attrs.evolve(run.plants[k], count=self.slices[k][2], leaves=[
                jnp.where(align(owed[k], x), x, jnp.zeros_like(x)) for x in leaves])
        inner = run.nested(plants, {}, track_sown=track_sown,
                           replays={p: list(e) for p, e in self.replays.items()},
                           replay_plants=replay_plants)
        inner.owed = owed
        return inner

    def done(self, inner: Run) -> None:
        """Hands the body's replays (per iteration) to the copies of a later scan."""
        for pair, entries in inner.replays.items():
            if entries:
                start, n, n_it = self.slices.get(pair[1], (None, 0, 0))
                self.run.replays.setdefault(pair, []).append(
                    ScanReplay(start, n, n_it, self.length, tuple(entries)))


def _plant_of(run: Run, pair: tuple) -> Plant:
    return run.replay_plants.get(pair) or run.plants[pair[1]]


def _copies(jaxpr: _jax.Jaxpr, run: Run) -> list:
    """(token, key) of the planted rematerialized copies anywhere in `jaxpr`."""
    found: list = []
    for e in jaxpr.eqns:
        p = e.params
        if e.primitive is sow_p:
            if p["recompute"] and run.harvest.owns(p):
                pair = (p["recompute"], raw_key(p))
                if pair not in found and (pair in run.replay_plants or pair[1] in run.plants):
                    found.append(pair)
            continue
        for j in sub_jaxprs(p):
            found += [x for x in _copies(j, run) if x not in found]
    return found


def _check_scan_modes(h: Harvest, body: Body) -> None:
    for s in body.sites:
        if s.mode == "strict":
            raise HarvestError(
                f"{h.where(s.key)}: mode='strict' inside lax.scan would sow the "
                f"name once per iteration. Use mode='append' to stack the "
                f"values over iterations or mode='clobber' to keep the last.")


def _scan_body(body: Body, clob: list[Site], app: list[Site], sizes: list[int],
               flags: dict | None, any_flag: bool, n_owed: int):
    """`(consts', consts, owed plants, carry, clobber carry, xs, plant xs,
    owed xs) -> (carry, clobber carry, ys, appended)` around the re-traced body.

    The clobber carry seeds the body's run, so an iteration that does not sow
    a site passes its value on. In a reverse scan (`flags` given) the value
    kept is the one at the highest index that sowed, the first one seen: a
    site `k` with a flag `sown_key(k)` among `clob` keeps its value once the
    flag is set; one without (sown by code that keeps no flag) once
    `any_flag`, the last carry, says an iteration ran. Whether the iteration
    owes each of `n_owed` owed plants is, in a reverse scan, the clobber
    carry before that flag; in a forward scan, the owed xs.
    """
    ncarry = sizes[3]
    n_clob = sum(len(s.avals) for s in clob)
    keys = [s.key for s in body.sites]
    reverse = flags is not None

    def new_body(*args):
        c0, c1, owed_pl, carry, old, xs, pxs, owed, _rest = split_list(args, sizes)
        if reverse:
            owed = old[n_clob:n_clob + n_owed]
        outs, leaves = body.split_outs(_jax.eval_jaxpr(
            body.jaxpr, (), *c0, *c1, *carry, *xs, *pxs, *owed, *owed_pl, *old[:n_clob]))
        outs, owed = outs[:len(outs) - n_owed], outs[len(outs) - n_owed:]
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
                new_clob += select(seen, was[s.key], per[s.key])
        new_clob += (owed if reverse else []) + [jnp.ones((), bool)] * any_flag
        new_app = [x for s in app for x in per[s.key]]
        return [*outs[:ncarry], *new_clob, *outs[ncarry:], *new_app]
    return new_body


def _trace_scan_body(run: Run, jaxpr: _jax.ClosedJaxpr, plan: _ScanPlants,
                     reverse: bool) -> tuple[Body, list[Site], Run]:
    """The re-traced body, and its clobber sites (seeded by the carry)."""
    in_avals = invar_avals(jaxpr.jaxpr) + plan.extra_avals()
    n_extra = len(in_avals) - len(jaxpr.jaxpr.invars)
    # A reverse scan tracks which iterations sow each clobber site (`sown_key`),
    # and so does one holding masked sites: which elements each iteration sows.
    track = reverse or has_masked_sites(jaxpr.jaxpr, run.harvest.tag)
    make_run = lambda extra: plan.body_run(extra, track_sown=True if track else None)
    body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, in_avals, make_run, n_extra)
    _check_scan_modes(run.harvest, body)
    clob = [s for s in body.sites if s.mode == "clobber"]
    if reverse and plan.owed:
        # an owed plant's flag is carried: as a masked site's mask, if one is
        # met (`Run.apply_plant`)
        n = len(plan.owed)
        owed_avals = [v.aval for v in body.jaxpr.outvars[body.n_out - n:body.n_out]]
        if owed_avals != plan.owed_avals:
            plan.owed_avals = owed_avals
            in_avals = invar_avals(jaxpr.jaxpr) + plan.extra_avals()
            body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, in_avals, make_run,
                                     n_extra)
            clob = [s for s in body.sites if s.mode == "clobber"]
    if clob:  # again, with the clobber carry as the sites' earlier values
        body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, in_avals,
                                 make_run, n_extra, seeds=clob)
        assert [s.key for s in body.sites[:len(clob)]] == [s.key for s in clob]
        clob = body.sites[:len(clob)]
    return body, clob, inner


def _scan(run: Run, eqn: _jax.JaxprEqn, invals: list, *, jaxpr, length,
          reverse, **params) -> list:
    num_consts, num_carry = _jax.scan_counts(params)
    per_iter = count_occurrences(jaxpr.jaxpr, run.harvest)
    plan = _ScanPlants.of(run, jaxpr.jaxpr, per_iter, length)
    owed_xs: list = []
    none: list = []
    if plan.owed and not reverse:
        owed_xs, none = _highest_sowing(run, eqn, jaxpr, plan, invals)
        plan.owed_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in owed_xs]
    body, clob, inner = _trace_scan_body(run, jaxpr, plan, reverse)
    plan.done(inner)
    app = [s for s in body.sites if s.mode == "append"]
    n_clob, n_owed = sum(len(s.avals) for s in clob), len(plan.owed) if reverse else 0
    flags, any_flag = None, False
    if reverse:
        keys = {s.key for s in clob}
        flags = {s.key: sown_key(s.key) for s in clob if sown_key(s.key) in keys}
        any_flag = any(s.key not in flags and not is_sown(s.key) for s in clob)
    clob_avals = [a for s in clob for a in s.avals]
    clob_avals += (plan.owed_avals if reverse else []) + [jax.typeof(np.bool_(False))] * any_flag
    owed_pl = plan.owed_leaves()
    body_avals = invar_avals(jaxpr.jaxpr)
    nb, n_xs = len(body.consts), len(body_avals) - num_consts - num_carry
    sizes = [nb, num_consts, len(owed_pl), num_carry, len(clob_avals), n_xs,
             len(plan.xs), len(owed_xs)]
    new_jaxpr, consts = _jax.trace_flat(
        _scan_body(body, clob, app, sizes, flags, any_flag, len(plan.owed)),
        [jax.typeof(c) for c in body.consts] + body_avals[:num_consts]
        + [jax.typeof(x) for x in owed_pl] + body_avals[num_consts:num_consts + num_carry]
        + clob_avals + body_avals[num_consts + num_carry:]
        + [jax.typeof(x).update(shape=x.shape[1:]) for x in [*plan.xs, *owed_xs]])
    assert not consts
    # The clobber carry starts from the sites' earlier values (a scan of
    # length 0 keeps them); a reverse scan's flags start unset, and whether
    # it owes each owed plant is `owed_init`.
    init = [x for s in clob for x in (
        zeros(s.avals) if reverse and is_sown(s.key) else incoming(run, s))]
    init += [jnp.broadcast_to(x, a.shape) for x, a in zip(plan.owed_init, plan.owed_avals)
             if reverse] + [np.bool_(False)] * any_flag
    consts_in, carry_in, xs_in = split_list(invals, [num_consts, num_carry])
    outs = bind(eqn, [*body.consts, *consts_in, *owed_pl, *carry_in, *init,
                      *xs_in, *plan.xs, *owed_xs], _scan_params(eqn.params, new_jaxpr, sizes))
    n_app = sum(len(s.avals) for s in app)
    carry_out, clob_out, ys, app_out = split_list(
        outs, [num_carry, len(clob_avals), len(outs) - num_carry - len(clob_avals) - n_app])
    # what no iteration took goes to the next occurrence evaluated
    run.pending.update(zip(plan.owed, clob_out[n_clob:n_clob + n_owed] if reverse else none))
    if length:
        run.begin_passes(inner.primal_sown)
    else:  # no iteration sows: the clobber sites keep their earlier values
        _placeholders(run, clob)
        clob, n_clob = [], 0
    _record_scan_sites(run, clob, app, clob_out[:n_clob], app_out)
    if length:
        run.end_inner_passes(inner.primal_sown)
    return [*carry_out, *ys]


def _highest_sowing(run: Run, eqn: _jax.JaxprEqn, jaxpr: _jax.ClosedJaxpr,
                    plan: _ScanPlants, invals: list) -> tuple[list, list]:
    """For a forward scan, per owed plant: whether each iteration is the
    highest that sows its site (it owes the plant), and whether none does.
    The scan runs first without the owed plants, and keeps only whether
    each iteration sowed (`sown_key`)."""
    xs_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in plan.xs]
    body, _inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts,
                              invar_avals(jaxpr.jaxpr) + xs_avals,
                              lambda extra: plan.body_run(extra, finding=True), len(plan.xs))
    num_consts, num_carry = _jax.scan_counts(eqn.params)
    never = [np.bool_(False)]

    def sows(*args):
        outs, leaves = body.split_outs(_jax.eval_jaxpr(body.jaxpr, (), *args))
        per = dict(zip([s.key for s in body.sites], per_site(body.sites, leaves)))
        return [*outs[:num_carry], *[per.get(sown_key(k), never)[0] for k in plan.owed]]
    new_jaxpr, consts = _jax.trace_flat(
        sows, [jax.typeof(c) for c in body.consts] + invar_avals(jaxpr.jaxpr) + xs_avals)
    assert not consts
    nb = len(body.consts)
    params = _scan_params(eqn.params, new_jaxpr,
                          [nb, num_consts, 0, num_carry, 0,
                           len(jaxpr.jaxpr.invars) - num_consts - num_carry, len(plan.xs), 0])
    outs = bind(eqn, [*body.consts, *map(_copy_if_ref, invals), *plan.xs], params)
    owed, none = [], []
    for f, init in zip(outs[num_carry:], plan.owed_init):
        later = lax.cummax(f[::-1].astype(np.int32))[::-1]  # some iteration >= i sows
        later = jnp.concatenate([later[1:], jnp.zeros_like(later[:1])]) > 0
        owed.append(f & ~later & init)
        none.append(~jnp.any(f, axis=0) & init)
    return owed, none


def _copy_if_ref(x: Any) -> Any:
    """A Ref's copy (a fresh Ref holding its value), anything else as it is:
    the pass that only finds where sites are sown must not write the
    program's Refs a second time (under jax_scan3, a scan's carry is one)."""
    ref = getattr(jax, "ref", None)  # (jax >= 0.9)
    if ref is not None and isinstance(jax.typeof(x), ref.AbstractRef):
        return jax.new_ref(x[...])
    return x


def _scan_params(p: dict, new_jaxpr: _jax.Jaxpr, sizes: list[int]) -> dict:
    """The scan's params with the consts, carries and xs of `_scan_body` added."""
    nb, nc, n_owed, ncarry, n_clob, _n_xs, n_pxs, n_oxs = sizes
    return _jax.scan_params(
        p, _jax.ClosedJaxpr(new_jaxpr, ()), nb + nc + n_owed, ncarry + n_clob,
        linear=lambda lin: ((False,) * nb + lin[:nc] + (False,) * n_owed
                            + lin[nc:nc + ncarry] + (False,) * n_clob
                            + lin[nc + ncarry:] + (False,) * (n_pxs + n_oxs)))


def _placeholders(run: Run, clob: list[Site]) -> None:
    """After a scan of length 0, the clobber sites that had no earlier value get
    zeros that the next occurrence replaces (also where a record evaluated
    backward keeps its first contribution); the others stay as they were. A
    run tracking where sites are sown (an outer scan's body) learns that
    this one sowed none, so that an earlier occurrence takes its cotangent."""
    for s in clob:
        if lookup(run, s.key) is not None:
            continue
        if not is_sown(s.key):
            run.records[s.key] = Record(s.mode, s.tree, [zeros(s.avals)], seeded=True)
        elif run.track_sown:
            run.records[s.key] = Record(s.mode, s.tree, [zeros(s.avals)])


def _record_scan_sites(run: Run, clob: list[Site], app: list[Site], clob_out: list,
                       app_out: list) -> None:
    per = dict(zip([s.key for s in clob], per_site(clob, clob_out)))
    for s in clob:
        leaves = per[s.key]
        if is_sown(s.key):
            if run.track_sown:  # sown here, or before the scan
                before = incoming(run, s)[0]
                run.record(s.key, s.mode, s.tree, [leaves[0] | before])
            continue
        # a cotangent the scan may not sow: an earlier occurrence's fills in
        flag = per.get(sown_key(s.key)) if runs_backward(s.key) else None
        run.record(s.key, s.mode, s.tree, leaves, None if flag is None else flag[0])
    for s, leaves in zip(app, per_site(app, app_out)):
        # (length, n per iteration, ...) -> (length * n, ...), by iteration index
        run.record(s.key, "append", s.tree, [merge_leading(x) for x in leaves])


EVAL_RULES[_jax.scan_p] = _scan


def _check_while_modes(h: Harvest, body: Body) -> None:
    for s in body.sites:
        if s.mode != "clobber":
            raise HarvestError(
                f"{h.where(s.key)}: mode={s.mode!r} inside lax.while_loop; the "
                f"number of iterations is unknown, so only mode='clobber' (keep "
                f"the last value) is allowed there.")


def _forwarded(body: Body, n_carry: int) -> dict[int, int]:
    """Site leaves (by index) that the body returns unchanged as carry `j`
    and whose earlier value it never reads: the loop's own carry holds them,
    so they need no carry of their own."""
    jaxpr = body.jaxpr
    n = body.n_site_leaves
    seeds = jaxpr.invars[len(jaxpr.invars) - n:]
    read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, _jax.Var)}
    own, leaves = jaxpr.outvars[:n_carry], jaxpr.outvars[n_carry:]
    read |= {v for v in own if isinstance(v, _jax.Var)}
    out: dict[int, int] = {}
    for m, (v, seed_var) in enumerate(zip(leaves, seeds)):
        if isinstance(v, _jax.Var) and seed_var not in read and v in own:
            out[m] = own.index(v)
    return out


def _while(run: Run, eqn: _jax.JaxprEqn, invals: list, *, cond_jaxpr, body_jaxpr,
           cond_nconsts, body_nconsts, **_) -> list:
    cond_c, body_c, init = split_list(invals, [cond_nconsts, body_nconsts])
    body_avals = invar_avals(body_jaxpr.jaxpr)
    make_run = lambda extra: run.nested()
    body, inner = trace_body(run, body_jaxpr.jaxpr, body_jaxpr.consts, body_avals, make_run)
    _check_while_modes(run.harvest, body)
    if _keeps_first(run, body, inner):  # again, learning where each iteration sows
        make_run = lambda extra: run.nested(track_sown=True)
        body, inner = trace_body(run, body_jaxpr.jaxpr, body_jaxpr.consts, body_avals,
                                 make_run)
    sites = body.sites
    if sites:  # again, with the site carry as the sites' earlier values
        body, inner = trace_body(run, body_jaxpr.jaxpr, body_jaxpr.consts, body_avals,
                                 make_run, seeds=sites)
        assert [s.key for s in body.sites] == [s.key for s in sites]
    # Sites in the loop condition are not reaped: the condition returns only a
    # predicate. They are consumed (identity) like filtered sites.
    cond, _inner = trace_body(run.nested(), cond_jaxpr.jaxpr, cond_jaxpr.consts,
                         invar_avals(cond_jaxpr.jaxpr))
    ncarry = len(init)
    first = _keeps_first(run, body, inner)
    fwd = {m: j for m, j in _forwarded(body, ncarry).items() if m not in first}
    site_avals = [a for s in body.sites for a in s.avals]
    kept = [m for m in range(len(site_avals)) if m not in fwd]
    # The site carry starts from the sites' earlier values: a loop whose body
    # never runs keeps them, and so does a nested loop.
    earlier = [x for s in body.sites for x in incoming(run, s)]
    params = _while_params(eqn.params, body, cond, cond_jaxpr, body_avals, site_avals,
                           kept, cond_nconsts, body_nconsts, ncarry,
                           {m: first[m][1] for m in sorted(first)})
    outs = bind(eqn, [*cond.consts, *cond_c, *body.consts, *body_c, *init,
                      *[earlier[m] for m in kept], *[first[m][0] for m in sorted(first)]],
                params)
    leaves = dict(zip(kept, outs[ncarry:]))
    if fwd:  # a forwarded site is the carry's last value if the body ran at all
        ran = _jax.eval_jaxpr(cond.jaxpr, (), *cond.consts, *cond_c, *init)[0]
        leaves.update({m: jnp.where(ran, outs[j], earlier[m]) for m, j in fwd.items()})
    # (each iteration's primal occurrences began passes of their own)
    run.begin_passes(inner.primal_sown)
    merged = [(s, ls) for s, ls in zip(body.sites, per_site(
        body.sites, [leaves[m] for m in range(len(site_avals))]))
        if run.track_sown or not is_sown(s.key)]
    merge(run, [s for s, _ in merged], [x for _, ls in merged for x in ls], replace=True)
    run.end_inner_passes(inner.primal_sown)
    return outs[:ncarry]


def _keeps_first(run: Run, body: Body, inner: Run) -> dict[int, Any]:
    """The site leaves (by index) of cotangents the loop evaluates as one
    backward pass over several occurrences (a custom_vjp backward rule
    walking back through the steps its forward pass took): sites evaluated
    backward whose primal the body does not sow (its recomputation is no
    occurrence). Each keeps its first contribution, the last occurrence's,
    as a straight-line backward pass does; the value is whether one was
    made before the loop, in the same pass, and the index of the leaf that
    says whether an iteration sowed it (a body traced with `track_sown`;
    None otherwise, then each iteration is taken to)."""
    out: dict[int, Any] = {}
    start, m = {}, 0
    for s in body.sites:
        start[s.key] = m
        m += len(s.avals)
    for s in body.sites:
        path, scopes, name = s.key
        primal = (path[:-1] + (PRIMAL,), scopes, name)
        if runs_backward(s.key) and not is_sown(s.key) and primal not in inner.primal_sown:
            r = lookup(run, s.key)
            for i in range(len(s.avals)):
                out[start[s.key] + i] = (np.bool_(r is not None and not r.seeded),
                                         start.get(sown_key(s.key)))
    return out


def _while_params(p: dict, body: Body, cond: Body, cond_jaxpr, body_avals: list,
                  site_avals: list, kept: list, cond_nconsts: int, body_nconsts: int,
                  ncarry: int, first: dict) -> dict:
    """The harvested loop's params: the carry grows by the kept site leaves,
    and by a flag per leaf in `first` (it keeps its first contribution)."""
    nb, ncc = len(body.consts), len(cond.consts)
    flag = jax.typeof(np.bool_(False))
    carry_avals = body_avals[body_nconsts:] + [site_avals[m] for m in kept] + [flag] * len(first)
    n_in = len(body.jaxpr.invars) - len(site_avals)

    def new_cond(*args):
        c, carry, _rest = split_list(args, [ncc + cond_nconsts, ncarry])
        return _jax.eval_jaxpr(cond.jaxpr, (), *c, *carry)[:1]

    def new_body(*args):
        # The body's last inputs are its kept sites' values from the last
        # iteration (a forwarded site's is never read), then the flags.
        seeds = dict(zip(kept, args[n_in:n_in + len(kept)]))
        taken = dict(zip(first, args[n_in + len(kept):]))
        full = [seeds[m] if m in seeds else jnp.zeros(a.shape, a.dtype)
                for m, a in enumerate(site_avals)]
        outs = _jax.eval_jaxpr(body.jaxpr, (), *args[:n_in], *full)
        new = [jnp.where(taken[m], seeds[m], outs[ncarry + m]) if m in taken
               else outs[ncarry + m] for m in kept]
        sown = [np.bool_(True) if i is None else jnp.any(outs[ncarry + i])
                for i in (first[m] for m in first)]
        return outs[:ncarry] + new + [t | f for t, f in zip(taken.values(), sown)]

    cjaxpr, k1 = _jax.trace_flat(
        new_cond, [jax.typeof(c) for c in cond.consts]
        + invar_avals(cond_jaxpr.jaxpr)[:cond_nconsts] + carry_avals)
    bjaxpr, k2 = _jax.trace_flat(
        new_body, [jax.typeof(c) for c in body.consts]
        + body_avals[:body_nconsts] + carry_avals)
    assert not k1 and not k2
    return dict(p, cond_jaxpr=_jax.ClosedJaxpr(cjaxpr, ()),
                body_jaxpr=_jax.ClosedJaxpr(bjaxpr, ()),
                cond_nconsts=ncc + cond_nconsts, body_nconsts=nb + body_nconsts)


EVAL_RULES[_jax.while_p] = _while
