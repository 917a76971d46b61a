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

import attrs
import jax
import jax.numpy as jnp
import numpy as np

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
    bind,
    is_sown,
    runs_backward,
    sown_key,
)
from lazyharvest._interpreter.sites import (
    Counts,
    Harvest,
    count_occurrences,
    raw_key,
    sub_jaxprs,
)
from lazyharvest.errors import HarvestError
from lazyharvest.primitive import sow_p


@attrs.define
class _ScanPlants:
    """Plants a scan body needs, as per-iteration operands (scan `xs`).

    An append plant is sliced: the rows of the scan's occurrences, in program
    order, one block per iteration. A cotangent planted at a clobber site
    belongs to the occurrence whose value is reaped, the last in program
    order: the scan that has it gets it at its highest index only, the others
    none. Copies that `jax.checkpoint` rematerializes in this scan get the
    operands their originals had in theirs (`ScanReplay`).
    """

    run: Run
    length: int
    keys: list = attrs.field(factory=list)  # sliced plants, operand order
    slices: dict = attrs.field(factory=dict)  # key -> (start, n, per iteration)
    dropped: set = attrs.field(factory=set)  # keys the body does not plant
    pairs: list = attrs.field(factory=list)  # (token, key) of sliced replays
    replays: dict = attrs.field(factory=dict)  # (token, key) -> body's replays
    xs: list = attrs.field(factory=list)

    @classmethod
    def of(cls, run: Run, jaxpr: _jax.Jaxpr, per_iter: Counts, length: int) -> _ScanPlants:
        self = cls(run, length)
        for k, pl in run.plants.items():
            n_it = per_iter.get(k)
            if not n_it or not (pl.mode == "append" or pl.additive):
                continue
            done, n = run.cursor.get(k, 0), n_it * length
            run.cursor[k] = done + n
            total = pl.leaves[0].shape[0] if pl.mode == "append" else pl.count
            start = total - done - n if runs_backward(k) else done
            if pl.mode != "append" and (n == 0 or start + n != total):
                # (a scan of length 0 has no occurrence to add a cotangent at)
                self.dropped.add(k)
                continue
            self.keys.append(k)
            self.slices[k] = (start, n, n_it)
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
            return [x[start:start + n].reshape(self.length, n_it, *x.shape[1:])
                    for x in pl.leaves]
        return [jnp.zeros((self.length, *jnp.shape(x)), x.dtype).at[self.length - 1].set(x)
                for x in pl.leaves]

    def body_run(self, extra: list, track_sown: bool | None = None) -> Run:
        run = self.run
        plants = {k: p for k, p in run.plants.items() if k not in self.dropped}
        replay_plants = dict(run.replay_plants)
        sizes = [len(run.plants[k].leaves) for k in self.keys]
        sizes += [len(_plant_of(run, pair).leaves) for pair, _ in self.pairs]
        chunks = split_list(extra, sizes)
        for k, leaves in zip(self.keys, chunks):
            plants[k] = attrs.evolve(run.plants[k], leaves=leaves, count=self.slices[k][2])
        for (pair, n_it), leaves in zip(self.pairs, chunks[len(self.keys):]):
            replay_plants[pair] = attrs.evolve(_plant_of(run, pair), leaves=leaves,
                                               count=n_it)
        return run.nested(plants, {}, track_sown=track_sown,
                          replays={p: list(e) for p, e in self.replays.items()},
                          replay_plants=replay_plants)

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
    plan = _ScanPlants.of(run, jaxpr.jaxpr, per_iter, length)
    plant_xs = plan.xs
    body_avals = invar_avals(jaxpr.jaxpr)
    xs_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in plant_xs]
    # A reverse scan tracks which iterations sow each clobber site (`sown_key`).
    make_run = lambda extra: plan.body_run(extra, track_sown=True if reverse else None)
    body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, body_avals + xs_avals,
                             make_run, len(plant_xs))
    _check_scan_modes(run.harvest, body)
    clob = [s for s in body.sites if s.mode == "clobber"]
    if clob:  # again, with the clobber carry as the sites' earlier values
        body, inner = trace_body(run, jaxpr.jaxpr, jaxpr.consts, body_avals + xs_avals,
                                 make_run, len(plant_xs), seeds=clob)
        assert [s.key for s in body.sites[:len(clob)]] == [s.key for s in clob]
        clob = body.sites[:len(clob)]
    plan.done(inner)
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
    params = _scan_params(eqn.params, new_jaxpr, nb, len(clob_avals), len(plant_xs))
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
    if length:
        run.begin_passes(inner.primal_sown)
    else:  # no iteration sows: the clobber sites keep their earlier values
        _placeholders(run, clob)
        clob, n_clob = [], 0
    _record_scan_sites(run, clob, app, clob_out[:n_clob], app_out, reverse)
    return [*carry_out, *ys]


