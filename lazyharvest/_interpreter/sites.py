"""Finding sites: what a harvest takes, which eqns hold sites, how often each runs.

`count_occurrences` walks a jaxpr with one rule per higher-order primitive in
`COUNT_RULES` (a body run `length` times by `scan` counts `length` times); a
primitive without a count rule counts its implementation's sites where the
harvest looks through it (`implementation`), else its sub-jaxprs once each.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from lazyharvest import _jax
from lazyharvest._identity_cache import MISSING, IdentityCache
from lazyharvest.keys import PRIMAL, Label
from lazyharvest.primitive import is_masked, is_recomputed, sow_p

RawKey = tuple  # (path, scopes, name)
Counts = dict  # RawKey -> occurrences in one evaluation

ANY_TAG = object()  # a harvest of every tag (used to strip all sites)


def raw_key(params: dict) -> RawKey:
    return (params["path"], params["scopes"], params["name"])


def describe(key: RawKey) -> str:
    """A site's key as one readable string, for error messages."""
    path, scopes, name = key
    parts = [p.spelled() if isinstance(p, Label) else p for p in path if p != PRIMAL]
    return "/".join(parts + list(scopes) + [name])


@attrs.frozen(cache_hash=True)  # hashed on every call (trace-cache key)
class Harvest:
    """What one harvest takes: a tag and name filters."""

    tag: Hashable
    allowlist: frozenset | None = None
    blocklist: frozenset = frozenset()
    exclusive: bool = False

    def owns(self, params: dict) -> bool:
        return self.tag is ANY_TAG or params["tag"] == self.tag

    def selects(self, params: dict) -> bool:
        """Whether the filters take the site: by name or by scoped key."""
        name, scoped = params["name"], (*params["scopes"], params["name"])
        if self.allowlist is not None and not (
                name in self.allowlist or scoped in self.allowlist):
            return False
        return not (name in self.blocklist or scoped in self.blocklist)

    def where(self, key: RawKey) -> str:
        return f"harvest of tag {self.tag!r}, site {describe(key)!r}"


sub_jaxprs = _jax.sub_jaxprs


_HAS_SITES = IdentityCache()  # (jaxpr, tag) -> found


def jaxpr_has_sites(jaxpr: _jax.Jaxpr, tag: Hashable) -> bool:
    hit = _HAS_SITES.get((jaxpr,), tag)
    if hit is not MISSING:
        return hit
    found = any((e.primitive is sow_p and (tag is ANY_TAG or e.params["tag"] == tag))
                or contains_sites(e, tag) for e in jaxpr.eqns)
    _HAS_SITES.put((jaxpr,), tag, found)
    return found


def contains_sites(eqn: _jax.JaxprEqn, tag: Hashable) -> bool:
    return any(jaxpr_has_sites(j, tag) for j in sub_jaxprs(eqn.params))


def selected_site(eqn: _jax.JaxprEqn, harvest: Harvest) -> dict | None:
    """The params of a site inside `eqn`'s bodies, at any depth, that
    `harvest` takes (its tag, through its filters); None if it takes none."""
    for jaxpr in sub_jaxprs(eqn.params):
        for e in jaxpr.eqns:
            p = e.params
            if e.primitive is sow_p and harvest.owns(p) and harvest.selects(p):
                return p
            if e.primitive is not sow_p and contains_sites(e, harvest.tag):
                found = selected_site(e, harvest)
                if found is not None:
                    return found
    return None


def has_masked_sites(jaxpr: _jax.Jaxpr, tag: Hashable) -> bool:
    """Whether `jaxpr` holds, at any depth, a masked site of `tag`."""
    return any((e.primitive is sow_p and e.params["tag"] == tag and is_masked(e.params))
               or any(has_masked_sites(j, tag) for j in sub_jaxprs(e.params))
               for e in jaxpr.eqns if e.primitive is sow_p or contains_sites(e, tag))


# --- the rules, and the generic path -------------------------------------------

