"""Keys: how a site's identity becomes the tuples a user indexes with.

A site's raw identity is `(path, scopes, name)`. `path` lists, innermost
first, what happened around the site:

* JAX's own differentiation levels, as strings: `"primal"` (the value at that
  level), `"jvp"` (its tangent), `"vjp"` (its cotangent);
* recorded transformations (`lh.grad`, `lh.vmap`, ...), as `Label`s: a
  differential one is *chosen* (apply it to the slice) or not (see through
  it); a structural one (`jit`, `vmap`) gives one value either way.

The keys of a site are `(*labels, *scopes, name)`:

1. labels are the path without `"primal"` and without unchosen labels;
   structural labels may be written or left out (those keys are aliases of
   one leaf);
2. a *linear function* (the function `jax.linearize` returns, or the backward
   function of `jax.vjp`) holds only tangent/cotangent copies at its outermost
   level, so that level's label is dropped: reaping it gives plain names
   (the law `reap∘linearize = linearize∘reap`);
3. when two sites would still share a key (nested differentiation: the
   tangent of the inner level vs the tangent of the outer one), those sites
   spell out every level: `"primal"` for JAX's, `"~grad"` for an unchosen
   recorded one, so each key is unique.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import attrs

Key = tuple

# JAX's differentiation levels, as they appear in a site's path.
PRIMAL, JVP, VJP = "primal", "jvp", "vjp"


@attrs.frozen
class Label:
    """A recorded transformation at one level of a site's path."""

    name: str
    chosen: bool
    structural: bool

    def spelled(self) -> str:
        return self.name if self.chosen or self.structural else "~" + self.name


def normalize(key: Any) -> Key:
    if isinstance(key, tuple):
        return key
    return (key,)


def display(key: Key) -> Any:
    """How a key is shown in `keys()`: a bare string for a one-part key."""
    return key[0] if len(key) == 1 else key


MAX_OPTIONAL_LABELS = 8
"""Past this many structural labels on one path, a leaf's aliases are only
its canonical key and the key that writes every label (not all 2**n)."""


def _options(x: Any, spelled: bool, structural_optional: bool | None) -> list[tuple]:
    """The ways one path entry may be written: `structural_optional` None
    leaves a structural label out, True allows both, False requires it."""
    if not isinstance(x, Label):
        return [(x,)] if spelled or x != PRIMAL else [()]
    if spelled:
        return [(x.spelled(),)]
    if x.structural:
        if structural_optional is None:
            return [()]
        return [(x.name,), ()] if structural_optional else [(x.name,)]
    return [(x.name,)] if x.chosen else [()]


def _alternatives(path: tuple, spelled: bool) -> list[tuple]:
    n_structural = sum(isinstance(x, Label) and x.structural for x in path)
    modes: list = [True] if n_structural <= MAX_OPTIONAL_LABELS else [False, None]
    out = []
    for mode in modes:
        options = [_options(x, spelled, mode) for x in path]
        out += [tuple(p for part in combo for p in part)
                for combo in itertools.product(*options)]
    return list(dict.fromkeys(out))


def assign(raw_keys: Iterable[tuple]) -> dict[tuple, list[Key]]:
    """Maps each raw `(path, scopes, name)` to its keys, canonical one first."""
    raw = list(raw_keys)
    paths = [p for p, _, _ in raw if p]
    linear = bool(paths) and all(
        not any(isinstance(x, Label) for x in p) and p[-1] in (JVP, VJP) for p in paths)
    trimmed = {r: (r[0][:-1] if linear and r[0] else r[0]) for r in raw}
    short = {r: list(dict.fromkeys((*labels, *r[1], r[2])
                                   for labels in _alternatives(trimmed[r], False)))
             for r in raw}
    count: dict[Key, int] = {}
    for ks in short.values():
        for k in ks:
            count[k] = count.get(k, 0) + 1
    out = {}
    for r in raw:
        unique = [k for k in short[r] if count[k] == 1]
        out[r] = unique or [(*labels, *r[1], r[2])
                            for labels in _alternatives(trimmed[r], True)]
    return _separate(out, trimmed)


SEPARATOR = "|"
"""Stands between the labels and the scopes of a key when scopes or names
spelled like labels would otherwise make two sites share one."""


def _separate(out: dict, trimmed: dict) -> dict:
    """Every key names one site: a key still shared (a scope called "vjp"
    next to a cotangent) is dropped from the sites sharing it, and a site left
    without a key gets the spelled key with `SEPARATOR` after its labels."""
    owners: dict[Key, list] = {}
    for r, ks in out.items():
        for k in ks:
            owners.setdefault(k, []).append(r)
    shared = {k for k, rs in owners.items() if len(rs) > 1}
    if not shared:
        return out
    for r in out:
        kept = [k for k in out[r] if k not in shared]
        out[r] = kept or [(*labels, SEPARATOR, *r[1], r[2])
                          for labels in _alternatives(trimmed[r], True)]
    return out
