"""What the checkers know about a function's sites: their keys, their reaped
values, their modes and counts (read off the jaxpr), and whether a missing
derivative key is excused (a constant or dead site).

Keys are tuples ``(*labels, *scopes, name)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax

import lazyharvest as lh

# lazyharvest internals: imported here and nowhere else in the package.
from lazyharvest._interpreter import handled_as, sub_jaxprs
from lazyharvest.delayed import LEAF_AT_PREFIX
from lazyharvest.keys import PRIMAL, Key, normalize
from lazyharvest.primitive import sow_p
from lazyharvest.testing._values import all_zero, random_like

#: The labels a key may start with (SPEC 1 and 3).
LABELS = frozenset({
    "primal", "jvp", "vjp", "grad", "value_and_grad", "jacfwd", "jacrev",
    "hessian", "vmap", "jit", "linearize",
})


def split_labels(key: Key) -> tuple[tuple, tuple]:
    """(labels, rest) of a key: its leading parts that are transform labels.

    Read off the key's spelling: a scope spelled like a label is taken for
    one. ``label_split`` asks the sites instead.
    """
    key = normalize(key)
    n = 0
    while n < len(key) - 1 and key[n] in LABELS:
        n += 1
    return key[:n], key[n:]


def label_split(f: Callable, tag: Hashable, args: Sequence[Any]
                ) -> Callable[[Key], tuple[tuple, tuple]]:
    """``split_labels`` for the keys of ``reap(f)(*args)``, read off the sites
    they name: right for scopes and names spelled like labels too."""
    return split_of(lh.reap(f, tag=tag)(*args))


def split_of(d: Any) -> Callable[[Key], tuple[tuple, tuple]]:
    """``label_split`` for the keys of the DelayedDict ``d``."""
    def split(key: Key) -> tuple[tuple, tuple]:
        key = normalize(key)
        try:
            _, scopes, _ = d._raw(key)
        except LookupError:
            return split_labels(key)
        n = len(key) - len(scopes) - 1
        return key[:n], key[n:]
    return split


def spelling(d: Any) -> dict[tuple[tuple, Key], Key]:
    """``(labels, (*scopes, name)) -> key`` for every key of the DelayedDict
    ``d``: how it spells each site. Labels are those a key shows when no two
    sites share it (without ``"primal"`` and ``"|"``, which only a key that
    would be shared spells out, docs/semantics.md)."""
    out: dict = {}
    for key in map(normalize, d.keys()):
        try:
            _, scopes, _ = d._raw(key)
        except LookupError:
            continue
        n = len(key) - len(scopes) - 1
        labels = tuple(x for x in key[:n] if x not in ("primal", "|"))
        out.setdefault((labels, key[n:]), key)
        # the levels a spelled-out key writes, "primal" included
        out[(("|",) + tuple(x for x in key[:n] if x != "|"), key[n:])] = key
    return out


def get_nested(tree: Mapping, key: Key) -> Any:
    """The leaf of ``key`` in ``compute()``'s nested dicts: a key that is also
    a prefix of other keys (a site named like a scope or a label) holds a
    dict there, with its own value under ``LEAF_AT_PREFIX``."""
    node: Any = tree
    for part in key:
        node = node[part]
    if isinstance(node, Mapping) and LEAF_AT_PREFIX in node:
        return node[LEAF_AT_PREFIX]
    return node


def flat(d: Any) -> dict[Key, Any]:
    """A DelayedDict forced in one program, as a flat {key tuple: value} dict."""
    nested = d.compute()
    return {normalize(k): get_nested(nested, normalize(k)) for k in d}


def reaped(f: Callable, tag: Hashable, args: Sequence[Any]) -> dict[Key, Any]:
    return flat(lh.reap(f, tag=tag)(*args))


# --- what the jaxpr says about the sites: mode and how often each is sown ----------

@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """Mode of a site and how many times one run sows it (inf: in a loop)."""

    mode: str
    count: float

    @property
    def once(self) -> bool:
        return self.count == 1


def _add_counts(out: dict[Key, SiteInfo], table: Mapping[Key, SiteInfo],
                times: float = 1) -> None:
    for k, info in table.items():
        old = out.get(k)
        n = 0 if info.count == 0 or times == 0 else info.count * times
        out[k] = SiteInfo(info.mode, n + (old.count if old else 0))


def _count_branches(subs: list, tag: Hashable) -> dict[Key, SiteInfo]:
    """One run takes one branch: a site counts as often as its most frequent branch."""
    merged: dict[Key, SiteInfo] = {}
    for table in (_count_sites(j, tag) for j in subs):
        for k, info in table.items():
            old = merged.get(k)
            merged[k] = SiteInfo(info.mode, max(info.count, old.count if old else 0))
    return merged


def _count_sites(jaxpr: Any, tag: Hashable) -> dict[Key, SiteInfo]:
    out: dict[Key, SiteInfo] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            p = eqn.params
            # a primal occurrence (in a jax.grad the program runs, its path
            # is primal at that level), not a derivative copy nor a recomputation
            if (p["tag"] == tag and all(level == PRIMAL for level in p.get("path", ()))
                    and not p.get("recompute")):
                _add_counts(out, {(*p["scopes"], p["name"]): SiteInfo(p["mode"], 1)})
            continue
        eqn = handled_as(eqn)  # (a `Scan3` counts as the scan it stands for)
        name = eqn.primitive.name
        subs = list(sub_jaxprs(eqn.params))
        if name == "cond":
            _add_counts(out, _count_branches(subs, tag))
        elif name == "scan":
            length = eqn.params.get("length", 2)
            for j in subs:
                _add_counts(out, _count_sites(j, tag), length if length <= 1 else math.inf)
        elif name == "while":
            for j in subs:
                _add_counts(out, _count_sites(j, tag), math.inf)
        else:
            for j in subs:
                _add_counts(out, _count_sites(j, tag))
    return out


def site_info(f: Callable, *args: Any, tag: Hashable) -> dict[Key, SiteInfo]:
    """Mode and per-run count of every unlabelled site of `tag` in `f`.

    Found by tracing `f` with `jax.make_jaxpr` (no harvest); sites in a scan
    of length > 1 or in a while loop count as sown infinitely often.
    """
    closed = jax.make_jaxpr(f)(*args)
    return _count_sites(closed.jaxpr, tag)


def default_keys(f: Callable, args: Sequence[Any], tag: Hashable, keys: Iterable[Key],
                 want: Callable[[SiteInfo], bool]) -> list[Key]:
    """The `keys` whose site `want` accepts (or that ``site_info`` does not know)."""
    try:
        info = site_info(f, *args, tag=tag)
    except Exception:  # noqa: BLE001 - no information: check every key
        info = {}
    return [k for k in keys if k not in info or want(info[k])]


# --- why a derivative key may be absent ----------------------------------------------

class Evidence:
    """Why a derivative key may be absent (docs/laws.md, "narrowed"): the
    site is a *constant* (its tangent is zero: JAX never differentiates it) or
    *dead* (the output does not depend on it: the derivative of
    ``p -> plant(f)({k: p}, x)`` is zero, so a linear/backward function built
    outside a harvest no longer contains it). Computed only when a key is
    missing, in forward mode (works for ``while_loop`` too) or, where there is
    none (``custom_vjp``), in reverse mode."""

    def __init__(self, f: Callable, args: Sequence[Any], tag: Hashable):
        self.f, self.args, self.tag = f, tuple(args), tag
        self._tan: dict | None = None
        self._values: dict | None = None

    def tangent(self, key: Key) -> Any:
        if self._tan is None:
            t = random_like(self.args, 11)
            self._tan = jax.jvp(lambda *a: reaped(self.f, self.tag, a), self.args, t)[1]
        return self._tan[key]

    def constant(self, key: Key) -> bool:
        try:
            return all_zero(self.tangent(key))
        except TypeError:  # no forward mode (a custom_vjp function): no evidence
            return False

    def dead(self, key: Key) -> bool:
        if self.constant(key):
            return True
        if self._values is None:
            self._values = reaped(self.f, self.tag, self.args)
        v = self._values[key]
        planted = lambda p: lh.plant(self.f, tag=self.tag)({key: p}, *self.args)  # noqa: E731
        try:
            return all_zero(jax.jvp(planted, (v,), (random_like(v, 13),))[1])
        except TypeError:  # no forward mode (a custom_vjp function): reverse mode
            out, bwd = jax.vjp(planted, v)
            return all_zero(bwd(random_like(out, 13))[0])