EvalRule = Callable[..., list]
EVAL_RULES: dict[_jax.Primitive, EvalRule] = {}
"""`rule(run, eqn, invals, **eqn.params) -> outvals` for an eqn holding sites
(the rules live in `run.py` and the modules beside it; the table is here
because counting needs to know which primitives have none)."""


HIGH_LEVEL_RULES: dict[type, EvalRule] = {}
"""The rules for `call_hi_primitive` eqns (JAX's high-level primitives),
keyed by the class of their `_prim` object."""

HIGH_LEVEL_BINDS: dict[type, Callable[..., list]] = {}
"""`rule(default, trace, args, avals, params) -> outs` for a bind of
`call_hi_primitive` whose `_prim` object is of the key class (in place of
JAX's `default(trace, args, avals, params)`)."""


def implementation(eqn: _jax.JaxprEqn) -> _jax.ClosedJaxpr | None:
    """For an eqn of a higher-order primitive with no rule of its own, the
    jaxpr of its implementation, through which the harvest looks inside it
    (its sites run there as often, and in the order, as in the primitive);
    None for one with a rule, or with no implementation to look through."""
    if _has_rule(eqn.primitive):
        return None
    return _jax.implementation(eqn)


def _has_rule(prim: _jax.Primitive) -> bool:
    return prim in EVAL_RULES or prim in COUNT_RULES or prim is sow_p


# --- counting ------------------------------------------------------------------

CountRule = Callable[..., Counts]
COUNT_RULES: dict[_jax.Primitive, CountRule] = {}


def add_counts(into: Counts, other: Counts, times: int = 1) -> Counts:
    for k, n in other.items():
        into[k] = into.get(k, 0) + n * times
    return into


def count_occurrences(jaxpr: _jax.Jaxpr, harvest: Harvest) -> Counts:
    """How many times each selected site of `harvest` runs in one evaluation."""
    counts: Counts = {}
    for e in jaxpr.eqns:
        add_counts(counts, _count_eqn(e, harvest))
    return counts


def handled_as(e: _jax.JaxprEqn) -> _jax.JaxprEqn:
    """`e`, or the eqn the harvest handles in its place: for a `Scan3` or a
    `RematTraced`, the `scan` or `remat2` it stands for (`_jax.as_ordinary_eqn`)."""
    found = _jax.as_ordinary_eqn(e)
    return e if found is None else found[0]


def _count_eqn(e: _jax.JaxprEqn, harvest: Harvest) -> Counts:
    e = handled_as(e)
    p = e.params
    if e.primitive is sow_p:
        if (harvest.owns(p) and harvest.selects(p) and not is_recomputed(p)
                and not p.get("earlier")):  # (copies: `Run.copy_of_earlier`)
            return {raw_key(p): 1}
        return {}
    rule = COUNT_RULES.get(e.primitive)
    if rule is not None:
        return rule(harvest, **p)
    counts: Counts = {}
    for j in _bodies(e, harvest.tag):
        add_counts(counts, count_occurrences(j, harvest))
    return counts


def evaluation_order(jaxpr: _jax.Jaxpr, harvest: Harvest, key: RawKey,
                     ends: Callable[[RawKey], bool]) -> list[int]:
    """In evaluation order, the occurrences of site `key`, each as the index
    a run's cursor gives it (a scan's iterations take theirs in operand
    order, reverse or not), and as -1 those of the sites `ends` names; as
    one -2, a construct holding some whose order depends on values (a while
    loop, cond branches that differ). A scan's iterations are listed from
    the highest index down, whichever way it runs: `plant_order` reverses
    the passes of the backward function's jaxpr into program order, which
    for a scan is by iteration index (docs/semantics.md, section 3), also
    when the scan is the transpose of a `reverse=True` one and runs forward."""
    events: list[int] = []
    n = 0
    for e in jaxpr.eqns:
        sub = _eqn_order(e, harvest, key, ends)
        events += [i + n if i >= 0 else i for i in sub]
        n += sum(i >= 0 for i in sub)
    return events