def _scan_params(p: dict, new_jaxpr: _jax.Jaxpr, nb: int, n_clob: int, n_xs: int) -> dict:
    """The scan's params with `nb` consts, `n_clob` carries and `n_xs` xs added."""
    nc, ncarry = p["num_consts"], p["num_carry"]
    params = dict(p, jaxpr=_jax.ClosedJaxpr(new_jaxpr, ()),
                  num_consts=nb + nc, num_carry=ncarry + n_clob)
    if "linear" in p:
        lin = tuple(p["linear"])
        params["linear"] = ((False,) * nb + lin[:nc + ncarry] + (False,) * n_clob
                            + lin[nc + ncarry:] + (False,) * n_xs)
    return params


def _placeholders(run: Run, clob: list[Site]) -> None:
    """After a scan of length 0, the clobber sites that had no earlier value get
    zeros that the next occurrence replaces (also where a record evaluated
    backward keeps its first contribution); the others stay as they were."""
    for s in clob:
        if not is_sown(s.key) and lookup(run, s.key) is None:
            run.records[s.key] = Record(s.mode, s.tree, [zeros(s.avals)], seeded=True)


def _record_scan_sites(run: Run, clob: list[Site], app: list[Site], clob_out: list,
                       app_out: list, reverse: bool) -> None:
    per = dict(zip([s.key for s in clob], per_site(clob, clob_out)))
    for s in clob:
        leaves = per[s.key]
        if reverse and is_sown(s.key):
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
    ncarry = len(init)
    fwd = _forwarded(body, ncarry)
    site_avals = [a for s in body.sites for a in s.avals]
    kept = [m for m in range(len(site_avals)) if m not in fwd]
    # The site carry starts from the sites' earlier values: a loop whose body
    # never runs keeps them, and so does a nested loop.
    earlier = [x for s in body.sites for x in incoming(run, s)]
    params = _while_params(eqn.params, body, cond, cond_jaxpr, body_avals, site_avals,
                           kept, cond_nconsts, body_nconsts, ncarry)
    outs = bind(eqn, [*cond.consts, *cond_c, *body.consts, *body_c, *init,
                      *[earlier[m] for m in kept]], params)
    leaves = dict(zip(kept, outs[ncarry:]))
    if fwd:  # a forwarded site is the carry's last value if the body ran at all
        ran = _jax.eval_jaxpr(cond.jaxpr, (), *cond.consts, *cond_c, *init)[0]
        leaves.update({m: jnp.where(ran, outs[j], earlier[m]) for m, j in fwd.items()})
    merge(run, body.sites, [leaves[m] for m in range(len(site_avals))], replace=True)
    return outs[:ncarry]


def _while_params(p: dict, body: Body, cond: Body, cond_jaxpr, body_avals: list,
                  site_avals: list, kept: list, cond_nconsts: int, body_nconsts: int,
                  ncarry: int) -> dict:
    """The harvested loop's params: the carry grows by the kept site leaves."""
    nb, ncc = len(body.consts), len(cond.consts)
    carry_avals = body_avals[body_nconsts:] + [site_avals[m] for m in kept]
    n_in = len(body.jaxpr.invars) - len(site_avals)

    def new_cond(*args):
        c, carry, _rest = split_list(args, [ncc + cond_nconsts, ncarry])
        return _jax.eval_jaxpr(cond.jaxpr, (), *c, *carry)[:1]

    def new_body(*args):
        # The body's last inputs are its kept sites' values from the last
        # iteration; a forwarded site's is never read.
        seeds = dict(zip(kept, args[n_in:]))
        full = [seeds[m] if m in seeds else jnp.zeros(a.shape, a.dtype)
                for m, a in enumerate(site_avals)]
        outs = _jax.eval_jaxpr(body.jaxpr, (), *args[:n_in], *full)
        return outs[:ncarry] + [outs[ncarry + m] for m in kept]

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
