"""Keys: how a site's identity becomes the tuple a user indexes with.

A site's raw identity is `(path, scopes, name)`, where `path` lists, innermost
first, what the site is at each differentiation level it went through
(`"primal"`, `"jvp"` for a tangent, `"vjp"` for a cotangent). Its key is
`(*labels, *scopes, name)`:

1. labels are the path without its `"primal"` entries;
2. a *linear function* (the function `jax.linearize` returns, or the backward
   function of `jax.vjp`) holds only tangent/cotangent copies at its outermost
   level, so that level's label is dropped: reaping it gives plain names
   (the law `reap∘linearize = linearize∘reap`);
3. when two sites would still share a key (nested differentiation: the
   tangent of the inner level vs the tangent of the outer one), those sites
   spell out every level, `"primal"` included, so each key is unique.
"""

from __future__ import annotations

from typing import Any, Iterable

from lazyharvest.primitive import JVP, PRIMAL, VJP

Key = tuple


def normalize(key: Any) -> Key:
    if isinstance(key, tuple):
        return key
    return (key,)


def display(key: Key) -> Any:
    """How a key is shown in `keys()`: a bare string for a one-part key."""
    return key[0] if len(key) == 1 else key


def assign(raw_keys: Iterable[tuple]) -> dict[tuple, Key]:
    """Maps each raw `(path, scopes, name)` to its user key (rules above)."""
    raw = list(raw_keys)
    paths = [p for p, _, _ in raw if p]
    linear = bool(paths) and all(p[-1] in (JVP, VJP) for p in paths)
    trimmed = {r: (r[0][:-1] if linear and r[0] else r[0]) for r in raw}
    short = {r: (*(x for x in trimmed[r] if x != PRIMAL), *r[1], r[2]) for r in raw}
    seen: dict[Key, int] = {}
    for k in short.values():
        seen[k] = seen.get(k, 0) + 1
    return {r: (short[r] if seen[short[r]] == 1 else (*trimmed[r], *r[1], r[2]))
            for r in raw}