def _eqn_order(e: _jax.JaxprEqn, harvest: Harvest, key: RawKey,
               ends: Callable[[RawKey], bool]) -> list[int]:
    e = handled_as(e)
    p = e.params
    if e.primitive is sow_p:
        if not harvest.owns(p) or is_recomputed(p) or p.get("earlier"):
            return []
        k = raw_key(p)
        if k == key:
            return [0] if harvest.selects(p) else []
        return [-1] if ends(k) else []
    orders = [evaluation_order(j, harvest, key, ends) for j in _bodies(e, harvest.tag)]
    if not any(orders):
        return []
    if any(-2 in o for o in orders):
        return [-2]
    if e.primitive is _jax.scan_p:
        body, its = orders[0], range(p["length"])
        c = sum(i >= 0 for i in body)
        return [i + t * c if i >= 0 else i for t in reversed(its) for i in body]
    if e.primitive is _jax.cond_p:
        return orders[0] if all(o == orders[0] for o in orders) else [-2]
    if len(orders) == 1 and e.primitive not in COUNT_RULES:  # jit, remat, calls
        return orders[0]
    return [-2]


def _bodies(e: _jax.JaxprEqn, tag: Hashable) -> list[_jax.Jaxpr]:
    """The bodies whose sites `e` runs once each: its implementation's jaxpr
    for a primitive the harvest looks through, else the jaxprs it carries."""
    impl = implementation(e) if contains_sites(e, tag) else None
    return [impl.jaxpr] if impl is not None else list(sub_jaxprs(e.params))


def may_owe(jaxpr: _jax.Jaxpr, harvest: Harvest, key: RawKey) -> bool:
    """Whether the first occurrence of `key` that `jaxpr` evaluates may not
    sow it: a masked site, one in a cond some of whose branches do not (or in a scan
    whose body's first occurrence may not). A cotangent
    planted there is owed to the next occurrence evaluated (`Run.pending`)."""
    for e in jaxpr.eqns:
        if not _count_eqn(e, harvest).get(key):
            continue
        p = e.params
        if e.primitive is sow_p:  # a masked site sows only where its mask holds
            return is_masked(p)
        if e.primitive is _jax.cond_p:
            return (len(sowing_branches(p["branches"], harvest, key)) < len(p["branches"])
                    or any(may_owe(b.jaxpr, harvest, key) for b in p["branches"]))
        if e.primitive in (_jax.scan_p, _jax.jit_p, _jax.remat_p):  # the body's first
            body = p["jaxpr"]
            return may_owe(getattr(body, "jaxpr", body), harvest, key)
        return False
    return False


def sowing_branches(branches: Sequence[Any], harvest: Harvest, key: RawKey) -> list[int]:
    """The indices of the cond branches that sow site `key`."""
    return [i for i, b in enumerate(branches) if count_occurrences(b.jaxpr, harvest).get(key)]


def _count_scan(harvest: Harvest, *, jaxpr, length, **_) -> Counts:
    return add_counts({}, count_occurrences(jaxpr.jaxpr, harvest), length)


def _count_cond(harvest: Harvest, *, branches, **_) -> Counts:
    # The union over branches: a clobber site may be sown by some branches
    # only; append and strict sites are sown alike in every branch (the cond
    # rule checks it), so the largest count is every branch's.
    counts: Counts = {}
    for b in branches:
        for k, n in count_occurrences(b.jaxpr, harvest).items():
            counts[k] = max(counts.get(k, 0), n)
    return counts


def _count_while(harvest: Harvest, *, body_jaxpr, **_) -> Counts:
    # Clobber only: a site is present once, however many iterations run.
    return count_occurrences(body_jaxpr.jaxpr, harvest)


COUNT_RULES[_jax.scan_p] = _count_scan
COUNT_RULES[_jax.cond_p] = _count_cond
COUNT_RULES[_jax.while_p] = _count_while
