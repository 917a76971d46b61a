"""Comparing what a harvest gave with what a law expects, and the failure messages.

Every failure is an ``AssertionError`` that starts with the law (see
``laws._law``), names the key and ends with the largest error, or
``(max error: n/a)`` where no number applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from lazyharvest.keys import Key, display, normalize

RTOL = 2e-4
ATOL = 2e-5


def max_error(got: Any, want: Any, rtol: float, atol: float) -> tuple[float, float]:
    """(max abs error, max excess over the tolerance) over a pytree."""
    worst, excess = 0.0, -math.inf
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype == jax.dtypes.float0 or w.dtype == jax.dtypes.float0:
            continue
        if g.size == 0:
            continue
        if not np.issubdtype(g.dtype, np.inexact):
            g, w = g.astype(np.float64), w.astype(np.float64)
        diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        diff = np.where(np.isnan(g) & np.isnan(w), 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        worst = max(worst, float(diff.max()))
        excess = max(excess, float((diff - (atol + rtol * np.abs(w))).max()))
    return worst, excess


def compare(law: str, key: Any, got: Any, want: Any, rtol: float, atol: float) -> None:
    """Fails unless `got` and `want` (pytrees; `key` None for an output) agree."""
    where = f"{law}: key {display(normalize(key)) if key is not None else '(output)'!r}"
    gs, gt = jax.tree_util.tree_flatten(got)
    ws, wt = jax.tree_util.tree_flatten(want)
    if gt != wt:  # type: ignore[operator]
        raise AssertionError(
            f"{where}: structures differ: got {gt}, want {wt} (max error: n/a)")
    for g, w in zip(gs, ws):
        if np.shape(g) != np.shape(w):
            raise AssertionError(f"{where}: shapes differ: got {np.shape(g)}, want "
                                 f"{np.shape(w)} (max error: n/a)")
    err, excess = max_error(gs, ws, rtol, atol)
    if excess > 0:
        raise AssertionError(
            f"{where}: max abs error {err:.3g} (rtol={rtol:g}, atol={atol:g})\n"
            f"  got:  {brief(got)}\n  want: {brief(want)}")


def same_keys(law: str, got: Iterable[Key], want: Iterable[Key]) -> None:
    got, want = list(got), list(want)
    only_got = [display(k) for k in got if k not in want]
    only_want = [display(k) for k in want if k not in got]
    if only_got or only_want:
        raise AssertionError(
            f"{law}: keys differ: only on the left {only_got}, only on the "
            f"right {only_want} (max error: n/a)")


def compare_dicts(law: str, got: Mapping, want: Mapping, rtol: float, atol: float) -> None:
    same_keys(law, got, want)
    for k in want:
        compare(law, k, got[k], want[k], rtol, atol)


def only_on_left(law: str, extra: list) -> None:
    """Fails if `extra` (keys as they should be shown) is not empty."""
    if extra:
        raise AssertionError(f"{law}: keys only on the left: {extra} (max error: n/a)")


def brief(x: Any) -> str:
    def one(a: Any) -> str:
        a = np.asarray(a)
        if a.size <= 12:
            return np.array2string(a, precision=5, separator=", ")
        return f"<{a.dtype}{list(a.shape)}>"
    return str(jax.tree_util.tree_map(one, x))


def guard(law: str, thunk: Callable[[], Any]) -> Any:
    """Runs one part of a check; a library exception becomes a law failure."""
    try:
        return thunk()
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - any error breaks the law
        raise AssertionError(f"{law}: raised {type(e).__name__}: {e} (max error: n/a)") from e


def missing(law: str, keys: Iterable[Key], why: Callable[[Key], bool], what: str,
            strict: bool) -> None:
    """Fails unless every missing key is excused by `why` (and not `strict`)."""
    keys = list(keys)
    if not keys:
        return
    bad = keys if strict else [k for k in keys if not guard(law, lambda k=k: why(k))]
    if bad:
        raise AssertionError(
            f"{law}: keys missing on the left: {[display(k) for k in bad]}"
            + ("" if strict else f" (not {what})") + " (max error: n/a)")
