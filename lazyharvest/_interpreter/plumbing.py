"""Operand plumbing shared by every rule: site leaves out of a body, plants in.

A rule re-traces a body with a nested `Run` (`trace_body`); the body's sites
come out as extra outputs after its own (`Body`). Plants the body needs travel
in as explicit operands (`PlantOperands`), so a body never closes over a
planted value: loops can slice them per iteration, `shard_map` can shard them,
custom rules can treat them as constants.

A `"clobber"` site that a body may leave unsown (a `cond` branch that does
not sow it, a loop that runs zero times) keeps the value it had before the
body: `incoming` finds it (zeros if none), and a loop seeds its body's run
with the value carried from the previous iteration (`trace_body(seeds=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import jax.numpy as jnp

from lazyharvest import _jax
from lazyharvest._interpreter.run import Plant, Record, Run, Site
from lazyharvest._interpreter.sites import RawKey


def split_list(xs: Sequence[Any], sizes: Sequence[int]) -> list[list]:
    """`xs` cut into consecutive chunks of `sizes`, then the rest (as JAX's)."""
    out, i = [], 0
    for n in sizes:
        out.append(list(xs[i:i + n]))
        i += n
    out.append(list(xs[i:]))
    return out


def per_site(sites: Sequence[Site], leaves: Sequence[Any]) -> list[list]:
    """Flat site leaves cut into one list per site."""
    *chunks, rest = split_list(leaves, [len(s.avals) for s in sites])
    assert not rest, (len(rest), len(sites))
    return chunks


def merge(run: Run, sites: Sequence[Site], leaves: Sequence[Any],
          replace: bool = False, flags: dict | None = None) -> None:
    """Records the site leaves a body returned into `run`.

    With `replace`, a body that started from the sites' earlier values (a
    `while_loop`, which no backward pass runs) replaces their records, even
    those of sites evaluated backward (`runs_backward`): each iteration ran
    its own backward pass, after the ones before the loop.
    """
    for s, ls in zip(sites, per_site(sites, leaves)):
        old = run.records.get(s.key)
        if replace and old is not None and s.mode == "clobber":
            old.seeded = True
        run.record(s.key, s.mode, s.tree, ls, (flags or {}).get(s.key))


def merge_leading(x: Any) -> Any:
    """(a, b, ...) -> (a * b, ...): stacked appends, row order kept (sizes may be 0)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def zeros(avals: Sequence[Any]) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


def lookup(run: Run | None, key: RawKey) -> Record | None:
    """The record of `key` in `run` or, failing that, in the runs around it."""
    while run is not None:
        r = run.records.get(key)
        if r is not None:
            return r
        run = run.parent
    return None


def incoming(run: Run, site: Site) -> list:
    """The leaves `site` holds before a body that may not sow it runs.

    Its `"clobber"` value so far (in `run` or the runs it inherits from), or
    else a copy of the value sown before a loop (`Run.earlier`), when that has
    the site's structure, shapes and dtypes; zeros otherwise.
    """
    return run.earlier_leaves(site.key, site.tree, site.avals, broadcast=False)


def seed(run: Run, sites: Sequence[Site], leaves: Sequence[Any]) -> Run:
    """`run` with `sites` holding `leaves` as if sown before the body."""
    for s, ls in zip(sites, per_site(sites, leaves)):
        run.records[s.key] = Record(s.mode, s.tree, [list(ls)], seeded=True)
    return run


def invar_avals(jaxpr: _jax.Jaxpr) -> list:
    return [v.aval for v in jaxpr.invars]


@attrs.frozen
class PlantOperands:
    """Plants of some sites, passed into a body as explicit operands."""

    keys: tuple  # RawKeys, in operand order
    sizes: tuple  # leaves per key
    leaves: tuple  # the planted leaves as the outer run holds them

    @classmethod
    def of(cls, run: Run, keys: Sequence[RawKey]) -> PlantOperands:
        keys = tuple(keys)
        return cls(keys, tuple(len(run.plants[k].leaves) for k in keys),
                   tuple(x for k in keys for x in run.plants[k].leaves))

    def plants(self, base: dict[RawKey, Plant], operands: Sequence[Any],
               fix: Callable[[int, Any], Any] | None = None) -> dict[RawKey, Plant]:
        """`base` with these keys' leaves replaced by `operands`.

        `fix(i, x)` adapts the i-th operand first (e.g. drops a device axis).
        """
        if fix is not None:
            operands = [fix(i, x) for i, x in enumerate(operands)]
        out = dict(base)
        for k, leaves in zip(self.keys, split_list(operands, self.sizes)):
            out[k] = attrs.evolve(out[k], leaves=leaves)
        return out


@attrs.frozen
class Body:
    """A re-traced body: `jaxpr(*consts, *args) -> (*outs, *site leaves)`."""

    jaxpr: _jax.Jaxpr
    consts: list
    sites: list  # [Site]
    n_out: int
    # With `trace_body(carry_pending=True)`: the keys of `Run.pending` after
    # the body, whose flags come last among its own outputs but `flagged`;
    # None otherwise.
    pending: tuple | None = None
    # Then the keys of its sites whose record holds only where a flag is true
    # (`Record.flag`), whose flags are its last own outputs.
    flagged: tuple = ()

    @property
    def n_own(self) -> int:
        """Its own outputs, before the flags `carry_pending` adds (`carried`)."""
        return self.n_out - len(self.pending or ()) - len(self.flagged)

    @property
    def n_site_leaves(self) -> int:
        return sum(len(s.avals) for s in self.sites)

    def split_outs(self, outs: Sequence[Any]) -> tuple[list, list]:
        """(the body's own outputs, its site leaves)."""
        return list(outs[:self.n_out]), list(outs[self.n_out:])


def trace_body(run: Run, jaxpr: _jax.Jaxpr, consts: Sequence[Any],
               in_avals: Sequence[Any], make_run: Callable[[list], Run] | None = None,
               n_extra: int = 0, seeds: Sequence[Site] = (),
               carry_pending: bool = False) -> tuple[Body, Run]:
    """Re-traces `jaxpr` with a nested run; sites come out as extra outputs.

    With `make_run`, the traced function takes `n_extra` more inputs after
    the body's own and builds the nested run from them (plants as operands);
    without it, the nested run inherits `run`'s records as earlier values.
    Its own outputs end with `Run.still_owed` of the nested run (a loop
    body's plants that may still be owed; none elsewhere).
    With `seeds`, it takes one more input per seed leaf, last: the seeds'
    values before the body (a loop's carry), which the body's sites output
    where the body does not sow them. The seeds come first among its sites.
    With `carry_pending`, the body starts from `run.pending` (a cotangent
    plant owed to the next occurrence evaluated: in the body, or after it)
    and its own outputs end with the flags still pending after it
    (`Body.pending`; `finish` or the rule puts them back into `run`).
    """
    holder: dict = {}
    n_seed = sum(len(s.avals) for s in seeds)
    in_avals = [*in_avals, *(a for s in seeds for a in s.avals)]

    def fn(*args):
        own, extra, seeded = split_list(args, [len(args) - n_extra - n_seed, n_extra])
        inner = make_run(list(extra)) if make_run else run.nested(inherit=True)
        if carry_pending:
            inner.pending = dict(run.pending)
        seed(inner, seeds, seeded)
        outs = inner.eval(jaxpr, consts, own)
        owed = inner.still_owed()
        pending = list(inner.pending.items()) if carry_pending else []
        flagged = [(k, r.flag) for k, r in inner.records.items()
                   if carry_pending and r.flag is not None]
        holder["run"] = inner
        holder["sites"] = inner.sites()
        holder["n_out"] = len(outs) + len(owed) + len(pending) + len(flagged)
        holder["pending"] = tuple(k for k, _ in pending) if carry_pending else None
        holder["flagged"] = tuple(k for k, _ in flagged)
        return [*outs, *owed, *(f for _, f in pending), *(f for _, f in flagged),
                *inner.site_leaves()]

    new, new_consts = _jax.trace_flat(fn, in_avals)
    return Body(_jax.consts_as_invars(new), new_consts, holder["sites"],
                holder["n_out"], holder["pending"], holder["flagged"]), holder["run"]


def carried(body: Body, own: list) -> tuple[list, dict, dict]:
    """A body traced with `carry_pending`: (its own outputs before the flags,
    the plants still pending after it by key, its records' flags by key)."""
    keys, n = body.pending or (), body.n_own
    return (own[:n], dict(zip(keys, own[n:n + len(keys)])),
            dict(zip(body.flagged, own[n + len(keys):])))


def finish(run: Run, body: Body, outs: list, inner: Run | None = None) -> list:
    """Records a body's site outputs and returns its own outputs."""
    own, leaves = body.split_outs(outs)
    own, pending, flags = carried(body, own)
    if body.pending is not None:
        run.pending = pending
    if inner is not None:
        run.begin_passes(inner.primal_sown)
    merge(run, body.sites, leaves, flags=flags)
    if inner is not None:
        run.end_inner_passes(inner.primal_sown)
        run.cursor.update(inner.cursor)
    return own
