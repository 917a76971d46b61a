"""The harvest interpreter: evaluates a traced jaxpr, reaping and planting sites.

`Run.eval` walks a jaxpr eqn by eqn under whatever trace is current (usually
a fresh jaxpr trace, so the result is again a program). A `sow` eqn of the
harvested tag is consumed: its value is recorded and/or replaced by a plant.
Eqns without such sites inside are re-bound unchanged, so user `jit`
boundaries and compile caches survive. Each higher-order primitive that can
hold sites has one rule in `RULES`; the rule re-traces its bodies with a child
`Run` and threads the sites out as extra outputs (and plants in as extra
inputs), following the primitive's own semantics (scan stacks or carries,
cond requires matching branches, while carries the last value...).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from lazyharvest import _jax
from lazyharvest.errors import HarvestError
from lazyharvest.keys import Label
from lazyharvest.primitive import sow_p
from lazyharvest.transforms import Transform, recorded_p

RawKey = tuple  # (path, scopes, name)


def raw_key(params: dict) -> RawKey:
    return (params["path"], params["scopes"], params["name"])


def describe(key: RawKey) -> str:
    path, scopes, name = key
    parts = [p.spelled() if isinstance(p, Label) else p for p in path if p != "primal"]
    return "/".join(parts + list(scopes) + [name])


def labels_of(t: Transform) -> tuple:
    """The path entries a recorded transformation adds to the sites inside."""
    if t.structural:
        return (Label(t.name, True, True),)
    return (Label(t.name, True, False), Label(t.name, False, False))


ANY_TAG = object()  # a harvest of every tag (used to strip all sites)


@attrs.frozen
class Harvest:
    """What one harvest takes: a tag and name filters."""

    tag: Hashable
    allowlist: frozenset | None = None
    blocklist: frozenset = frozenset()
    exclusive: bool = False

    def owns(self, params: dict) -> bool:
        return self.tag is ANY_TAG or params["tag"] == self.tag

    def selects(self, params: dict) -> bool:
        name = params["name"]
        if self.allowlist is not None and name not in self.allowlist:
            return False
        return name not in self.blocklist

    def where(self, key: RawKey) -> str:
        return f"harvest of tag {self.tag!r}, site {describe(key)!r}"


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

    def leaves(self) -> list:
        if self.mode != "append" or len(self.chunks) == 1:
            return list(self.chunks[-1])
        return [jnp.concatenate(parts, axis=0) for parts in zip(*self.chunks)]


@attrs.define
class Plant:
    """A planted value: replaces the site (adds, for a cotangent site)."""

    leaves: list
    mode: str
    additive: bool


class Run:
    """One evaluation of a jaxpr under a harvest.

    `want(key)` says which sites to return; `plants` maps keys to `Plant`s.
    With `foreign=False`, sites of other tags are consumed too: a side
    computation (a DelayedDict leaf) must not sow them a second time.
    """

    def __init__(self, harvest: Harvest, want: Callable[[RawKey], bool],
                 plants: dict[RawKey, Plant] | None = None,
                 cursor: dict[RawKey, int] | None = None, foreign: bool = True,
                 abstract: bool = False):
        self.harvest = harvest
        # An abstract run only learns the sites' avals: derivative leaves of
        # recorded transforms get placeholders of the right aval, not traces.
        self.abstract = abstract
        self.want = want
        self.plants = plants or {}
        self.cursor = dict(cursor or {})
        self.foreign = foreign and not harvest.exclusive
        self.records: dict[RawKey, Record] = {}

    def child(self, plants: dict[RawKey, Plant] | None = None) -> "Run":
        return self.spawn(self.plants if plants is None else plants, self.cursor)

    def spawn(self, plants: dict[RawKey, Plant], cursor: dict | None = None,
              want: Callable[[RawKey], bool] | None = None) -> "Run":
        return Run(self.harvest, self.want if want is None else want, plants,
                   cursor, self.foreign, self.abstract)

    # -- recording --------------------------------------------------------

    def record(self, key: RawKey, mode: str, tree: Any, leaves: list) -> None:
        """Adds one contribution; for append, `leaves` carry a leading axis."""
        old = self.records.get(key)
        if old is None:
            self.records[key] = Record(mode, tree, [list(leaves)])
            return
        where = self.harvest.where(key)
        if old.mode != mode:
            raise HarvestError(
                f"{where}: sown with mode {old.mode!r} and again with mode "
                f"{mode!r}. Use one mode for every sow of a name.")
        if mode == "strict":
            raise HarvestError(
                f"{where}: sown twice in one run with mode='strict'. Give each "
                f"sow its own name, or use mode='clobber' (keep the last) or "
                f"mode='append' (stack them).")
        if mode == "clobber":
            old.chunks = [list(leaves)]
        else:
            shapes = [(x.shape[1:], x.dtype) for x in old.chunks[0]]
            if shapes != [(x.shape[1:], x.dtype) for x in leaves]:
                raise HarvestError(
                    f"{where}: mode='append' values must all have one shape "
                    f"and dtype; got {shapes} and "
                    f"{[(x.shape[1:], x.dtype) for x in leaves]}.")
            old.chunks.append(list(leaves))

    def merge(self, sites: Sequence[Site], leaves: Sequence[Any]) -> None:
        it = iter(leaves)
        for s in sites:
            self.record(s.key, s.mode, s.tree, [next(it) for _ in s.avals])

    def sites(self) -> list[Site]:
        return [Site(k, r.mode, r.tree,
                     tuple(jax.typeof(x) for x in r.leaves()))
                for k, r in self.records.items()]

    def site_leaves(self) -> list:
        return [x for r in self.records.values() for x in r.leaves()]

    # -- evaluation ---------------------------------------------------------

    def eval(self, jaxpr: _jax.Jaxpr, consts: Sequence[Any],
             args: Sequence[Any]) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, _jax.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            with _jax.eqn_context(eqn):
                outs = self.eval_eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eval_eqn(self, eqn: _jax.JaxprEqn, invals: list) -> list:
        prim = eqn.primitive
        if prim is sow_p:
            return self.sow(eqn.params, invals)
        if contains_sites(eqn, self.harvest.tag):
            rule = RULES.get(prim.name)
            if rule is None:
                raise HarvestError(
                    f"harvest of tag {self.harvest.tag!r}: sites inside the "
                    f"higher-order primitive {prim.name!r} are not supported. "
                    f"Move the sow outside it.")
            return rule(self, eqn, invals)
        return bind(eqn, invals)

    def sow(self, params: dict, vals: list) -> list:
        h = self.harvest
        if not h.owns(params):
            return sow_p.bind(*vals, **params) if self.foreign else vals
        key = raw_key(params)
        plant = self.plants.get(key)
        if params["recompute"]:
            # A copy rematerialized by jax.checkpoint: planted, never counted.
            return self.apply_plant(key, plant, vals, advance=False)
        if not h.selects(params):
            return sow_p.bind(*vals, **params)
        mode = params["mode"]
        if plant is not None:
            return self.apply_plant(key, plant, vals)
        if self.want(key):
            leaves = [x[None] for x in vals] if mode == "append" else vals
            self.record(key, mode, params["tree"], leaves)
        return vals

    def apply_plant(self, key: RawKey, plant: Plant | None, vals: list,
                    advance: bool = True) -> list:
        if plant is None:
            return vals
        if plant.mode == "append":
            i = self.cursor.get(key, 0)
            if advance:
                self.cursor[key] = i + 1
            new = [p[i] for p in plant.leaves]
        else:
            new = list(plant.leaves)
        if plant.additive:
            return [v + p.astype(v.dtype) for v, p in zip(vals, new)]
        return [p.astype(v.dtype) for v, p in zip(vals, new)]


def bind(eqn: _jax.JaxprEqn, invals: list, params: dict | None = None) -> list:
    outs = _jax.bind_eqn(eqn, invals, params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


# --- which eqns hold sites ---------------------------------------------------

def sub_jaxprs(params: dict) -> Iterable[_jax.Jaxpr]:
    for v in params.values():
        vs = v if isinstance(v, (tuple, list)) else (v,)
        for x in vs:
            if isinstance(x, _jax.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, _jax.Jaxpr):
                yield x


_HAS_SITES: dict = {}


def jaxpr_has_sites(jaxpr: _jax.Jaxpr, tag: Hashable) -> bool:
    key = (id(jaxpr), tag)
    hit = _HAS_SITES.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found = any((e.primitive is sow_p and (tag is ANY_TAG or e.params["tag"] == tag))
                or contains_sites(e, tag) for e in jaxpr.eqns)
    if len(_HAS_SITES) > 4096:
        _HAS_SITES.clear()
    _HAS_SITES[key] = (jaxpr, found)
    return found


def contains_sites(eqn: _jax.JaxprEqn, tag: Hashable) -> bool:
    return any(jaxpr_has_sites(j, tag) for j in sub_jaxprs(eqn.params))


def count_occurrences(jaxpr: _jax.Jaxpr, harvest: Harvest) -> dict[RawKey, int]:
    """How many times each selected site of `harvest` runs in one evaluation."""
    counts: dict[RawKey, int] = {}

    def add(other: dict, times: int = 1):
        for k, n in other.items():
            counts[k] = counts.get(k, 0) + n * times

    for e in jaxpr.eqns:
        p = e.params
        if e.primitive is sow_p:
            if harvest.owns(p) and harvest.selects(p) and not p["recompute"]:
                add({raw_key(p): 1})
        elif e.primitive.name == "scan":
            add(count_occurrences(p["jaxpr"].jaxpr, harvest), p["length"])
        elif e.primitive.name == "cond":
            add(count_occurrences(p["branches"][0].jaxpr, harvest))
        elif e.primitive.name == "while":  # clobber only: present, count unknown
            add(count_occurrences(p["body_jaxpr"].jaxpr, harvest))
        elif e.primitive is recorded_p:
            for (path, scopes, name), n in count_occurrences(p["jaxpr"], harvest).items():
                for label in labels_of(p["transform"]):
                    add({(path + (label,), scopes, name): n})
        else:
            for j in sub_jaxprs(p):
                add(count_occurrences(j, harvest))
    return counts


# --- tracing a body with a child run -----------------------------------------

@attrs.frozen
class Body:
    """A re-traced body: `jaxpr(*consts, *args) -> (*outs, *site leaves)`."""

    jaxpr: _jax.Jaxpr
    consts: list
    sites: list  # [Site]
    n_out: int

    @property
    def n_site_leaves(self) -> int:
        return sum(len(s.avals) for s in self.sites)


def trace_body(run: Run, jaxpr: _jax.Jaxpr, consts: Sequence[Any],
               in_avals: Sequence[Any], make_child: Callable[[list], Run] | None = None,
               n_extra: int = 0) -> tuple[Body, Run]:
    """Re-traces `jaxpr` with a child run; sites come out as extra outputs.

    With `make_child`, the traced function takes `n_extra` more inputs after
    the body's own and builds the child run from them (plants as operands).
    """
    holder: dict = {}

    def fn(*args):
        own, extra = args[:len(args) - n_extra], args[len(args) - n_extra:]
        child = make_child(list(extra)) if make_child else run.child()
        outs = child.eval(jaxpr, consts, own)
        holder["child"] = child
        holder["sites"] = child.sites()
        return [*outs, *child.site_leaves()]

    new, new_consts = _jax.trace_flat(fn, in_avals)
    child = holder["child"]
    return Body(_jax.consts_as_invars(new), new_consts, holder["sites"],
                len(jaxpr.outvars)), child


def _invar_avals(jaxpr: _jax.Jaxpr) -> list:
    return [v.aval for v in jaxpr.invars]


# --- rules -------------------------------------------------------------------

RULES: dict[str, Callable[[Run, _jax.JaxprEqn, list], list]] = {}


def rule(*names: str):
    def register(fn):
        for n in names:
            RULES[n] = fn
        return fn
    return register


def _finish(run: Run, body: Body, outs: list, child: Run | None = None) -> list:
    run.merge(body.sites, outs[body.n_out:])
    if child is not None:
        run.cursor.update(child.cursor)
    return outs[:body.n_out]


@rule("jit")
def _jit(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    p = eqn.params
    closed = p["jaxpr"]
    body, child = trace_body(run, closed.jaxpr, closed.consts,
                             _invar_avals(closed.jaxpr))
    nc, ns = len(body.consts), body.n_site_leaves
    params = dict(
        p, jaxpr=_jax.ClosedJaxpr(body.jaxpr, ()),
        in_shardings=(_jax.UNSPECIFIED,) * nc + tuple(p["in_shardings"]),
        in_layouts=(None,) * nc + tuple(p["in_layouts"]),
        donated_invars=(False,) * nc + tuple(p["donated_invars"]),
        out_shardings=tuple(p["out_shardings"]) + (_jax.UNSPECIFIED,) * ns,
        out_layouts=tuple(p["out_layouts"]) + (None,) * ns)
    outs = bind(eqn, [*body.consts, *invals], params)
    return _finish(run, body, outs, child)


@rule("closed_call", "core_call")
def _closed_call(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    closed = eqn.params["call_jaxpr"]
    if isinstance(closed, _jax.ClosedJaxpr):
        jaxpr, consts = closed.jaxpr, closed.consts
    else:
        jaxpr, consts = closed, ()
    # Calls carry no semantics a harvest must keep: evaluate the body in place.
    return run.eval(jaxpr, consts, invals)


@rule("remat2", "checkpoint")
def _remat(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    jaxpr = eqn.params["jaxpr"]
    body, child = trace_body(run, jaxpr, (), _invar_avals(jaxpr))
    outs = bind(eqn, [*body.consts, *invals], dict(eqn.params, jaxpr=body.jaxpr))
    return _finish(run, body, outs, child)


def _zeros(avals: Iterable[Any]) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


@rule("scan")
def _scan(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    p = eqn.params
    closed, length = p["jaxpr"], p["length"]
    nconsts, ncarry = p["num_consts"], p["num_carry"]
    h = run.harvest
    # Append plants are sliced per iteration and fed as scan inputs. So is a
    # cotangent planted at a clobber site: it belongs to the value reaped, the
    # one at the highest index, and is added there only.
    per_iter = count_occurrences(closed.jaxpr, h)
    appended = [k for k, pl in run.plants.items()
                if per_iter.get(k) and (pl.mode == "append" or pl.additive)]
    plant_xs = []
    for k in appended:
        if run.plants[k].mode == "append":
            start, n = run.cursor.get(k, 0), per_iter[k] * length
            run.cursor[k] = start + n
            plant_xs += [x[start:start + n].reshape(length, per_iter[k], *x.shape[1:])
                         for x in run.plants[k].leaves]
        else:
            plant_xs += [jnp.zeros((length, *jnp.shape(x)), x.dtype).at[length - 1].set(x)
                         for x in run.plants[k].leaves]
    counts = [len(run.plants[k].leaves) for k in appended]

    def make_child(extra: list) -> Run:
        plants = dict(run.plants)
        it = iter(extra)
        for k, c in zip(appended, counts):
            plants[k] = attrs.evolve(plants[k], leaves=[next(it) for _ in range(c)])
        return run.spawn(plants, {})

    body_avals = _invar_avals(closed.jaxpr)
    xs_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in plant_xs]
    body, _ = trace_body(run, closed.jaxpr, closed.consts,
                         body_avals + xs_avals, make_child, len(plant_xs))
    for s in body.sites:
        if s.mode == "strict":
            raise HarvestError(
                f"{h.where(s.key)}: mode='strict' inside lax.scan would sow the "
                f"name once per iteration. Use mode='append' to stack the "
                f"values over iterations or mode='clobber' to keep the last.")
    clob = [s for s in body.sites if s.mode == "clobber"]
    app = [s for s in body.sites if s.mode == "append"]
    clob_avals = [a for s in clob for a in s.avals]
    # A reverse scan runs its last index first: keep that (first) value, so a
    # clobber site holds the value at the highest index, as in a forward scan.
    keep_first = bool(p["reverse"] and clob)
    n_site_carry = len(clob_avals)
    if keep_first:
        clob_avals = clob_avals + [jax.typeof(np.bool_(False))]
    nb_consts = len(body.consts)
    inner = body.jaxpr

    # New body: (consts', consts, carry, clobber-carry, xs, plant-xs)
    #        -> (carry, clobber-carry, ys, appended)
    def new_body(*args):
        i = 0
        def take(n):
            nonlocal i
            out = args[i:i + n]
            i += n
            return list(out)
        c0, c1, carry, _, xs, pxs = (take(nb_consts), take(nconsts), take(ncarry),
                                     take(len(clob_avals)),
                                     take(len(closed.jaxpr.invars) - nconsts - ncarry),
                                     take(len(plant_xs)))
        outs = _jax.eval_jaxpr(inner, (), *c0, *c1, *carry, *xs, *pxs)
        outs, leaves = outs[:body.n_out], outs[body.n_out:]
        it = iter(leaves)
        per_site = {s.key: [next(it) for _ in s.avals] for s in body.sites}
        new_clob = [x for s in clob for x in per_site[s.key]]
        if keep_first:
            old, seen = args[nb_consts + nconsts + ncarry:][:n_site_carry], args[
                nb_consts + nconsts + ncarry + n_site_carry]
            new_clob = [jnp.where(seen, o, n) for o, n in zip(old, new_clob)]
            new_clob.append(jnp.ones((), bool))
        new_app = [x for s in app for x in per_site[s.key]]
        return [*outs[:ncarry], *new_clob, *outs[ncarry:], *new_app]

    in_avals = ([jax.typeof(c) for c in body.consts] + body_avals[:nconsts + ncarry]
                + clob_avals + body_avals[nconsts + ncarry:] + xs_avals)
    jaxpr, consts = _jax.trace_flat(new_body, in_avals)
    assert not consts
    params = dict(p, jaxpr=_jax.ClosedJaxpr(jaxpr, ()),
                  num_consts=nb_consts + nconsts,
                  num_carry=ncarry + len(clob_avals))
    if "linear" in p:
        params["linear"] = ((False,) * nb_consts + tuple(p["linear"][:nconsts + ncarry])
                            + (False,) * len(clob_avals)
                            + tuple(p["linear"][nconsts + ncarry:])
                            + (False,) * len(plant_xs))
    consts_in, carry_in, xs_in = (invals[:nconsts], invals[nconsts:nconsts + ncarry],
                                  invals[nconsts + ncarry:])
    outs = bind(eqn, [*body.consts, *consts_in, *carry_in, *_zeros(clob_avals),
                      *xs_in, *plant_xs], params)
    carry_out = outs[:ncarry]
    clob_out = outs[ncarry:ncarry + n_site_carry]
    n_ys = len(outs) - ncarry - len(clob_avals) - sum(len(s.avals) for s in app)
    ys = outs[ncarry + len(clob_avals):ncarry + len(clob_avals) + n_ys]
    app_out = outs[ncarry + len(clob_avals) + n_ys:]
    it = iter(clob_out)
    for s in clob:
        run.record(s.key, "clobber", s.tree, [next(it) for _ in s.avals])
    it = iter(app_out)
    for s in app:
        # (length, n per iteration, ...) -> (length * n, ...), by iteration index
        run.record(s.key, "append", s.tree,
                   [x.reshape(-1, *x.shape[2:]) for x in (next(it) for _ in s.avals)])
    return [*carry_out, *ys]


@rule("cond")
def _cond(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    branches = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    avals = _invar_avals(branches[0].jaxpr)
    traced = [trace_body(run, b.jaxpr, b.consts, avals) for b in branches]
    bodies = [b for b, _ in traced]
    first = bodies[0]
    h = run.harvest
    sig = lambda b: {s.key: (s.mode, s.tree, s.avals) for s in b.sites}
    ref = sig(first)
    for i, b in enumerate(bodies[1:], 1):
        other = sig(b)
        if other != ref:
            names = sorted(set(ref) ^ set(other), key=str)
            diff = [describe(k) for k in names] or [
                describe(k) for k in ref if ref[k] != other.get(k)]
            raise HarvestError(
                f"harvest of tag {h.tag!r}: the branches of lax.cond/switch sow "
                f"different sites (branch 0 vs branch {i} differ in "
                f"{', '.join(diff)}: names, modes, shapes or dtypes). Sow the "
                f"same names with the same shapes and dtypes in every branch.")
    order = [s.key for s in first.sites]
    all_consts = [c for b in bodies for c in b.consts]
    offsets = np.cumsum([0] + [len(b.consts) for b in bodies]).tolist()

    def make_branch(i: int, b: Body) -> _jax.ClosedJaxpr:
        def fn(*args):
            mine = args[offsets[i]:offsets[i + 1]]
            outs = _jax.eval_jaxpr(b.jaxpr, (), *mine, *args[len(all_consts):])
            outs, leaves = outs[:b.n_out], outs[b.n_out:]
            it = iter(leaves)
            per = {s.key: [next(it) for _ in s.avals] for s in b.sites}
            return [*outs, *[x for k in order for x in per[k]]]
        jaxpr, consts = _jax.trace_flat(
            fn, [jax.typeof(c) for c in all_consts] + avals)
        assert not consts
        return _jax.ClosedJaxpr(jaxpr, ())

    new_branches = tuple(make_branch(i, b) for i, b in enumerate(bodies))
    outs = bind(eqn, [index, *all_consts, *ops],
                dict(eqn.params, branches=new_branches))
    return _finish(run, first, outs, traced[0][1])


@rule("while")
def _while(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    p = eqn.params
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    cond_c, body_c, init = invals[:cnc], invals[cnc:cnc + bnc], invals[cnc + bnc:]
    h = run.harvest
    bj = p["body_jaxpr"]
    body, _ = trace_body(run, bj.jaxpr, bj.consts, _invar_avals(bj.jaxpr))
    for s in body.sites:
        if s.mode != "clobber":
            raise HarvestError(
                f"{h.where(s.key)}: mode={s.mode!r} inside lax.while_loop; the "
                f"number of iterations is unknown, so only mode='clobber' (keep "
                f"the last value) is allowed there.")
    # Sites in the loop condition are not reaped: the condition returns only a
    # predicate. They are consumed (identity) like filtered sites.
    cj = p["cond_jaxpr"]
    cond_body, _ = trace_body(run.child(), cj.jaxpr, cj.consts,
                              _invar_avals(cj.jaxpr))
    site_avals = [a for s in body.sites for a in s.avals]
    nb, ncc = len(body.consts), len(cond_body.consts)
    ncarry = len(init)

    def new_cond(*args):
        c = args[:ncc + cnc]
        carry = args[ncc + cnc:ncc + cnc + ncarry]
        return _jax.eval_jaxpr(cond_body.jaxpr, (), *c, *carry)[:1]

    def new_body(*args):
        c = args[:nb + bnc]
        carry = args[nb + bnc:nb + bnc + ncarry]
        return _jax.eval_jaxpr(body.jaxpr, (), *c, *carry)

    carry_avals = _invar_avals(bj.jaxpr)[bnc:] + site_avals
    cjaxpr, k1 = _jax.trace_flat(
        new_cond, [jax.typeof(c) for c in cond_body.consts]
        + _invar_avals(cj.jaxpr)[:cnc] + carry_avals)
    bjaxpr, k2 = _jax.trace_flat(
        new_body, [jax.typeof(c) for c in body.consts]
        + _invar_avals(bj.jaxpr)[:bnc] + carry_avals)
    assert not k1 and not k2
    params = dict(p, cond_jaxpr=_jax.ClosedJaxpr(cjaxpr, ()),
                  body_jaxpr=_jax.ClosedJaxpr(bjaxpr, ()),
                  cond_nconsts=ncc + cnc, body_nconsts=nb + bnc)
    outs = bind(eqn, [*cond_body.consts, *cond_c, *body.consts, *body_c, *init,
                      *_zeros(site_avals)], params)
    run.merge(body.sites, outs[ncarry:])
    return outs[:ncarry]


def _strip_sites(run: Run, closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
    """The body with this harvest's sites consumed (identity), nothing reaped."""
    quiet = run.spawn({}, {}, want=lambda k: False)
    jaxpr, consts = _jax.trace_flat(
        lambda *a: quiet.eval(closed.jaxpr, closed.consts, a),
        _invar_avals(closed.jaxpr))
    return _jax.ClosedJaxpr(jaxpr, consts)


