"""`Run`: one evaluation of a jaxpr under a harvest, and the table of its rules.

`Run.eval` walks a jaxpr eqn by eqn under whatever trace is current (usually
a fresh jaxpr trace, so the result is again a program). A `sow` eqn of the
harvested tag is consumed: its value is recorded and/or replaced by a plant.
Eqns without such sites inside are re-bound unchanged, so user `jit`
boundaries and compile caches survive. An eqn of a higher-order primitive
that holds sites goes to its rule in `EVAL_RULES`, keyed by the primitive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from lazyharvest import _jax
from lazyharvest._interpreter.sites import (
    EVAL_RULES,
    Harvest,
    RawKey,
    contains_sites,
    count_occurrences,
    evaluation_order,
    implementation,
    jaxpr_has_sites,
    raw_key,
    selected_site,
)
from lazyharvest.errors import HarvestError
from lazyharvest.keys import PRIMAL, VJP, Label
from lazyharvest.primitive import active_tags, is_masked, is_recomputed, sow_p


def _duals(path: tuple) -> list[tuple]:
    """The paths of the cotangent copies whose backward passes an occurrence
    on `path` begins: its outermost level made `"vjp"` where it is primal, and
    each inner level (outside every recorded transform) that is primal, made
    `"vjp"` where that copy runs backward: under an outer `jax.jvp` the
    cotangent of an inner `jax.grad` has path `("vjp", "primal")` and its
    tangent `("vjp", "jvp")`, whose primal occurrences are `("primal",
    "primal")` and `("primal", "jvp")`."""
    if not path:
        return []
    out = [path[:-1] + (VJP,)] if path[-1] == PRIMAL else []
    for i in range(len(path) - 2, -1, -1):
        if isinstance(path[i + 1], Label):
            break
        if path[i] == PRIMAL:
            dual = path[:i] + (VJP,) + path[i + 1:]
            if runs_backward((dual, (), "")):
                out.append(dual)
    return out


def _outer_duals(path: tuple) -> list[tuple]:
    """The paths evaluated forward at two or more backward levels whose
    inner pass an occurrence on `path` ends, in the outer pass's order: those
    with `path`'s level inside all its `"vjp"` levels made `"vjp"`. Under an
    outer `jax.vjp`, the outer cotangent of an inner `jax.grad`'s cotangent
    has path `("vjp", "vjp")`; the outer pass visits the inner passes last
    first, each ending at the outer cotangents of the values it differentiated
    (`("primal", "vjp")`)."""
    levels = []
    for i in range(len(path) - 1, -1, -1):
        if isinstance(path[i], Label):
            break
        levels.append(i)
    vjps = [i for i in levels if path[i] == VJP]
    if len(vjps) % 2 != 1:
        return []
    return [path[:i] + (VJP,) + path[i + 1:] for i in levels
            if path[i] == PRIMAL and i < min(vjps)]


def plant_order(jaxpr: _jax.Jaxpr, harvest: Harvest, key: RawKey) -> tuple | None:
    """For a plant of `key` evaluated forward in an outer backward pass over
    inner ones (`_outer_duals`), the row in program order of each occurrence,
    by the index a run's cursor gives it; None where that is the cursor
    order, or where it cannot be known before the run. The outer pass visits
    the inner passes last first, each forward, and a pass ends at the
    occurrences of the values it differentiated."""
    path, scopes, name = key
    if runs_backward(key) or sum(1 for level in path if level == VJP) < 2:
        return None
    events = evaluation_order(jaxpr, harvest, key, lambda k: (
        k[1:] == (scopes, name) and path in _outer_duals(k[0])))
    if events == [-2] or -1 not in events:
        return None  # (in one construct only: taken as evaluated, docs/semantics.md)
    if -2 in events:
        raise HarvestError(
            f"{harvest.where(key)}: a cotangent planted in a backward pass over "
            f"several inner ones, some inside a lax.cond whose branches differ in "
            f"them or a loop without a fixed trip count: which row each occurrence "
            f"takes is not known before the run. Plant it in the inner backward "
            f"pass (inside the jax.grad), or give every branch the same passes.")
    passes: list[list[int]] = [[]]
    for i in events:
        if i >= 0:
            passes[-1].append(i)
        elif passes[-1]:
            passes.append([])
    rows = [i for p in reversed(passes) for i in p]
    order = [0] * len(rows)
    for row, i in enumerate(rows):
        order[i] = row
    return None if order == sorted(order) else tuple(order)


def runs_backward(key: RawKey) -> bool:
    """Whether the occurrences of a site are evaluated in reverse program order.

    A backward pass binds the cotangent copies of a site in reverse order; a
    backward pass of a backward pass restores it. So the occurrences of a site
    run backward when its path has an odd number of `"vjp"` levels outside its
    outermost recorded transform (inside one, a nested run orders them).
    """
    flips = False
    for level in reversed(key[0]):
        if isinstance(level, Label):
            break
        if level == VJP:
            flips = not flips
    return flips


@attrs.define
class Site:
    """What a run learnt about one site: identity, mode, structure, avals."""

    key: RawKey
    mode: str
    tree: Any
    avals: tuple  # per leaf, of the reaped value (stacked for append)


@attrs.define
class Record:
    """The value of one site so far in a run."""

    mode: str
    tree: Any
    chunks: list  # strict/clobber: [leaves]; append: list of stacked leaves
    # A value from before the body (`plumbing.seed`, `merge(replace=True)`):
    # the next sow replaces it, even where a clobber record keeps its first
    # contribution.
    seeded: bool = False
    # A clobber record evaluated backward whose contribution so far holds only
    # where this traced bool is true (a cond whose taken branch may not sow
    # it): a later contribution fills in the rest. None: it holds everywhere.
    flag: Any = None
    # An append record evaluated backward: where its next contribution goes
    # (the front of the current backward pass; `Run.begin_passes`).
    pass_start: int = 0
    # A record evaluated forward at two or more backward levels (the outer
    # cotangent of an inner cotangent: "vjp" at both): the outer pass visits
    # the inner passes last first. Where the next pass's contributions go
    # (`Run.end_inner_passes`); None: at the end.
    front: int | None = None

    def leaves(self) -> list:
        if self.mode != "append" or len(self.chunks) == 1:
            return list(self.chunks[-1])
        return [jnp.concatenate(parts, axis=0) for parts in zip(*self.chunks)]


SOWN = "sown?"  # the last path entry of a flag's key, unlike any level or label
_PASS = "pass"  # the first entry of the cursor's counts of backward passes


def sown_key(key: RawKey) -> RawKey:
    """The key of the flag "site `key` was sown" (recorded with `track_sown`)."""
    path, scopes, name = key
    return (path + (SOWN,), scopes, name)


def _read_vars(jaxpr: _jax.Jaxpr, tag: Any) -> set:
    """The variables read by the eqns of `jaxpr` that are kept whatever the
    outputs: effects, sites of `tag`, or outputs read by such eqns. (Never
    empty: it holds a sentinel, so an empty set means "not computed".)"""
    read: set = {None}
    for eqn in reversed(jaxpr.eqns):
        if (eqn.effects or eqn.primitive is sow_p or any(v in read for v in eqn.outvars)
                or contains_sites(eqn, tag)):
            read.update(v for v in eqn.invars if not isinstance(v, _jax.Literal))
    return read


def align(flag: Any, x: Any) -> Any:
    """`flag`, a bool over the leading axes of `x` (a scalar, or a masked
    site's mask), shaped to broadcast against `x`."""
    extra = jnp.ndim(x) - jnp.ndim(flag)
    return jnp.reshape(flag, jnp.shape(flag) + (1,) * extra) if jnp.ndim(flag) else flag


def select(flag: Any, new: Sequence[Any], old: Sequence[Any]) -> list:
    """`new` where `flag` holds, else `old`, leaf by leaf."""
    return [jnp.where(align(flag, n), n, o) for n, o in zip(new, old)]


def is_sown(key: RawKey) -> bool:
    return bool(key[0]) and key[0][-1] == SOWN


_LEAF = jax.tree_util.tree_structure(0)


@attrs.define
class Plant:
    """A planted value: replaces the site (adds, for a cotangent site).

    `count` is how many times the site occurs where this plant applies (an
    additive `clobber` plant is added at the last occurrence in program order
    only: the one whose value is reaped).
    """

    leaves: list
    mode: str
    additive: bool  # a cotangent site: added where the reaped value was sown
    add: bool = False  # plant(mode="add"): added to the site at every sow
    count: int = 0
    # per occurrence in the run's cursor order, its row in program order,
    # where they differ (`plant_order`)
    order: tuple | None = None
    # an intervention (`lazyharvest.interventions`): `applied(vals, leaves)`
    # gives the planted value, `leaves` being its operands
    applied: Callable | None = None

    def total(self) -> int:
        """How many occurrences the plant covers."""
        return self.count if self.mode != "append" else self.leaves[0].shape[0]

    def last(self) -> int:
        """The cursor index of the last occurrence in program order."""
        n = self.total()
        return self.order.index(n - 1) if self.order and n - 1 in self.order else n - 1

    def within(self, start: int, n: int, n_it: int) -> tuple | None:
        """`order` in one iteration of a scan taking occurrences `start` to
        `start + n`, `n_it` per iteration, sliced in order (`_ScanPlants`):
        only a clobber plant's last occurrence may still be out of place."""
        pos = (self.last() - start) % n_it if self.order and n_it else n_it - 1
        if self.mode == "append" or pos == n_it - 1:
            return None
        order = list(range(n_it))
        order[pos], order[-1] = n_it - 1, pos
        return tuple(order)




class Run:
    """One evaluation of a jaxpr under a harvest.

    `want(key)` says which sites to return; `plants` maps keys to `Plant`s;
    `cursor` counts, per planted site, the occurrences evaluated so far. With
    `keep_other_tags=False`, sites of other tags are consumed too: a side
    computation (a DelayedDict leaf) must not sow them a second time.

    `replays` pairs the copies `jax.checkpoint` rematerializes with their
    originals: a planted original pushes what it was planted with, per
    (token, key), and its copy (`recompute=token`) pops it, so the copy of an
    occurrence gets that occurrence's plant. Backward passes rematerialize in
    reverse order, hence a stack. Runs with the same plant coordinates (jit,
    remat, cond bodies) share it; `replay_plants` holds, per (token, key), the
    plant a copy reads when it differs from `plants` (in a scan body).
    """

    def __init__(self, harvest: Harvest, want: Callable[[RawKey], bool],
                 plants: dict[RawKey, Plant] | None = None,
                 cursor: dict[RawKey, int] | None = None,
                 keep_other_tags: bool = True, abstract: bool = False,
                 pass_through: bool = False, parent: Run | None = None,
                 track_sown: bool = False,
                 replays: dict | None = None, replay_plants: dict | None = None,
                 outputs_needed: bool = True):
        self.harvest = harvest
        # Whether the caller reads what `eval` returns (a leaf's slice does
        # not); if not, `outputs_unused` tells which eqns' outputs are dead.
        self.outputs_needed = outputs_needed
        self._used: tuple[Any, set] | None = None  # (jaxpr, vars read)
        self._own: set = set()  # ids of that jaxpr's eqns
        self.parent = parent
        self.track_sown = track_sown
        # An abstract run only learns the sites' avals: derivative leaves of
        # recorded transforms get placeholders of the right aval, not traces.
        self.abstract = abstract
        self.want = want
        self.plants = plants or {}
        self.cursor = dict(cursor or {})
        self.keep_other_tags = keep_other_tags and not harvest.exclusive
        # A plant consumes only the sites it plants; the others stay sites,
        # for harvests outside it.
        self.pass_through = pass_through
        self.records: dict[RawKey, Record] = {}
        # values sown before a while loop where the loop's program lacks them
        # (`plumbing.incoming` reads them): not sites of this run
        self.earlier: dict[RawKey, Record] = {}
        # primal keys sown in this run: each starts a new forward pass for
        # its cotangent site, and the outer cotangents that end inner passes
        # (`begin_passes`)
        self.primal_sown: set[RawKey] = set()
        self.replays: dict[tuple, list] = {} if replays is None else replays
        self.replay_plants: dict[tuple, Plant] = replay_plants or {}
        # An additive clobber plant (a cotangent) that a cond was to take but
        # whose taken branch may not sow the site: a traced bool, true where
        # the next occurrence evaluated (the one before the cond) takes it.
        self.pending: dict[RawKey, Any] = {}
        # Such plants given to a loop body with a traced bool each, true
        # where no iteration evaluated before took the plant (`still_owed`).
        self.owed: dict[RawKey, Any] = {}
        # A pass that only learns something about the program (which scan
        # iterations sow a site): it sows nothing, filtered sites included.
        self.side_pass = False

    def nested(self, plants: dict[RawKey, Plant] | None = None,
               cursor: dict[RawKey, int] | None = None,
               want: Callable[[RawKey], bool] | None = None,
               pass_through: bool | None = None, inherit: bool = False,
               track_sown: bool | None = None,
               replays: dict | None = None, replay_plants: dict | None = None,
               outputs_needed: bool = True) -> Run:
        """A run for a body inside this one; each argument left out is inherited
        (but `outputs_needed`, which describes the caller).

        With `inherit`, the body reads this run's records as the values its
        sites had before it (the body then closes over them). A body given its
        own `cursor` counts in its own coordinates: it gets its own replay
        stack (empty unless `replays` is given).
        """
        same = cursor is None
        new = Run(self.harvest, self.want if want is None else want,
                  self.plants if plants is None else plants,
                  self.cursor if cursor is None else cursor,
                  self.keep_other_tags, self.abstract,
                  self.pass_through if pass_through is None else pass_through,
                  self if inherit else None,
                  self.track_sown if track_sown is None else track_sown,
                  replays if replays is not None else self.replays if same else {},
                  replay_plants if replay_plants is not None
                  else self.replay_plants if same else {}, outputs_needed)
        new.side_pass = self.side_pass
        return new

    def still_owed(self) -> list:
        """After the body: per key of `owed`, whether its plant is still owed
        (no occurrence in the body took it), for the next iteration."""
        return [jnp.logical_and(f, self.pending.pop(k, False)) for k, f in self.owed.items()]

    # -- recording --------------------------------------------------------

    def record(self, key: RawKey, mode: str, tree: Any, leaves: list,
               flag: Any = None) -> None:
        """Adds one contribution; for append, `leaves` carry a leading axis.

        Contributions come in evaluation order; the record keeps program
        order. For a site evaluated backward (`runs_backward`) an append
        contribution goes first and a clobber record keeps the first one
        evaluated: the last in program order, the one whose value is reaped.
        """
        old = self.records.get(key)
        if old is None:
            self.records[key] = Record(mode, tree, [list(leaves)], flag=flag)
            return
        where = self.harvest.where(key)
        if old.mode != mode:
            raise HarvestError(
                f"{where}: sown with mode {old.mode!r} and again with mode "
                f"{mode!r}. Use one mode for every sow of a name.")
        if mode == "strict":
            raise HarvestError(
                f"{where}: sown twice in one run with mode='strict'. Give each "
                f"sow its own name (for a block called repeatedly, wrap each call "
                f"in lh.nest(block, scope=...)), or use mode='clobber' (keep the "
                f"last) or mode='append' (stack them).")
        backward = runs_backward(key)
        if mode == "clobber":
            if not backward and old.front is not None:
                return  # (an earlier pass's: the later one's is reaped)
            if backward and is_sown(key) and (not old.seeded or flag is not None):
                # (a masked site adds the elements it sows to those that did)
                # "sown" by any contribution: a cond branch that did not sow
                # comes first, the straight-line sow it leaves in force after
                old.chunks = [[jnp.logical_or(o, n) for o, n in zip(old.chunks[-1], leaves)]]
            elif flag is not None and (not backward or old.seeded):
                # a masked site: where it sows (evaluated backward, one that
                # follows a loop carry: the carry holds the later iterations)
                old.chunks = [select(flag, leaves, old.chunks[-1])]
                old.seeded = False
                old.flag = old.flag | flag if old.flag is not None else (
                    flag if backward else None)
            elif not backward or old.seeded:
                old.chunks = [list(leaves)]
                old.seeded, old.flag = False, flag
            elif old.flag is not None:  # fill in where the first one did not sow
                old.chunks = [select(old.flag, old.chunks[-1], leaves)]
                old.flag = None if flag is None else old.flag | flag
            return
        shapes = [(x.shape[1:], x.dtype) for x in old.chunks[0]]
        if shapes != [(x.shape[1:], x.dtype) for x in leaves]:
            raise HarvestError(
                f"{where}: mode='append' values must all have one shape "
                f"and dtype; got {shapes} and "
                f"{[(x.shape[1:], x.dtype) for x in leaves]}.")
        if backward:
            old.chunks.insert(old.pass_start, list(leaves))
        elif old.front is not None:
            old.chunks.insert(old.front, list(leaves))
            old.front += 1
        else:
            old.chunks.append(list(leaves))

    # -- plants of cotangents over several backward passes --------------------
    # A cotangent plant's rows are in program order, but backward passes
    # evaluate cotangents in reverse, pass after pass (a Python loop of
    # jax.grad steps). Per planted cotangent key the cursor also counts, under
    # `_PASS` keys, where the current pass's rows begin (the cotangents of the
    # passes before it) and how many primal occurrences it covers: its
    # cotangents take the rows `begin + n - 1` down to `begin`. (In the
    # cursor, these counts travel wherever the cursor does: into bodies,
    # back out of them.)

    def count_primal(self, key: RawKey, n: int = 1) -> None:
        """Counts `n` primal occurrences of `key` for its cotangent's plant."""
        path, scopes, name = key
        for dual_path in _duals(path):
            dual = (dual_path, scopes, name)
            if dual not in self.plants or not runs_backward(dual):
                continue
            c = self.cursor
            if c.get((_PASS, "ct", dual), 0):  # a cotangent ran since: a new pass
                c[(_PASS, "begin", dual)] = c.get(dual, 0)
                c[(_PASS, "n", dual)] = 0
                c[(_PASS, "ct", dual)] = 0
            c[(_PASS, "n", dual)] = c.get((_PASS, "n", dual), 0) + n

    def backward_end(self, key: RawKey, plant: Plant, done: int) -> int:
        """The row after those of the cotangents of `key` evaluated next,
        `done` having been evaluated: the pass's rows run backward from its
        last. Without a primal occurrence counted (a backward function built
        outside the harvest), one pass over every row."""
        c = self.cursor
        c[(_PASS, "ct", key)] = 1
        n = c.get((_PASS, "n", key), 0)
        if not n:
            return plant.total() - done
        begin = c.get((_PASS, "begin", key), 0)
        return begin + n - (done - begin)

    def begin_passes(self, primal_keys: Iterable[RawKey]) -> None:
        """A primal occurrence of a site begins a new backward pass for its
        cotangent, after those of the occurrences before it: a cotangent is
        paired with its own occurrence, and a backward pass evaluates its
        cotangents in reverse program order. So an append cotangent evaluated
        backward goes to the front of the current pass's contributions, which
        come after the earlier passes' (a Python loop of `jax.grad` steps, a
        `jax.grad` before and inside a loop), and a clobber cotangent keeps
        the first contribution of one pass (the last occurrence in program
        order), which a later pass replaces."""
        for key in primal_keys:
            path, scopes, name = key
            duals = _duals(path)
            if duals or _outer_duals(path):
                self.primal_sown.add(key)
            for dual_path in duals:
                dual = self.records.get((dual_path, scopes, name))
                if dual is not None and dual.mode == "clobber":
                    dual.seeded = True
                elif dual is not None:
                    dual.pass_start = len(dual.chunks)

    def end_inner_passes(self, keys: Iterable[RawKey]) -> None:
        """After the contributions of a block whose occurrences `keys` were
        (`begin_passes`): where such an occurrence ends an inner backward pass
        in an outer backward pass's order, the contributions of the inner
        passes before it, evaluated next, go to the front (`_outer_duals`)."""
        for path, scopes, name in keys:
            for dual_path in _outer_duals(path):
                dual = self.records.get((dual_path, scopes, name))
                if dual is not None:
                    dual.front = 0

    def record_all(self, key: RawKey, record: Record) -> None:
        """Adds the contributions of a nested run's record, in program order."""
        chunks = record.chunks[::-1] if runs_backward(key) else record.chunks
        for c in chunks:
            self.record(key, record.mode, record.tree, c)

    def sites(self) -> list[Site]:
        return [Site(k, r.mode, r.tree, tuple(jax.typeof(x) for x in r.leaves()))
                for k, r in self.records.items()]

    def site_leaves(self) -> list:
        return [x for r in self.records.values() for x in r.leaves()]

    # -- evaluation ---------------------------------------------------------

    def eval(self, jaxpr: _jax.Jaxpr, consts: Sequence[Any],
             args: Sequence[Any]) -> list:
        if not self.outputs_needed and self._used is None:
            # The first eval is the caller's jaxpr; rules may evaluate bodies
            # with this run too (calls), whose outputs are read outside them.
            self._used = (jaxpr, set())  # computed when first asked
        return _jax.eval_eqns(jaxpr, consts, args, self.eval_eqn, in_context=True)

    def outputs_unused(self, eqn: _jax.JaxprEqn) -> bool:
        """Whether nothing this run evaluates reads `eqn`'s outputs: `eqn` is
        in the jaxpr the run was called on (not in a body a rule evaluates
        with this run), the caller does not read that jaxpr's outputs, and
        no eqn after `eqn` that is kept (one with effects or sites, or whose
        outputs are read) reads them. Such outputs are dead code in the program being built, and an
        eqn holding sites may give stand-ins for them, as long as it need
        not sow again the sites it consumes (`keep_other_tags`,
        `pass_through`)."""
        if self._used is None or self.keep_other_tags or self.pass_through:
            return False
        jaxpr, used = self._used
        if not used:
            used.update(_read_vars(jaxpr, self.harvest.tag))
            own = {id(e) for e in jaxpr.eqns}
            self._own = own
        return id(eqn) in self._own and not any(v in used for v in eqn.outvars)

    def eval_eqn(self, eqn: _jax.JaxprEqn, invals: list) -> list:
        prim = eqn.primitive
        if prim is sow_p:
            return self.sow(eqn.params, invals)
        if contains_sites(eqn, self.harvest.tag):
            rule = EVAL_RULES.get(prim)
            if rule is None:
                return self.through_implementation(eqn, invals)
            return rule(self, eqn, invals, **eqn.params)
        return bind(eqn, invals)

    def through_implementation(self, eqn: _jax.JaxprEqn, invals: list,
                               impl: _jax.ClosedJaxpr | None = None,
                               keep_unstripped: bool = False) -> list:
        """The generic path through a higher-order primitive with no rule of
        its own (a library's, such as lineax's `linear_solve`): its sites are
        harvested in its implementation (`impl`), where they run as often and
        in the order they run in the primitive. The outputs come from the
        primitive itself, its bodies stripped of this harvest's sites, so its
        own differentiation, batching and transposition rules stay in force
        for whatever transforms the harvested program; where a plant reaches
        a site inside, the planted program's outputs come from the
        implementation (docs/semantics.md, section 10b). `keep_unstripped`:
        bodies that cannot be stripped (those a JAX high-level primitive's
        object holds) stay as they are, their sites in the primitive."""
        impl = implementation(eqn) if impl is None else impl
        if impl is None or selected_site(eqn, self.harvest) is None:
            return self.opaque(eqn, invals)
        inside = count_occurrences(impl.jaxpr, self.harvest)
        params = None
        planted = any(k in self.plants for k in inside)
        if not planted:
            # (a body the implementation never runs as it is: lineax on jax 0.12
            # keeps one holding a tracer of the transformation that made it)
            with contextlib.suppress(jax.errors.UnexpectedTracerError):
                params = _jax.replace_jaxprs(eqn.params, self.stripped,
                                             lambda j: jaxpr_has_sites(j, self.harvest.tag))
        if params is None and keep_unstripped and not planted:
            params = eqn.params
        if params is None:  # planted inside, or a body that cannot be stripped
            return self.eval(impl.jaxpr, impl.consts, invals)
        if self.pass_through or any(map(self.want, inside)):
            self.eval(impl.jaxpr, impl.consts, invals)  # the sites (the outputs: below)
        return bind(eqn, invals, params)

    def stripped(self, closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
        """`closed` with this harvest's sites consumed (identity), nothing reaped."""
        quiet = self.nested({}, {}, want=lambda k: False)
        jaxpr, consts = _jax.trace_flat(
            lambda *a: quiet.eval(closed.jaxpr, closed.consts, a),
            [v.aval for v in closed.jaxpr.invars])
        return _jax.ClosedJaxpr(jaxpr, consts)

    def opaque(self, eqn: _jax.JaxprEqn, invals: list, what: str | None = None,
               flag: str | None = None, yet: bool = False) -> list:
        """An eqn holding sites of this harvest's tag that it cannot look
        into (no rule for its primitive): bound unchanged when it holds only
        sites the filters leave out (they stay sites, for harvests outside
        this one, as in `sow`); a site the harvest takes is an error naming
        the primitive (`what`; where it comes from) and what to do (`flag`:
        the `jax_*3` flag that made JAX stage it; `yet`: a JAX primitive
        lazyharvest is to support, named with the JAX version)."""
        site = selected_site(eqn, self.harvest)
        if site is None:
            return bind(eqn, invals)
        if what is None:
            origin = _jax.primitive_origin(eqn.primitive)
            what = (f"the higher-order primitive {eqn.primitive.name!r}"
                    + (f" (from {origin})" if origin else "")
                    + ", which lazyharvest has no rule for,")
        fixes = ([f"turn the flag off for this program (jax.config.update({flag!r}, False))"]
                 if flag else []) + ["move the sow outside it", (
                     "leave the site out of this harvest with allowlist= or blocklist= "
                     "(a site filtered out stays in place, as the identity)")]
        fix = ", ".join(fixes[:-1]) + ", or " + fixes[-1]
        raise HarvestError(
            f"{self.harvest.where(raw_key(site))}: sites inside {what} are not "
            f"supported{f' yet on jax {jax.__version__}' if yet else ''}. "
            f"{fix[0].upper()}{fix[1:]}.")

    def sow(self, params: dict, vals: list) -> list:
        h = self.harvest
        if not h.owns(params):
            return sow_p.bind(*vals, **params) if self.keep_other_tags else vals
        key = raw_key(params)
        mask = vals[-1] if is_masked(params) else None
        leaves = vals[:-1] if is_masked(params) else vals
        if params.get("earlier"):
            self.copy_of_earlier(key, params, leaves)
            return vals
        if is_recomputed(params):
            # A copy rematerialized by jax.checkpoint, or recomputed by a
            # custom_vjp backward rule: planted like its original, never counted.
            out = self.replay(key, params, leaves)
            return out if mask is None else [*select(mask, out, leaves), mask]
        if not h.selects(params):  # still a site, for harvests outside this one
            return vals if self.side_pass else sow_p.bind(*vals, **params)
        self.count_primal(key)
        self.begin_passes((key,))
        self.end_inner_passes((key,))
        plant = self.plants.get(key)
        if plant is not None:
            return self.apply_plant(key, plant, leaves, params.get("remat", ()), mask)
        if self.pass_through:
            return sow_p.bind(*vals, **dict(params, effect=params["tag"] in active_tags()))
        if self.want(key):
            mode = params["mode"]
            kept = [x[None] for x in leaves] if mode == "append" else leaves
            if mask is not None and not runs_backward(key):
                # where it does not sow, the value it had before (zeros if none)
                earlier = self.earlier_leaves(key, params["tree"], [jax.typeof(x) for x in kept])
                kept = select(mask, kept, earlier)
            self.record(key, mode, params["tree"], kept, flag=mask)
            if self.track_sown and mode == "clobber":
                self.record(sown_key(key), mode, _LEAF,
                            [jnp.ones((), bool) if mask is None else mask], flag=mask)
        return vals

    def earlier_leaves(self, key: RawKey, tree: Any, avals: Sequence[Any],
                       broadcast: bool = True) -> list:
        """The leaves of avals `avals` that a clobber site `key` holds so far,
        in this run or the runs around it, or a copy of the value sown before
        a loop (`earlier`), when that has the structure `tree`, the dtypes and
        the shapes (with `broadcast`, shapes that broadcast to them: a value
        sown outside the `jax.vmap` that made a masked site); zeros otherwise."""
        run: Run | None = self
        r = None
        while run is not None and r is None:
            r = run.records.get(key) or run.earlier.get(key)
            run = run.parent
        if r is not None and r.mode == "clobber" and r.tree == tree:
            leaves = r.leaves()
            have = [jax.typeof(x) for x in leaves]
            if len(leaves) == len(avals) and all(
                    h.dtype == a.dtype and (a.shape[a.ndim - h.ndim:] == h.shape
                                            if broadcast else a.shape == h.shape)
                    for h, a in zip(have, avals)):
                return [x if h.shape == a.shape else jnp.broadcast_to(x, a.shape)
                        for x, h, a in zip(leaves, have, avals)]
        return [jnp.zeros(a.shape, a.dtype) for a in avals]

    def copy_of_earlier(self, key: RawKey, params: dict, vals: list) -> None:
        """The value sown before a while loop, copied into the linear function
        of jax.linearize (derivative_sites.py), whose primal part has the
        original: it is the loop's earlier value, not a site of its own (the
        loop may be dead code there). A record of this run takes it as its
        value so far, as the original would have."""
        old = self.records.get(key)
        if old is not None and old.mode == "clobber" and old.tree == params["tree"]:
            old.chunks = [list(vals)]
        else:
            self.earlier[key] = Record(params["mode"], params["tree"], [list(vals)])

    def apply_plant(self, key: RawKey, plant: Plant | None, vals: list,
                    tokens: tuple = (), mask: Any = None) -> list:
        """Plants the next occurrence of `key` (in evaluation order).

        An append plant gives it its row in program order; an additive
        clobber plant is added at the last occurrence in program order only.
        `tokens`: this occurrence is the original of rematerialized copies.
        `mask`: a masked site, planted only where the mask holds; elsewhere
        an additive plant it would take is owed to the next occurrence
        evaluated (the one before it), as for a cond branch that does not sow.
        """
        if plant is None:
            return vals
        done = self.cursor.get(key, 0)
        if runs_backward(key):
            row = self.backward_end(key, plant, done) - 1
        else:
            row = plant.order[done] if plant.order and done < len(plant.order) else done
        self.cursor[key] = done + 1
        if plant.mode == "append":
            how = Replay(row)
        else:
            how = Replay(None, not plant.additive or row == plant.count - 1)
        for t in tokens:
            self.replays.setdefault((t, key), []).append(how)
        pending = self.pending.pop(key, None)
        if pending is not None and not how.applied:
            out = [v + jnp.where(align(pending, p), p, jnp.zeros_like(p)).astype(v.dtype)
                   for v, p in zip(vals, plant.leaves)]
            if mask is not None:
                self.pending[key] = pending & ~mask
        else:
            out = how.apply(plant, vals)
            if mask is not None and plant.additive and how.applied:
                self.pending[key] = ~mask
        return out if mask is None else [*select(mask, out, vals), mask]

    def replay(self, key: RawKey, params: dict, vals: list) -> list:
        """A rematerialized copy: planted as its original was."""
        token = params["recompute"]
        plant = self.replay_plants.get((token, key), self.plants.get(key))
        if plant is None:
            return vals
        stack = self.replays.get((token, key))
        if stack and isinstance(stack[-1], Replay):
            how = stack.pop()
        else:  # no original seen (a copy outside the program that planted it)
            how = Replay(min(self.cursor.get(key, 0), plant.leaves[0].shape[0] - 1)
                         if plant.mode == "append" else None)
        for t in params.get("remat", ()):
            self.replays.setdefault((t, key), []).append(how)
        return how.apply(plant, vals)


@attrs.frozen
class Replay:
    """How one planted occurrence was planted: its row (append), or whether
    the plant applied at all (clobber)."""

    row: int | None
    applied: bool = True

    def apply(self, plant: Plant, vals: list) -> list:
        if not self.applied:
            return vals
        if plant.applied is not None:
            new = plant.applied(vals, plant.leaves)
            return [v + p for v, p in zip(vals, new)] if plant.add else new
        new = list(plant.leaves) if self.row is None else [p[self.row] for p in plant.leaves]
        if plant.additive or plant.add:
            return [v + p.astype(v.dtype) for v, p in zip(vals, new)]
        return [p.astype(v.dtype) for v, p in zip(vals, new)]


@attrs.frozen
class ScanReplay:
    """The planted occurrences of one (token, key) in a scan: the scan's plant
    operand for the key (rows `start:start + n` of an append plant, reshaped
    per iteration; a clobber plant at the highest index; or the plant itself,
    when it is not sliced) and the body's replays."""

    start: int | None
    n: int
    per_iter: int
    length: int
    entries: tuple


def bind(eqn: _jax.JaxprEqn, invals: list, params: dict | None = None) -> list:
    """Re-binds `eqn`'s primitive (with `params` instead of its own, if given)."""
    outs = _jax.bind_eqn(eqn, invals, params)
    return list(outs) if eqn.primitive.multiple_results else [outs]