def _plants_inside(run: Run, jaxpr: _jax.Jaxpr) -> bool:
    inside = count_occurrences(jaxpr, run.harvest)
    return any(k in run.plants for k in inside)


@rule("custom_jvp_call", "custom_vjp_call")
def _custom(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    closed = eqn.params["call_jaxpr"]
    if _plants_inside(run, closed.jaxpr):
        return _custom_planted(run, eqn, invals)
    # Sites of the primal function: reaped from an inline copy of it (DCE drops
    # the copy when no reaped value is used). The outputs still come from the
    # custom call, so the user's derivative rule stays in force.
    counts = count_occurrences(closed.jaxpr, run.harvest)
    if any(run.want(k) for k in counts):
        run.eval(closed.jaxpr, closed.consts, invals)
    return bind(eqn, invals, dict(eqn.params, call_jaxpr=_strip_sites(run, closed)))


def _custom_planted(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    """A custom_jvp/vjp call with plants inside its primal function.

    The planted primal is a new custom function of (inputs, plants) whose
    derivative rule is the user's, applied to the inputs; plants get a zero
    derivative, like any constant.
    """
    closed = eqn.params["call_jaxpr"]
    counts = count_occurrences(closed.jaxpr, run.harvest)
    keys = [k for k in counts if k in run.plants]
    plant_leaves = [x for k in keys for x in run.plants[k].leaves]
    sizes = [len(run.plants[k].leaves) for k in keys]
    start = dict(run.cursor)

    def planted(*args):
        xs, ps = args[:len(invals)], args[len(invals):]
        it = iter(ps)
        plants = dict(run.plants)
        for k, n in zip(keys, sizes):
            plants[k] = attrs.evolve(plants[k], leaves=[next(it) for _ in range(n)])
        child = run.spawn(plants, start)
        out = child.eval(closed.jaxpr, closed.consts, xs)
        return out, child

    if any(run.want(k) for k in counts):
        outs, child = planted(*invals, *plant_leaves)
        for k, r in child.records.items():
            for c in r.chunks:
                run.record(k, r.mode, r.tree, c)
    for k in keys:
        if run.plants[k].mode == "append":
            run.cursor[k] = start.get(k, 0) + counts[k]
    n_in = len(invals)
    stripped = dict(eqn.params, call_jaxpr=_strip_sites(run, closed))

    def original(*xs):
        return bind(eqn, list(xs), stripped)

    if eqn.primitive.name == "custom_jvp_call":
        fun = jax.custom_jvp(lambda *a: planted(*a)[0])

        def jvp(primals, tangents):
            _, t_out = jax.jvp(original, primals[:n_in], tangents[:n_in])
            return planted(*primals)[0], t_out
        fun.defjvp(jvp)
    else:
        fun = jax.custom_vjp(lambda *a: planted(*a)[0])

        def fwd(*a):
            _, vjp = jax.vjp(original, *a[:n_in])
            return planted(*a)[0], (vjp, a[n_in:])

        def bwd(res, cts):
            vjp, ps = res
            return (*vjp(list(cts)), *[jnp.zeros_like(q) for q in ps])
        fun.defvjp(fwd, bwd)
    return list(fun(*invals, *plant_leaves))


@rule("shard_map")
def _shard_map(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    """Sites inside a shard_map body come out stacked over the devices.

    A per-device value that varies over manual mesh axes A (all manual axes
    when `check_vma=False`) is reaped with a new leading axis of size
    prod(A), in mesh order; a value that varies over none is reaped as is.
    Plants inside the body take the same layout.
    """
    p = eqn.params
    jaxpr, mesh, manual, check = _jax.shard_map_params(eqn)
    axes = tuple(a for a in mesh.axis_names if a in manual)

    def layout(x: Any) -> tuple:
        return layout_of_aval(jax.typeof(x), axes, check)

    def spec(ax: tuple) -> Any:
        return P(ax if len(ax) > 1 else ax[0]) if ax else P()

    inside = lambda: _jax.shard_map_body_context(mesh, manual, check)
    keys = [k for k in count_occurrences(jaxpr, run.harvest) if k in run.plants]
    for k in keys:
        if run.plants[k].mode == "append":
            raise HarvestError(
                f"{run.harvest.where(k)}: planting an append site inside "
                f"shard_map is not supported; plant it outside the shard_map.")
    plant_axes: list = []
    if keys:  # learn each planted site's layout from a plain trace of the body
        with inside():
            plain, _ = trace_body(run.spawn({}, {}, want=lambda k: True), jaxpr, (),
                                  _invar_avals(jaxpr))
        inner = {s.key: s for s in plain.sites}
        for k in keys:
            plant_axes += [layout_of_aval(a, axes, check) for a in inner[k].avals]
    plant_leaves = [x for k in keys for x in run.plants[k].leaves]
    sizes = [len(run.plants[k].leaves) for k in keys]
    plant_specs = [spec(ax) for ax in plant_axes]

    def make_child(extra: list) -> Run:
        plants = dict(run.plants)
        it = iter(zip(extra, plant_axes))
        for k, n in zip(keys, sizes):
            plants[k] = attrs.evolve(plants[k], leaves=[
                x[0] if ax else x for x, ax in (next(it) for _ in range(n))])
        return run.spawn(plants, run.cursor)

    in_avals = _invar_avals(jaxpr) + [
        _jax.local_aval(mesh, manual, check, sp, x)
        for sp, x in zip(plant_specs, plant_leaves)]
    with inside():
        body, _ = trace_body(run, jaxpr, (), in_avals, make_child, len(plant_leaves))
    n_out = body.n_out
    out_axes: list = []

    def fn(*args):
        outs = _jax.eval_jaxpr(body.jaxpr, (), *args)
        sites = []
        for x in outs[n_out:]:
            ax = layout(x)
            out_axes.append(ax)
            sites.append(x[None] if ax else x)
        return [*outs[:n_out], *sites]

    const_avals = [_jax.local_aval(mesh, manual, check, P(), c) for c in body.consts]
    with inside():
        new_jaxpr, k = _jax.trace_flat(fn, const_avals + in_avals)
    assert not k
    nc = len(body.consts)
    params = dict(p, jaxpr=new_jaxpr,
                  in_specs=(P(),) * nc + tuple(p["in_specs"]) + tuple(plant_specs),
                  out_specs=tuple(p["out_specs"]) + tuple(spec(a) for a in out_axes))
    outs = bind(eqn, [*body.consts, *invals, *plant_leaves], params)
    it = iter(zip(outs[n_out:], out_axes))
    for s in body.sites:
        leaves = []
        for x, ax in (next(it) for _ in s.avals):
            if s.mode == "append" and ax:  # (devices, n, ...) -> (devices * n, ...)
                x = x.reshape(-1, *x.shape[2:])
            leaves.append(x)
        run.record(s.key, s.mode, s.tree, leaves)
    return outs[:n_out]


def layout_of_aval(aval: Any, axes: tuple, check_vma: bool) -> tuple:
    """The manual axes a per-device value varies over (all, without vma types)."""
    if not check_vma:
        return axes
    varying = _jax.varying_axes(aval)
    return tuple(a for a in axes if a in varying)


def strip_all_sites(closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
    """`closed` with every site of every tag removed (made the identity)."""
    run = Run(Harvest(ANY_TAG), lambda k: False, foreign=False)
    return _strip_sites(run, closed)


@rule("recorded_transform")
def _recorded(run: Run, eqn: _jax.JaxprEqn, invals: list) -> list:
    """A site under a recorded transformation T has one key per choice of
    "apply T to its slice" or "see through T" (SPEC 3.3).

    The outputs are T of the inner function with its sites consumed. A leaf
    is T (or not) applied to the inner leaf function, the slice of the inner
    jaxpr producing that site as a function of T's inputs.
    """
    p = eqn.params
    t, jaxpr = p["transform"], p["jaxpr"]
    labels = labels_of(t)
    inner = count_occurrences(jaxpr, run.harvest)
    plants: dict = {}
    for (path, scopes, name), plant in run.plants.items():
        if path and isinstance(path[-1], Label) and path[-1] in labels:
            ik = (path[:-1], scopes, name)
            if ik in inner:
                plants[ik] = plant
    extra = [x for pl in plants.values() for x in pl.leaves]
    extra_axes = [t.site_axis()] * len(extra) if t.name == "vmap" else []
    sizes = [len(pl.leaves) for pl in plants.values()]

    def inner_run(ex: Sequence[Any], want: Callable) -> Run:
        it = iter(ex)
        planted = {k: attrs.evolve(pl, leaves=[next(it) for _ in range(n)])
                   for (k, pl), n in zip(plants.items(), sizes)}
        return run.spawn(planted, {}, want=want)

    def plain(*flat):
        n = len(flat) - len(extra)
        return inner_run(flat[n:], lambda k: False).eval(jaxpr, (), flat[:n])

    outs = jax.tree_util.tree_leaves(t.call(plain, invals, extra, extra_axes))

    wanted: dict = {}
    for ik in inner:
        if ik in plants:
            continue
        for label in labels:
            ok = (ik[0] + (label,), ik[1], ik[2])
            if run.want(ok):
                wanted[ok] = (ik, label.chosen)
    if not wanted:
        return outs
    request = list(dict.fromkeys(ik for ik, _ in wanted.values()))
    modes: dict = {}

    def leaf_fn(*flat):
        n = len(flat) - len(extra)
        child = inner_run(flat[n:], set(request).__contains__)
        child.eval(jaxpr, (), flat[:n])
        for k in request:
            modes[k] = child.records[k].mode
        return tuple(jax.tree_util.tree_unflatten(child.records[k].tree,
                                                  child.records[k].leaves())
                     for k in request)

    for chosen in (False, True):
        group = [ok for ok, (_, c) in wanted.items() if c == chosen]
        if not group:
            continue
        idx = [request.index(wanted[ok][0]) for ok in group]
        if chosen and run.abstract and not t.structural:
            primal = t.site_value(leaf_fn, invals, False, extra, extra_axes)
            values = [t.site_placeholder(primal[i], invals) for i in idx]
        else:
            values = t.site_value(lambda *f: tuple(leaf_fn(*f)[i] for i in idx),
                                  invals, chosen, extra, extra_axes)
        for ok, value in zip(group, values):
            leaves, tree = jax.tree_util.tree_flatten(value)
            run.record(ok, modes[wanted[ok][0]], tree, leaves)
    return outs
