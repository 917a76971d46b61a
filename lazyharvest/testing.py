"""The laws of harvesting, as checkers anyone can run, and random programs.

Two halves:

* **Law checkers.** ``check_<law>(f, *args, tag=..., rtol=..., atol=...)``
  checks one law of ``docs/laws.md`` on one function and one set of inputs,
  and raises an ``AssertionError`` that names the law, the key and the
  largest error when the law does not hold. ``check_all`` runs every law that
  applies to ``f``. They need JAX and lazyharvest only::

      from lazyharvest.testing import check_all
      check_all(model, params, x, tag="intermediates")

* **Random programs** (needs ``hypothesis``). ``programs()`` draws random JAX
  programs with sites: elementwise, linear and reduction ops, pytrees in and
  out, sites in several ``lh.nest`` scopes, and ``jax.jit``,
  ``jax.checkpoint``, ``lax.scan`` (append and clobber sites), ``lax.cond`` /
  ``lax.switch`` (matching sites) and ``lax.while_loop`` (clobber sites)
  blocks. Each drawn ``Program`` is one description from which three things
  are built: the function with sites (``Program.fn``), the slice of every
  site written with JAX alone (``Program.slices``), and the program with
  sites replaced or perturbed (``Program.plant`` / ``Program.perturb``), so
  expected values never come from lazyharvest itself.
  ``transform_stacks(program)`` draws stacks of recorded transforms
  (``lh.grad``, ``lh.jacfwd``, ``lh.jacrev``, ``lh.vmap``, ``lh.jit``) and
  ``inputs(program, stack)`` draws matching arguments.

Keys are tuples ``(*labels, *scopes, name)`` (a bare string ``"x"`` means
``("x",)``); every checker compares flat dicts keyed by such tuples.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lazyharvest as lh
from lazyharvest._interpreter import sub_jaxprs
from lazyharvest.primitive import sow_p

__all__ = [
    "CONSTRUCTS", "LAWS", "Key", "LawReport", "Program", "SiteInfo", "Stack",
    "Transform", "check_all", "check_compute", "check_jit", "check_jvp",
    "check_lazy", "check_linearize", "check_nest", "check_roundtrip", "check_vjp",
    "check_vmap", "inputs", "programs", "site_info", "split_labels",
    "transform_stacks",
]

Key = tuple  # (*labels, *scopes, name)

RTOL = 2e-4
ATOL = 2e-5

#: The labels a key may start with (SPEC 1 and 3).
LABELS = frozenset({
    "primal", "jvp", "vjp", "grad", "value_and_grad", "jacfwd", "jacrev",
    "hessian", "vmap", "jit", "linearize",
})

#: Law number -> (short name, statement).
LAWS: dict[int, tuple[str, str]] = {
    1: ("linearize", "reap∘linearize = linearize∘reap"),
    2: ("jvp", "reap∘jvp = jvp∘reap (tangent keys)"),
    3: ("vmap", "reap∘lh.vmap = lh.vmap∘reap"),
    4: ("jit", "reap∘jit = reap"),
    5: ("vjp", "reap∘vjp = vjp∘reap through planting"),
    6: ("roundtrip", "plant(f)(reap(f)(x), x) = f(x)"),
    7: ("lazy", "every lazy leaf = its direct definition in JAX alone"),
    8: ("compute", "compute(keys) = forcing one by one"),
    9: ("nest", "reap(nest(f, s)) = {s: reap(f)}"),
}


# =============================================================================
# Comparing
# =============================================================================

def _law(n: int, part: str = "") -> str:
    stmt = LAWS[n][1]
    return f"law {n} ({stmt}{'; ' + part if part else ''})"


def _norm(key: Any) -> Key:
    return key if isinstance(key, tuple) else (key,)


def _show(key: Key) -> Any:
    return key[0] if len(key) == 1 else key


def _as_np(x: Any) -> np.ndarray:
    return np.asarray(x)


def _max_error(got: Any, want: Any, rtol: float, atol: float) -> tuple[float, float]:
    """(max abs error, max excess over the tolerance) over a pytree."""
    worst, excess = 0.0, -math.inf
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = _as_np(g), _as_np(w)
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


def _compare(law: str, key: Any, got: Any, want: Any, rtol: float, atol: float) -> None:
    where = f"{law}: key {_show(_norm(key)) if key is not None else '(output)'!r}"
    gs, gt = jax.tree_util.tree_flatten(got)
    ws, wt = jax.tree_util.tree_flatten(want)
    if gt != wt:
        raise AssertionError(
            f"{where}: structures differ: got {gt}, want {wt} (max error: n/a)")
    for g, w in zip(gs, ws):
        if np.shape(g) != np.shape(w):
            raise AssertionError(f"{where}: shapes differ: got {np.shape(g)}, want "
                                 f"{np.shape(w)} (max error: n/a)")
    err, excess = _max_error(gs, ws, rtol, atol)
    if excess > 0:
        raise AssertionError(
            f"{where}: max abs error {err:.3g} (rtol={rtol:g}, atol={atol:g})\n"
            f"  got:  {_brief(got)}\n  want: {_brief(want)}")


def _same_keys(law: str, got: Iterable[Key], want: Iterable[Key]) -> None:
    got, want = list(got), list(want)
    only_got = [_show(k) for k in got if k not in want]
    only_want = [_show(k) for k in want if k not in got]
    if only_got or only_want:
        raise AssertionError(
            f"{law}: keys differ: only on the left {only_got}, only on the "
            f"right {only_want} (max error: n/a)")


def _compare_dicts(law: str, got: Mapping, want: Mapping, rtol: float, atol: float) -> None:
    _same_keys(law, got, want)
    for k in want:
        _compare(law, k, got[k], want[k], rtol, atol)


def _brief(x: Any) -> str:
    def one(a: Any) -> str:
        a = _as_np(a)
        if a.size <= 12:
            return np.array2string(a, precision=5, separator=", ")
        return f"<{a.dtype}{list(a.shape)}>"
    return str(jax.tree_util.tree_map(one, x))


def _guard(law: str, thunk: Callable[[], Any]) -> Any:
    """Runs one part of a check; a library exception becomes a law failure."""
    try:
        return thunk()
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - any error breaks the law
        raise AssertionError(f"{law}: raised {type(e).__name__}: {e} (max error: n/a)") from e


# =============================================================================
# Helpers on keys and reaped dicts
# =============================================================================

def split_labels(key: Key) -> tuple[tuple, tuple]:
    """(labels, rest) of a key: its leading parts that are transform labels.

    A scope or name spelled like a label would be taken for one; the checkers
    assume scopes and names are not label words.
    """
    key = _norm(key)
    n = 0
    while n < len(key) - 1 and key[n] in LABELS:
        n += 1
    return key[:n], key[n:]


def _get_nested(tree: Mapping, key: Key) -> Any:
    node: Any = tree
    for part in key:
        node = node[part]
    return node


def _flat(d: Any) -> dict[Key, Any]:
    """A DelayedDict forced in one program, as a flat {key tuple: value} dict."""
    nested = d.compute()
    return {_norm(k): _get_nested(nested, _norm(k)) for k in d.keys()}


def _reaped(f: Callable, tag: Hashable, args: Sequence[Any]) -> dict[Key, Any]:
    return _flat(lh.reap(f, tag=tag)(*args))


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _random_like(tree: Any, seed: int, scale: float = 1.0) -> Any:
    """Random values shaped like `tree` (float0 zeros for non-float leaves)."""
    rng = np.random.RandomState(seed)

    def one(x: Any) -> Any:
        shape, dtype = np.shape(x), jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.inexact):
            return np.zeros(shape, jax.dtypes.float0)
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)
    return jax.tree_util.tree_map(one, tree)


def _zeros_like_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.zeros(np.shape(x), jnp.result_type(x)), tree)


def _float_leaves(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(_is_float(x) for x in leaves)


# =============================================================================
# What the jaxpr says about the sites: mode and how often each is sown
# =============================================================================

@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """Mode of a site and how many times one run sows it (inf: in a loop)."""

    mode: str
    count: float

    @property
    def once(self) -> bool:
        return self.count == 1


def _count_sites(jaxpr: Any, tag: Hashable) -> dict[Key, SiteInfo]:
    out: dict[Key, SiteInfo] = {}

    def add(table: Mapping[Key, SiteInfo], times: float = 1) -> None:
        for k, info in table.items():
            old = out.get(k)
            n = 0 if info.count == 0 or times == 0 else info.count * times
            out[k] = SiteInfo(info.mode, n + (old.count if old else 0))

    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            p = eqn.params
            if p["tag"] == tag and not p.get("path"):
                add({(*p["scopes"], p["name"]): SiteInfo(p["mode"], 1)})
            continue
        name = eqn.primitive.name
        subs = list(sub_jaxprs(eqn.params))
        if name == "cond":
            merged: dict[Key, SiteInfo] = {}
            for table in (_count_sites(j, tag) for j in subs):
                for k, info in table.items():
                    old = merged.get(k)
                    merged[k] = SiteInfo(info.mode, max(info.count, old.count if old else 0))
            add(merged)
        elif name == "scan":
            length = eqn.params.get("length", 2)
            for j in subs:
                add(_count_sites(j, tag), length if length <= 1 else math.inf)
        elif name == "while":
            for j in subs:
                add(_count_sites(j, tag), math.inf)
        else:
            for j in subs:
                add(_count_sites(j, tag))
    return out


def site_info(f: Callable, *args: Any, tag: Hashable) -> dict[Key, SiteInfo]:
    """Mode and per-run count of every unlabelled site of `tag` in `f`.

    Found by tracing `f` with `jax.make_jaxpr` (no harvest); sites in a scan
    of length > 1 or in a while loop count as sown infinitely often.
    """
    closed = jax.make_jaxpr(f)(*args)
    return _count_sites(closed.jaxpr, tag)


def _default_keys(f: Callable, args: Sequence[Any], tag: Hashable, keys: Iterable[Key],
                  want: Callable[[SiteInfo], bool]) -> list[Key]:
    try:
        info = site_info(f, *args, tag=tag)
    except Exception:  # noqa: BLE001 - no information: check every key
        info = {}
    return [k for k in keys if k not in info or want(info[k])]


# =============================================================================
# The law checkers
# =============================================================================

def _all_zero(x: Any) -> bool:
    for leaf in jax.tree_util.tree_leaves(x):
        a = _as_np(leaf)
        if a.dtype != jax.dtypes.float0 and np.any(a != 0):
            return False
    return True


class _Evidence:
    """Evidence that an absent derivative key is one the narrowed laws allow
    (docs/laws.md: a constant site inside ``jax.checkpoint``): the site's
    tangent is zero, or the derivative of ``p -> plant(f)({k: p}, x)`` is zero.
    Computed only when a key is missing, in forward mode (works for
    ``while_loop`` too). ``strict_keys=True`` accepts no evidence."""

    def __init__(self, f: Callable, args: Sequence[Any], tag: Hashable):
        self.f, self.args, self.tag = f, tuple(args), tag
        self._tan: dict | None = None
        self._values: dict | None = None

    def tangent(self, key: Key) -> Any:
        if self._tan is None:
            t = _random_like(self.args, 11)
            self._tan = jax.jvp(lambda *a: _reaped(self.f, self.tag, a), self.args, t)[1]
        return self._tan[key]

    def constant(self, key: Key) -> bool:
        return _all_zero(self.tangent(key))

    def dead(self, key: Key) -> bool:
        if self.constant(key):
            return True
        if self._values is None:
            self._values = _reaped(self.f, self.tag, self.args)
        v = self._values[key]
        planted = lambda p: lh.plant(self.f, tag=self.tag)({key: p}, *self.args)  # noqa: E731
        return _all_zero(jax.jvp(planted, (v,), (_random_like(v, 13),))[1])


def _missing(law: str, missing: Iterable[Key], why: Callable[[Key], bool], what: str,
             strict: bool) -> None:
    """Fails unless every missing key is excused by `why` (and not `strict`)."""
    missing = list(missing)
    if not missing:
        return
    bad = missing if strict else [k for k in missing if not _guard(law, lambda k=k: why(k))]
    if bad:
        raise AssertionError(
            f"{law}: keys missing on the left: {[_show(k) for k in bad]}"
            + ("" if strict else f" (not {what})") + " (max error: n/a)")


def _split_linear(got: Mapping[Key, Any]) -> tuple[dict, dict]:
    """(tangents, values) of a reaped linear function, keyed by plain keys.

    Normally its keys are plain and hold tangents. When the function holds a
    primal computation too (``jax.linearize`` of a ``lax.while_loop`` puts the
    whole loop in it), its keys are those of ``jax.jvp``: ``("jvp", *k)`` for
    the tangents, ``k`` for the values of the sites that run there.
    """
    if not any(k[:1] == ("jvp",) and len(k) > 1 for k in got):
        return dict(got), {}
    tangents = {k[1:]: v for k, v in got.items() if k[:1] == ("jvp",) and len(k) > 1}
    values = {k: v for k, v in got.items() if not (k[:1] == ("jvp",) and len(k) > 1)}
    return tangents, values


def check_linearize(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                    atol: float = ATOL, tangents: Any = None,
                    strict_keys: bool = False) -> None:
    """Law 1: ``reap(linearize(f, *args)[1])(t) == linearize(reap(f), *args)[1](t)``.

    Left: the reaped linear function, a dict ``{(*scopes, name): tangent}``
    (plain names). Right: the linear map of ``x -> reap(f)(x).compute()``.
    Every tangent on the left must be on the right with the same value. A key
    of the right may be missing on the left only for a site whose tangent is
    zero or whose plant does not reach the output (docs/laws.md narrows the law
    for constant sites inside ``jax.checkpoint``);
    when ``f`` runs a ``while_loop`` the left has ``jax.jvp``'s keys instead
    (tangents under ``("jvp", *k)``, values of the loop's sites under ``k``,
    equal to ``reap(f)``'s), see docs/laws.md. ``strict_keys=True`` checks the
    law as SPEC states it.
    """
    law = _law(1)
    t = _random_like(args, 1) if tangents is None else tangents

    def left() -> dict:
        _, lin = jax.linearize(f, *args)
        return _reaped(lin, tag, t)

    def right() -> dict:
        _, lin = jax.linearize(lambda *a: _reaped(f, tag, a), *args)
        return lin(*t)
    got = _guard(law, left)
    want = _guard(law, right)
    got_t, got_v = (dict(got), {}) if strict_keys else _split_linear(got)
    extra = [_show(k) for k in got_t if k not in want]
    if extra:
        raise AssertionError(f"{law}: keys only on the left: {extra} (max error: n/a)")
    ev = _Evidence(f, args, tag)
    _missing(law, [k for k in want if k not in got_t], ev.dead, "constant or dead sites",
             strict_keys)
    for k in got_t:
        _compare(law, k, got_t[k], want[k], rtol, atol)
    if got_v:
        values = _guard(law, lambda: _reaped(f, tag, args))
        extra = [_show(k) for k in got_v if k not in values]
        if extra:
            raise AssertionError(f"{law}: keys only on the left: {extra} (max error: n/a)")
        for k, v in got_v.items():
            _compare(_law(1, "values in the linear function"), k, v, values[k], rtol, atol)


def _tangent_key(key: Key) -> Key:
    labels, rest = split_labels(key)
    return (*labels, "jvp", *rest)


def check_jvp(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, tangents: Any = None, strict_keys: bool = False) -> None:
    """Law 2: reaping ``jvp(f)`` gives ``jvp(reap(f))``: values and tangents.

    Left: ``reap(lambda *x: jax.jvp(f, x, t))(*args)``, keys ``k`` and
    ``("jvp", *k)``. Right: ``jax.jvp(lambda *x: reap(f)(*x).compute(), args, t)``
    as ``(values, tangents)``; the tangent of key ``k`` is expected under
    ``("jvp", *k)`` (after ``k``'s labels, if any). A tangent key may be
    missing only where the tangent is zero (constant sites have their zero
    tangent key, docs/laws.md); ``strict_keys=True`` requires every one.
    """
    law = _law(2)
    t = _random_like(args, 2) if tangents is None else tangents
    got = _guard(law, lambda: _reaped(lambda *a: jax.jvp(f, a, t), tag, args))
    primals, tans = _guard(law, lambda: jax.jvp(lambda *a: _reaped(f, tag, a), tuple(args), t))
    want = dict(primals)
    want.update({_tangent_key(k): v for k, v in tans.items()})
    extra = [_show(k) for k in got if k not in want]
    if extra:
        raise AssertionError(f"{law}: keys only on the left: {extra} (max error: n/a)")
    _missing(law, [k for k in primals if k not in got], lambda k: False, "", True)
    _missing(law, [k for k in want if k not in got], lambda k: _all_zero(want[k]),
             "zero tangents (constant sites)", strict_keys)
    for k in got:
        _compare(law, k, got[k], want[k], rtol, atol)


def check_vmap(f: Callable, *args: Any, tag: Hashable, in_axes: Any = 0,
               out_axes: Any = 0, rtol: float = RTOL, atol: float = ATOL,
               vmap: Callable | None = None) -> None:
    """Law 3: ``reap(lh.vmap(f, in_axes, out_axes)) == vmap(reap(f), in_axes, a)``.

    ``args`` are the batched inputs. ``a`` is ``out_axes`` when it is an
    integer and 0 for a pytree ``out_axes`` (SPEC 3.3). Every plain key of
    ``reap(f)`` must be present on the left (structural labels are seen
    through) with the batched value; so must the function's output.
    """
    law = _law(3)
    vmap = lh.vmap if vmap is None else vmap
    site_axes = out_axes if isinstance(out_axes, int) else 0
    batched = vmap(f, in_axes=in_axes, out_axes=out_axes)
    want = _guard(law, lambda: jax.vmap(lambda *a: _reaped(f, tag, a), in_axes=in_axes,
                                        out_axes=site_axes)(*args))
    out, d = _guard(law, lambda: lh.call_and_reap(batched, tag=tag)(*args))
    _compare(law, None, out, jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(*args),
             rtol, atol)
    for k, v in want.items():
        _compare(law, k, _guard(law, lambda: d[k]), v, rtol, atol)
        vk = ("vmap", *k)
        if vk in d:
            _compare(law, vk, _guard(law, lambda: d[vk]), v, rtol, atol)


def check_jit(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, jit: Callable | None = None) -> None:
    """Law 4: ``reap(jit(f))(x) == reap(f)(x)``, and ``jit(reap(f))`` too.

    ``jit`` defaults to ``jax.jit``; pass ``lh.jit`` to check the recorded
    one (its plain keys are compared; structural labels are aliases).
    """
    law = _law(4)
    jit = jax.jit if jit is None else jit
    want = _guard(law, lambda: _reaped(f, tag, args))
    d = _guard(law, lambda: lh.reap(jit(f), tag=tag)(*args))
    _same_keys(_law(4, "reap(jit(f))"),
               [k for k in map(_norm, d.keys()) if not split_labels(k)[0]], want)
    for k, v in want.items():
        _compare(_law(4, "reap(jit(f))"), k, _guard(law, lambda: d[k]), v, rtol, atol)
    staged = _guard(law, lambda: jax.jit(lambda *a: _reaped(f, tag, a))(*args))
    _compare_dicts(_law(4, "jit(reap(f))"), staged, want, rtol, atol)


def check_vjp(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, keys: Iterable[Any] | None = None,
              plant_keys: Iterable[Any] | None = None, cotangent: Any = None,
              strict_keys: bool = False) -> None:
    """Law 5: ``reap∘vjp = vjp∘reap`` through planting (SPEC 5.5).

    With ``bwd = jax.vjp(f, *args)[1]`` and a random ``ct_out``:

    (b) ``reap(bwd)(ct_out)`` has every key of ``reap(f)`` (a key may be
        missing where the tangent is zero or the plant does not reach the
        output: docs/laws.md narrows the law for constant sites inside
        ``jax.checkpoint``; all of them with ``strict_keys``) and,
        for ``k`` in ``keys``, equals ``grad_p <ct_out, plant(f)({k: p}, x)>``
        at ``p = reap(f)(x)[k]``. Default ``keys``: the sites sown exactly
        once per run (for a site sown several times the plant gradient is a
        partial derivative, the cotangent a total one).
    (a) The VJP of ``x -> (f(x), reap(f)(x))`` fed ``(ct_out, ct_sites)``
        equals ``plant(bwd)(ct_sites, ct_out)``: the backward function with
        the site cotangents planted (added). ``plant_keys``: the sites given
        a cotangent; default every key of ``reap(bwd)``.
    """
    law_a, law_b = _law(5, "(a) VJP of call_and_reap"), _law(5, "(b) reap of backward")
    values = _guard(law_a, lambda: _reaped(f, tag, args))
    out = _guard(law_a, lambda: f(*args))
    ct_out = _random_like(out, 5) if cotangent is None else cotangent
    labelled = [k for k in values if split_labels(k)[0]]
    if labelled:
        raise ValueError(f"check_vjp: f's keys carry labels {labelled}; law 5 is "
                         f"stated for functions that do not differentiate inside.")

    # (b)
    bwd = _guard(law_b, lambda: jax.vjp(f, *args)[1])
    got_b = _guard(law_b, lambda: _reaped(bwd, tag, (ct_out,)))
    extra = [_show(k) for k in got_b if k not in values]
    if extra:
        raise AssertionError(f"{law_b}: keys only on the left: {extra} (max error: n/a)")
    ev = _Evidence(f, args, tag)
    _missing(law_b, [k for k in values if k not in got_b], ev.dead, "constant or dead sites",
             strict_keys)
    if keys is None:
        keys = _default_keys(f, args, tag, values, lambda i: i.once)
    for k in map(_norm, keys):
        def grad_plant(k: Key = k) -> Any:
            planted = lambda p: lh.plant(f, tag=tag)({k: p}, *args)  # noqa: E731
            return jax.vjp(planted, values[k])[1](ct_out)[0]
        if k in got_b:  # a missing key was excused above
            _compare(law_b, k, got_b[k], _guard(law_b, grad_plant), rtol, atol)

    # (a)
    plant_keys = list(got_b) if plant_keys is None else [_norm(k) for k in plant_keys]
    ct_sites = {k: _random_like(values[k], 50 + i) for i, k in enumerate(plant_keys)}

    def left_a() -> Any:
        def out_and_sites(*a: Any) -> Any:
            o, d = lh.call_and_reap(f, tag=tag)(*a)
            return o, _flat(d)
        (_, sites), full_vjp = jax.vjp(out_and_sites, *args)
        cts = {k: ct_sites.get(k, _zeros_like_tree(v)) for k, v in sites.items()}
        return full_vjp((ct_out, cts))

    got = _guard(law_a, left_a)
    want = _guard(law_a, lambda: lh.plant(bwd, tag=tag)(ct_sites, ct_out))
    _compare(law_a, None, got, want, rtol, atol)


def check_roundtrip(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                    atol: float = ATOL, keys: Iterable[Any] | None = None) -> None:
    """Law 6: ``plant(f)(reap(f)(x), x) == f(x)``, and harvest keeps the rest.

    Plants the reaped values of ``keys`` (default: every key except
    cotangent keys, which plant additively, and clobber sites sown more than
    once, whose plant replaces every sow). Also checks that
    ``harvest(f)(half, x)`` returns ``f(x)`` and reaps every other key with
    its value.
    """
    law = _law(6)
    values = _guard(law, lambda: _reaped(f, tag, args))
    if keys is None:
        keys = _default_keys(f, args, tag, values,
                             lambda i: not (i.mode == "clobber" and i.count > 1))
        keys = [k for k in keys if "vjp" not in split_labels(k)[0]]
    keys = [_norm(k) for k in keys]
    want = _guard(law, lambda: f(*args))
    got = _guard(law, lambda: lh.plant(f, tag=tag)({k: values[k] for k in keys}, *args))
    _compare(_law(6, "plant"), None, got, want, rtol, atol)
    half = keys[::2]
    out, d = _guard(law, lambda: lh.harvest(f, tag=tag)({k: values[k] for k in half}, *args))
    _compare(_law(6, "harvest output"), None, out, want, rtol, atol)
    rest = {k: v for k, v in values.items() if k not in half}
    _compare_dicts(_law(6, "harvest reaps the unplanted sites"),
                   _guard(law, lambda: _flat(d)), rest, rtol, atol)


def check_compute(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                  atol: float = ATOL) -> None:
    """Law 8: ``d.compute(*keys)`` equals forcing the leaves one by one.

    Also: a sub-set and every prefix sub-view computes the same values, and
    ``d.thunk(*k)()`` / ``d.fn(*k)(*args)`` agree with ``d[k]``.
    """
    law = _law(8)
    one = _guard(law, lambda: lh.reap(f, tag=tag)(*args))
    by_one = {_norm(k): _guard(law, lambda k=k: one[k]) for k in list(one.keys())}
    together = _guard(law, lambda: _reaped(f, tag, args))
    _compare_dicts(_law(8, "compute()"), together, by_one, rtol, atol)
    keys = list(by_one)
    if len(keys) >= 2:
        some = [keys[0], keys[-1]]
        d = _guard(law, lambda: lh.reap(f, tag=tag)(*args))
        nested = _guard(law, lambda: d.compute(*map(_show, some)))
        for k in some:
            _compare(_law(8, "compute(k1, k2)"), k, _get_nested(nested, k), by_one[k],
                     rtol, atol)
    prefixes = {k[:i] for k in keys for i in range(1, len(k))}
    for pre in sorted(prefixes, key=len)[:4]:
        d = _guard(law, lambda: lh.reap(f, tag=tag)(*args))
        sub = _guard(law, lambda: d[_show(pre)])
        nested = _guard(law, lambda: sub.compute())
        for k in keys:
            if k[:len(pre)] == pre:
                _compare(_law(8, f"sub-view {pre!r}"), k, _get_nested(nested, k[len(pre):]),
                         by_one[k], rtol, atol)
    d = lh.reap(f, tag=tag)(*args)
    for k in keys[:3]:
        _compare(_law(8, "thunk"), k, _guard(law, lambda: d.thunk(*k)()), by_one[k], rtol, atol)
        _compare(_law(8, "fn"), k, _guard(law, lambda: d.fn(*k)(*args)), by_one[k], rtol, atol)


def _insert_scope(key: Key, scope: str) -> Key:
    labels, rest = split_labels(key)
    return (*labels, scope, *rest)


def check_nest(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
               atol: float = ATOL, scope: str = "law9") -> None:
    """Law 9: ``reap(nest(f, s)) == {s: reap(f)}``.

    Every key ``(*labels, *scopes, name)`` becomes ``(*labels, s, *scopes,
    name)`` with the same value; ``d[s]`` is a sub-view equal to
    ``reap(f)`` (for unlabelled keys); the output is unchanged; and planting
    ``{s: plants}`` into ``nest(f, s)`` equals planting ``plants`` into ``f``.
    """
    law = _law(9)
    plain = _guard(law, lambda: _reaped(f, tag, args))
    nested_f = lh.nest(f, scope=scope)
    out, d = _guard(law, lambda: lh.call_and_reap(nested_f, tag=tag)(*args))
    _compare(_law(9, "output"), None, out, f(*args), rtol, atol)
    got = _guard(law, lambda: _flat(d))
    want = {_insert_scope(k, scope): v for k, v in plain.items()}
    _compare_dicts(law, got, want, rtol, atol)
    unlabelled = {k: v for k, v in plain.items() if not split_labels(k)[0]}
    if unlabelled:
        sub = _guard(law, lambda: _flat(d[scope]))
        sub = {k: v for k, v in sub.items() if not split_labels(k)[0]}
        _compare_dicts(_law(9, f"sub-view d[{scope!r}]"), sub, unlabelled, rtol, atol)
        plants = {k: jax.tree_util.tree_map(
            lambda v: v * 0.5 + 0.25 if _is_float(v) else v, v) for k, v in unlabelled.items()}
        want_out = _guard(law, lambda: lh.plant(f, tag=tag)(plants, *args))
        got_out = _guard(law, lambda: lh.plant(nested_f, tag=tag)({scope: plants}, *args))
        _compare(_law(9, "plant"), None, got_out, want_out, rtol, atol)


# --- law 7 --------------------------------------------------------------------

def check_lazy(f: Callable, *args: Any, tag: Hashable, slices: Mapping[Any, Callable],
               perturb: Callable | None = None, stack: Stack | None = None,
               forward: bool = True, linear: bool = True, rtol: float = RTOL,
               atol: float = ATOL, tangents: Any = None, cotangent: Any = None,
               strict_keys: bool = False) -> None:
    """Law 7: every lazy leaf equals its direct definition, written with JAX alone.

    ``slices[k](*args)`` computes site ``k``'s value with JAX alone (no sow).
    ``perturb(eps, *args)`` (optional) is ``f`` with ``eps[k]`` added to the
    value of every site ``k`` (for an append site, one row per sow; for a
    clobber site, to the sow whose value is reaped).

    Parts, each compared leaf by leaf (``d[key]``, the lazy path):

    * plain: ``reap(f)(x)[k] == slices[k](x)``, and the key sets agree;
    * jvp (``forward``): ``reap(x -> jvp(f, x, t))(x)["jvp", *k] ==
      jvp(slices[k], x, t)[1]``; with ``linear`` also
      ``reap(linearize(f, x)[1])(t)[k]`` equals it;
    * vjp (``perturb`` given): ``reap(x -> vjp(f, x)[1](ct))(x)["vjp", *k]``
      equals the cotangent ``vjp(eps -> perturb(eps, x), 0)[1](ct)[k]`` (and
      its key ``k`` the value ``slices[k](x)``);
      with ``linear`` also ``reap(vjp(f, x)[1])(ct)[k]``;
    * with ``stack`` (recorded transforms) *instead*: ``args`` are the inputs
      of ``stack.apply(f)`` and ``reap(stack.apply(f))(x)[(*labels, *k)] ==
      stack.expected(slices[k], mask)(x)`` for every key of
      ``Stack.key_labels`` (SPEC 3.3); the other parts are not run.

    A derivative key may be missing only where the tangent (or, for the
    linear/backward functions, the cotangent) is zero, as docs/laws.md narrows
    SPEC for constant sites inside ``jax.checkpoint``; ``strict_keys=True``
    requires every key.
    """
    slices = {_norm(k): s for k, s in slices.items()}
    if stack is not None:
        law = _law(7, f"recorded transforms {stack}")
        d = _guard(law, lambda: lh.reap(stack.apply(f), tag=tag)(*args))
        for mask, labels in stack.key_labels():
            for k, s in slices.items():
                value = _guard(law, lambda s=s: stack.expected(s, mask)(*args))
                key = (*labels, *k)
                _compare(law, key, _guard(law, lambda: d[key]), value, rtol, atol)
        return

    want = {k: _guard(_law(7, "slice"), lambda s=s: s(*args)) for k, s in slices.items()}
    law = _law(7, "plain keys")
    d = _guard(law, lambda: lh.reap(f, tag=tag)(*args))
    _same_keys(law, map(_norm, d.keys()), want)
    for k in want:  # one leaf at a time: the lazy path
        _compare(law, k, _guard(law, lambda: d[k]), want[k], rtol, atol)

    def leaves(law: str, d: Any, keys: Mapping[Key, Key], expected: Mapping[Key, Any],
               excuse: Callable[[Key], bool], what: str) -> None:
        present = {_norm(k) for k in d.keys()}
        _missing(law, [k for k, dk in keys.items() if dk not in present], excuse, what,
                 strict_keys)
        for k, dk in keys.items():
            if dk in present:
                _compare(law, dk, _guard(law, lambda: d[dk]), expected[k], rtol, atol)

    tan: dict = {}
    if forward:
        law = _law(7, "jvp keys")
        t = _random_like(args, 7) if tangents is None else tangents
        tan = {k: _guard(law, lambda s=s: jax.jvp(s, tuple(args), t)[1])
               for k, s in slices.items()}
        d = _guard(law, lambda: lh.reap(lambda *a: jax.jvp(f, a, t), tag=tag)(*args))
        leaves(law, d, {k: k for k in slices}, want, lambda k: False, "")
        leaves(law, d, {k: ("jvp", *k) for k in slices}, tan,
               lambda k: _all_zero(tan[k]), "constant sites")

    ct_sites: dict = {}
    if perturb is not None:
        law = _law(7, "vjp keys")
        ct = _random_like(jax.eval_shape(f, *args), 8) if cotangent is None else cotangent
        eps0 = {k: _zeros_like_tree(v) for k, v in want.items()}
        ct_sites = _guard(law, lambda: jax.vjp(lambda e: perturb(e, *args), eps0)[1](ct)[0])
        d = _guard(law, lambda: lh.reap(lambda *a: jax.vjp(f, *a)[1](ct), tag=tag)(*args))
        constant = (lambda k: _all_zero(tan[k])) if forward else (lambda k: True)
        leaves(_law(7, "values under reverse mode"), d, {k: k for k in slices}, want,
               lambda k: False, "")
        leaves(law, d, {k: ("vjp", *k) for k in slices}, ct_sites, constant, "constant sites")
        if linear:
            law = _law(7, "reaped backward function")
            _, bwd = jax.vjp(f, *args)
            db = _guard(law, lambda: lh.reap(bwd, tag=tag)(ct))
            leaves(law, db, {k: k for k in slices}, ct_sites,
                   lambda k: constant(k) or _all_zero(ct_sites[k]), "constant or dead sites")

    if forward and linear:
        law = _law(7, "reaped linear function")
        _, lin = jax.linearize(f, *args)
        dl = _guard(law, lambda: lh.reap(lin, tag=tag)(*t))
        if perturb is not None:
            dead = lambda k: _all_zero(tan[k]) or _all_zero(ct_sites[k])  # noqa: E731
        else:
            ev = _Evidence(f, args, tag)
            dead = lambda k: _all_zero(tan[k]) or ev.dead(k)  # noqa: E731
        _, got_v = _split_linear({_norm(k): None for k in dl.keys()})
        if got_v and not strict_keys:  # a while_loop: jax.jvp's keys (law 1)
            leaves(law, dl, {k: k for k in got_v}, want, lambda k: False, "")
            leaves(law, dl, {k: ("jvp", *k) for k in slices}, tan, dead,
                   "constant or dead sites")
            return
        leaves(law, dl, {k: k for k in slices}, tan, dead, "constant or dead sites")
        extra = [k for k in map(_norm, dl.keys()) if k not in slices]
        if extra:
            raise AssertionError(f"{law}: keys only on the left: {extra} (max error: n/a)")


# --- everything ----------------------------------------------------------------

@dataclasses.dataclass
class LawReport:
    """What ``check_all`` did: law number -> "passed" or "skipped: why"."""

    results: dict[int, str]

    def passed(self) -> list[int]:
        return [n for n, r in self.results.items() if r == "passed"]

    def skipped(self) -> dict[int, str]:
        return {n: r for n, r in self.results.items() if r != "passed"}

    def __str__(self) -> str:
        return "\n".join(f"law {n} ({LAWS[n][1]}): {r}" for n, r in sorted(self.results.items()))


def _batched(args: Sequence[Any], in_axes: int) -> tuple:
    """Two examples of `args` stacked along a new axis `in_axes` (an int)."""
    if not isinstance(in_axes, int):
        raise ValueError("check_all: vmap_axes takes integer in_axes; call "
                         "check_vmap with batched inputs for other in_axes")

    def one(x: Any) -> Any:
        x = jnp.asarray(x)
        other = x * 0.75 + 0.125 if _is_float(x) else x
        return jnp.stack([x, other], axis=in_axes)
    return tuple(jax.tree_util.tree_map(one, a) for a in args)


def check_all(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL, atol: float = ATOL,
              slices: Mapping[Any, Callable] | None = None, perturb: Callable | None = None,
              vmap_axes: Sequence[tuple[Any, Any]] = ((0, 0), (0, -1)),
              scope: str = "law9", laws: Iterable[int] = tuple(LAWS)) -> LawReport:
    """Runs every law of docs/laws.md that applies to ``f`` at ``args``.

    Laws 1, 2 (forward mode) need floating inputs and outputs; law 5 needs
    ``f`` to be reverse-differentiable (no ``while_loop``); laws 1, 2, 5 need
    keys without labels (``f`` does not differentiate inside); law 3 needs
    ``lh.vmap`` and runs for each ``(in_axes, out_axes)`` in ``vmap_axes`` on
    two stacked copies of ``args``; law 7 needs ``slices`` (and ``perturb``
    for the cotangent keys). Every failing law is reported in one
    ``AssertionError``; otherwise a ``LawReport`` says what ran.
    """
    laws = set(laws)
    results: dict[int, str] = {}
    failures: list[str] = []
    kw = dict(tag=tag, rtol=rtol, atol=atol)

    try:
        keys = list(_reaped(f, tag, args))
        out_shape = jax.eval_shape(f, *args)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"check_all: reaping f failed: {type(e).__name__}: {e}") from e
    labelled = any(split_labels(k)[0] for k in keys)
    forward_ok = _float_leaves(args) and _float_leaves(out_shape)
    reverse_ok, why_not = forward_ok, "needs floating inputs and outputs"
    if forward_ok:
        try:
            ct = _random_like(out_shape, 0)
            jax.eval_shape(lambda *a: jax.vjp(f, *a)[1](ct), *args)
        except Exception as e:  # noqa: BLE001
            reverse_ok, why_not = False, f"f is not reverse-differentiable ({type(e).__name__})"

    def run(n: int, thunk: Callable[[], Any], skip: str | None = None) -> None:
        if n not in laws:
            return
        if skip:
            results[n] = f"skipped: {skip}"
            return
        try:
            thunk()
        except AssertionError as e:
            failures.append(str(e))
            results[n] = "failed"
        else:
            results[n] = "passed"

    label_skip = "keys carry labels (f differentiates inside)" if labelled else None
    run(1, lambda: check_linearize(f, *args, **kw),
        label_skip or (None if forward_ok else "needs floating inputs and outputs"))
    run(2, lambda: check_jvp(f, *args, **kw),
        label_skip or (None if forward_ok else "needs floating inputs and outputs"))
    vmap = getattr(lh, "vmap", None)

    def law3() -> None:
        for in_axes, out_axes in vmap_axes:
            bargs = _batched(args, in_axes)
            check_vmap(f, *bargs, in_axes=in_axes, out_axes=out_axes, **kw)
    run(3, law3, None if vmap is not None else "needs lh.vmap (recorded transforms)")
    run(4, lambda: check_jit(f, *args, **kw))
    run(5, lambda: check_vjp(f, *args, **kw), label_skip or (None if reverse_ok else why_not))
    run(6, lambda: check_roundtrip(f, *args, **kw))
    run(7, lambda: check_lazy(f, *args, slices=slices, forward=forward_ok,
                              perturb=perturb if reverse_ok else None, **kw),
        None if slices is not None else "needs slices= (the sites written with JAX alone)")
    run(8, lambda: check_compute(f, *args, **kw))
    run(9, lambda: check_nest(f, *args, scope=scope, **kw))
    if failures:
        raise AssertionError("\n\n".join(failures))
    return LawReport(results)


# =============================================================================
# Transform stacks (SPEC 3.3)
# =============================================================================

DIFFERENTIAL = ("grad", "jacfwd", "jacrev")
STRUCTURAL = ("vmap", "jit")


@dataclasses.dataclass(frozen=True)
class Transform:
    """One recorded transform: ``kind`` in grad/jacfwd/jacrev/vmap/jit."""

    kind: str
    in_axes: Any = 0
    out_axes: Any = 0

    def apply(self, f: Callable, lib: Any = None) -> Callable:
        fn = getattr(lh if lib is None else lib, self.kind)
        if self.kind == "vmap":
            return fn(f, in_axes=self.in_axes, out_axes=self.out_axes)
        return fn(f)

    def __str__(self) -> str:
        if self.kind == "vmap":
            return f"vmap(in_axes={self.in_axes!r}, out_axes={self.out_axes!r})"
        return self.kind


@dataclasses.dataclass(frozen=True)
class Stack:
    """Recorded transforms applied around a function, innermost first."""

    transforms: tuple[Transform, ...]

    def apply(self, f: Callable, lib: Any = None) -> Callable:
        for t in self.transforms:
            f = t.apply(f, lib)
        return f

    def key_labels(self) -> list[tuple[tuple[bool, ...], tuple[str, ...]]]:
        """(mask, labels) of the keys law 7 checks: every subset of the
        differential transforms (structural ones left out), plus every label
        spelled out. Label tuples two subsets share are left out (ambiguous)."""
        diff = [i for i, t in enumerate(self.transforms) if t.kind in DIFFERENTIAL]
        out: dict[tuple, set] = {}
        for r in range(len(diff) + 1):
            for chosen in itertools.combinations(diff, r):
                mask = tuple(i in chosen for i in range(len(self.transforms)))
                labels = tuple(self.transforms[i].kind for i in chosen)
                out.setdefault(labels, set()).add(mask)
        full = tuple(True for _ in self.transforms)
        out.setdefault(tuple(t.kind for t in self.transforms), set()).add(full)
        # masks differing only in structural positions choose the same leaf
        return [(min(masks), labels) for labels, masks in out.items()
                if len({tuple(m for m, t in zip(mask, self.transforms)
                              if t.kind in DIFFERENTIAL) for mask in masks}) == 1]

    def expected(self, slice_fn: Callable, mask: Sequence[bool]) -> Callable:
        """SPEC 3.3 with JAX alone: chosen differential transforms applied to
        the slice (``grad`` of a non-scalar slice is its Jacobian, like
        ``jacrev``), the others seen through; ``vmap`` and ``jit`` always
        applied (``vmap`` with the site out_axes: ``out_axes`` if an int, else 0)."""
        g = slice_fn
        for t, chosen in zip(self.transforms, mask):
            if t.kind == "vmap":
                g = jax.vmap(g, in_axes=t.in_axes,
                             out_axes=t.out_axes if isinstance(t.out_axes, int) else 0)
            elif t.kind == "jit":
                g = jax.jit(g)
            elif chosen:
                g = jax.jacfwd(g) if t.kind == "jacfwd" else jax.jacrev(g)
        return g

    def batch_dims(self, n_args: int) -> list[list[Any]]:
        """Per vmap, innermost first, the in_axes of each argument."""
        dims = []
        for t in self.transforms:
            if t.kind == "vmap":
                ax = t.in_axes
                dims.append(list(ax) if isinstance(ax, (tuple, list)) else [ax] * n_args)
        return dims

    def __str__(self) -> str:
        return "∘".join(str(t) for t in reversed(self.transforms)) or "identity"


# =============================================================================
# Random programs: the description
# =============================================================================

N = 3  # length of every vector (and of every scan)
B = 2  # batch size of every vmap

UNARY: dict[str, Callable[[Any], Any]] = {
    "sin": jnp.sin, "cos": jnp.cos, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus, "square": lambda v: 0.5 * v * v,
    "neg": lambda v: -v, "scale": lambda v: 1.5 * v, "shift": lambda v: v + 0.3,
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
}
REDUCE: dict[str, Callable[[Any], Any]] = {
    "sum": jnp.sum, "mean": jnp.mean, "logsumexp": jax.nn.logsumexp,
    "sqnorm": lambda v: 0.5 * jnp.sum(v * v),
}

#: Every construct the generator can produce (see ``Program.constructs``).
CONSTRUCTS = frozenset({
    "elementwise", "binary", "linear", "reduction", "site", "pytree_site",
    "constant", "scope", "nested_scope", "jit", "checkpoint", "scan",
    "scan_append", "scan_clobber", "reverse_scan", "nested_scan", "cond",
    "switch", "while", "while_never_runs", "pytree_in", "pytree_out",
    "scalar_out", "array_out",
    # derived from the program's data flow:
    "invariant_append_site",  # an append site whose value its scan does not change
    "cond_in_checkpoint",  # lax.cond / switch inside jax.checkpoint
})


def _matrix(seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).standard_normal((N, N)) / np.sqrt(N)).astype(np.float32)


def _constant(seed: int, shape: tuple) -> np.ndarray:
    return (np.random.RandomState(seed).uniform(-1, 1, shape)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Op:
    fn: str
    src: int


@dataclasses.dataclass(frozen=True)
class Bin:
    fn: str
    a: int
    b: int


@dataclasses.dataclass(frozen=True)
class Lin:
    src: int
    seed: int


@dataclasses.dataclass(frozen=True)
class Red:
    fn: str
    src: int


@dataclasses.dataclass(frozen=True)
class Sow:
    """Sow one variable (``srcs`` of length 1) or a dict of two (a pytree site);
    with ``const``, sow a constant of shape ``const`` instead."""

    name: str
    srcs: tuple[int, ...]
    mode: str
    const: tuple | None = None
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Scope:
    scope: str
    body: tuple


@dataclasses.dataclass(frozen=True)
class Jit:
    body: tuple


@dataclasses.dataclass(frozen=True)
class Remat:
    body: tuple


@dataclasses.dataclass(frozen=True)
class Scan:
    carry: int
    xs: int
    body: tuple
    reverse: bool = False
    dense: bool = False  # the carry update uses every body variable, not the last


@dataclasses.dataclass(frozen=True)
class Cond:
    """``lax.cond`` (two branches) or ``lax.switch`` (three) on one operand.

    Every branch applies its chain of unary ops; after op ``j`` for ``j`` in
    ``sites`` it sows the value as ``names[sites.index(j)]``: every branch
    sows the same names, shapes and dtypes."""

    pred: int
    operand: int
    branches: tuple[tuple[str, ...], ...]
    sites: tuple[int, ...]
    names: tuple[str, ...]
    mode: str

    @property
    def kind(self) -> str:
        return "cond" if len(self.branches) == 2 else "switch"


@dataclasses.dataclass(frozen=True)
class While:
    """``lax.while_loop`` running ``trips`` times: ``v = sow(chain(v))`` (clobber)."""

    src: int
    ops: tuple[str, ...]
    trips: int
    name: str


@dataclasses.dataclass(frozen=True)
class Output:
    kind: str  # "scalar", "array" or "tree"
    srcs: tuple[int, ...]


def _shape_of(x: Any) -> tuple:
    return tuple(np.shape(x))


def _fit(v: Any, shape: tuple) -> Any:
    """`v` made to `shape` (sum a vector to a scalar, broadcast a scalar)."""
    if _shape_of(v) == shape:
        return v
    if shape == ():
        return jnp.sum(v)
    return jnp.broadcast_to(v, shape)


class _Ctx:
    """Where a statement runs: nest scopes, and (oracle) the loop it is in."""

    def __init__(self, scopes: tuple = (), idx: Any = None, last: Any = None):
        self.scopes, self.idx, self.last = scopes, idx, last

    def scoped(self, scope: str) -> _Ctx:
        return _Ctx(self.scopes + (scope,), self.idx, self.last)

    def iteration(self, i: Any, length: int, is_last: Any) -> _Ctx:
        idx = i if self.idx is None else self.idx * length + i
        last = is_last if self.last is None else jnp.logical_and(self.last, is_last)
        return _Ctx(self.scopes, idx, last)


class _Interp:
    """Runs a program description: with lazyharvest sites (``lh=True``) or
    with JAX alone, collecting every site's value and applying plants and
    perturbations (``lh=False``)."""

    def __init__(self, prog: Program, use_lh: bool, plants: Mapping | None = None,
                 eps: Mapping | None = None):
        self.prog = prog
        self.lh = use_lh
        self.plants = {_norm(k): v for k, v in (plants or {}).items()}
        self.eps = {_norm(k): v for k, v in (eps or {}).items()}

    # -- sites -----------------------------------------------------------------

    def site(self, name: str, value: Any, mode: str, ctx: _Ctx, sites: dict) -> Any:
        if self.lh:
            return lh.sow(value, tag=self.prog.tag, name=name, mode=mode)
        key = (*ctx.scopes, name)
        v = value
        if key in self.plants:
            p = self.plants[key]
            if mode == "append":
                row = 0 if ctx.idx is None else ctx.idx
                p = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[row], p)
            v = jax.tree_util.tree_map(lambda a, b: jnp.asarray(a, jnp.result_type(b)), p, v)
        if key in self.eps:
            e = self.eps[key]
            if mode == "append":
                row = 0 if ctx.idx is None else ctx.idx
                e = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[row], e)
            elif ctx.last is not None:
                e = jax.tree_util.tree_map(lambda a: jnp.where(ctx.last, a, 0), e)
            v = jax.tree_util.tree_map(jnp.add, v, e)
        sites[key] = (mode, jax.tree_util.tree_map(lambda a: a[None], v) if mode == "append" else v)
        return v

    # -- blocks ----------------------------------------------------------------

    def block(self, stmts: Sequence[Any], env: list, ctx: _Ctx) -> tuple[list, dict]:
        env = list(env)
        start = len(env)
        sites: dict = {}
        for st in stmts:
            env.extend(self.stmt(st, env, ctx, sites))
        return env[start:], sites

    def _sub(self, body: tuple, env: list, ctx: _Ctx, sites: dict) -> list:
        new, sub_sites = self.block(body, env, ctx)
        sites.update(sub_sites)
        return new

    def stmt(self, st: Any, env: list, ctx: _Ctx, sites: dict) -> list:
        if isinstance(st, Op):
            return [UNARY[st.fn](env[st.src])]
        if isinstance(st, Bin):
            return [BINARY[st.fn](env[st.a], env[st.b])]
        if isinstance(st, Lin):
            return [jnp.asarray(_matrix(st.seed)) @ env[st.src]]
        if isinstance(st, Red):
            return [REDUCE[st.fn](env[st.src])]
        if isinstance(st, Sow):
            if st.const is not None:
                value: Any = jnp.asarray(_constant(st.seed, st.const))
            elif len(st.srcs) == 1:
                value = env[st.srcs[0]]
            else:
                value = {"a": env[st.srcs[0]], "b": env[st.srcs[1]]}
            out = self.site(st.name, value, st.mode, ctx, sites)
            return [out] if not isinstance(out, dict) else [out["a"], out["b"]]
        if isinstance(st, (Scope, Jit, Remat)):
            return self.wrapped(st, env, ctx, sites)
        if isinstance(st, Scan):
            return self.scan(st, env, ctx, sites)
        if isinstance(st, Cond):
            return self.cond(st, env, ctx, sites)
        if isinstance(st, While):
            return self.while_(st, env, ctx, sites)
        raise TypeError(f"unknown statement {st!r}")

    def wrapped(self, st: Any, env: list, ctx: _Ctx, sites: dict) -> list:
        if not self.lh:  # jit and checkpoint are the identity; scopes prefix keys
            sub = ctx.scoped(st.scope) if isinstance(st, Scope) else ctx
            return self._sub(st.body, env, sub, sites)

        def run(env_tuple: tuple) -> tuple:
            return tuple(self.block(st.body, list(env_tuple), ctx)[0])
        if isinstance(st, Scope):
            fn = lh.nest(run, scope=st.scope)
        elif isinstance(st, Jit):
            fn = jax.jit(run)
        else:
            fn = jax.checkpoint(run)
        return list(fn(tuple(env)))

    def scan(self, st: Scan, env: list, ctx: _Ctx, sites: dict) -> list:
        carry0, xs = env[st.carry], env[st.xs]
        length = _shape_of(xs)[0]
        shape = _shape_of(carry0)
        last_i = length - 1  # clobber: the highest index, also for reverse=True

        def body(c: Any, inp: Any) -> Any:
            xi, i = inp
            local = list(env) + [c, xi]
            sub = ctx if self.lh else ctx.iteration(i, length, i == last_i)
            new, body_sites = self.block(st.body, local, sub)
            modes.update({k: m for k, (m, _) in body_sites.items()})  # static
            used = new if st.dense else new[-1:]
            total = sum(_fit(v, shape) for v in used)
            c2 = 0.5 * c + jnp.tanh(total)
            y = _fit(total, ())
            return c2, (y, {k: v for k, (_, v) in body_sites.items()}
                        if not self.lh else {})
        modes: dict = {}
        c, (ys, stacked) = lax.scan(body, carry0, (xs, jnp.arange(length)),
                                    reverse=st.reverse)
        for k, v in stacked.items():
            if modes[k] == "append":  # (length, rows, ...) -> (length * rows, ...)
                v = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), v)
                sites[k] = ("append", v)
            else:
                sites[k] = (modes[k], jax.tree_util.tree_map(lambda a: a[last_i], v))
        return [c, ys]

    def cond(self, st: Cond, env: list, ctx: _Ctx, sites: dict) -> list:
        total = jnp.sum(env[st.pred])

        def make(ops: tuple) -> Callable:
            def branch(v: Any) -> Any:
                local: dict = {}
                for j, op in enumerate(ops):
                    v = UNARY[op](v)
                    if j in st.sites:
                        v = self.site(st.names[st.sites.index(j)], v, st.mode, ctx, local)
                return v, {k: val for k, (_, val) in local.items()}
            return branch
        branches = [make(ops) for ops in st.branches]
        if st.kind == "cond":
            out, chosen = lax.cond(total > 0, branches[0], branches[1], env[st.operand])
        else:
            index = (total > 0).astype(jnp.int32) + (total > 1).astype(jnp.int32)
            out, chosen = lax.switch(index, branches, env[st.operand])
        for k, v in chosen.items():
            sites[k] = (st.mode, v)
        return [out]

    def while_(self, st: While, env: list, ctx: _Ctx, sites: dict) -> list:
        v0 = env[st.src]

        def chain(v: Any, local: dict) -> Any:
            for op in st.ops:
                v = UNARY[op](v)
            return self.site(st.name, v, "clobber", ctx, local)

        if self.lh:
            _, v = lax.while_loop(lambda s: s[0] < st.trips,
                                  lambda s: (s[0] + 1, chain(s[1], {})), (0, v0))
            return [v]

        def body(s: Any) -> Any:
            i, v, _ = s
            v = chain(v, {})
            return i + 1, v, v
        _, v, last = lax.while_loop(lambda s: s[0] < st.trips, body,
                                    (0, v0, jnp.zeros_like(v0)))
        sites[(*ctx.scopes, st.name)] = ("clobber", last)
        return [v]

    # -- the whole program ---------------------------------------------------------

    def run(self, args: Sequence[Any]) -> tuple[Any, dict]:
        env = [args[0]]
        if self.prog.tree_input:
            env += [args[1]["a"], args[1]["b"]]
        new, sites = self.block(self.prog.body, env, _Ctx())
        env += new
        return self.prog._output(env), {k: v for k, (_, v) in sites.items()}


@dataclasses.dataclass(frozen=True)
class Program:
    """A random program with sites, and its oracle in JAX alone.

    Arguments: ``x: f32[3]``, and with ``tree_input`` a second argument
    ``{"a": f32[3], "b": f32[]}``. ``fn`` is the function with sites (tag
    ``tag``); ``slices[k](*args)`` computes site ``k`` without lazyharvest;
    ``plant(plants, *args)`` / ``perturb(eps, *args)`` run the program with
    site values replaced / shifted, keyed by site key tuples. ``repr`` is a
    readable listing of the program (variables ``v0, v1, ...``).
    """

    body: tuple
    output: Output
    tree_input: bool = False
    tag: str = "law"

    # -- building --------------------------------------------------------------

    def _output(self, env: list) -> Any:
        parts = [env[i] for i in self.output.srcs]
        weights = [0.5 + 0.25 * (j % 3) for j in range(len(parts))]
        scalar = sum(w * jnp.sum(p) for w, p in zip(weights, parts))
        vector = sum(w * jnp.broadcast_to(p, (N,)) for w, p in zip(weights, parts))
        if self.output.kind == "scalar":
            return scalar
        if self.output.kind == "array":
            return vector
        return {"out": vector, "aux": scalar}

    @functools.cached_property
    def fn(self) -> Callable[..., Any]:
        """The program, with ``lh.sow`` sites."""
        if self.tree_input:
            def program(x: Any, p: Any) -> Any:
                return _Interp(self, True).run((x, p))[0]
        else:
            def program(x: Any) -> Any:  # type: ignore[misc]
                return _Interp(self, True).run((x,))[0]
        program.__qualname__ = program.__name__ = "random_program"
        return program

    @functools.cached_property
    def sites_fn(self) -> Callable[..., dict]:
        """Every site's value, ``{key: value}``, computed with JAX alone."""
        return jax.jit(lambda *args: _Interp(self, False).run(args)[1])

    @functools.cached_property
    def keys(self) -> list[Key]:
        """Site keys ``(*scopes, name)``, sorted."""
        return list(jax.eval_shape(self.sites_fn, *self.example_args(0)))

    @functools.cached_property
    def slices(self) -> dict[Key, Callable[..., Any]]:
        """Per key, the site's value as a function of the inputs (JAX alone)."""
        def make(k: Key) -> Callable[..., Any]:
            return lambda *args: self.sites_fn(*args)[k]
        return {k: make(k) for k in self.keys}

    def plant(self, plants: Mapping[Any, Any], *args: Any) -> Any:
        """The output with ``plants[k]`` replacing site ``k`` (JAX alone)."""
        return _Interp(self, False, plants=plants).run(args)[0]

    def perturb(self, eps: Mapping[Any, Any], *args: Any) -> Any:
        """The output with ``eps[k]`` added to the reaped sow of site ``k``."""
        return _Interp(self, False, eps=eps).run(args)[0]

    def example_args(self, seed: int = 0, batch: Sequence[Sequence[Any]] = ()) -> tuple:
        """Arguments from a seed; ``batch`` lists per vmap (innermost first)
        the in_axes of each argument (``Stack.batch_dims``)."""
        rng = np.random.RandomState(seed)
        shapes: list[Any] = [(N,)]
        if self.tree_input:
            shapes.append({"a": (N,), "b": ()})
        for dims in batch:
            for j, ax in enumerate(dims):
                if ax is not None:
                    shapes[j] = jax.tree_util.tree_map(
                        lambda s, ax=ax: _insert(s, ax), shapes[j],
                        is_leaf=lambda s: isinstance(s, tuple))
        return tuple(jax.tree_util.tree_map(
            lambda s: jnp.asarray(0.8 * rng.standard_normal(s), jnp.float32), sh,
            is_leaf=lambda s: isinstance(s, tuple)) for sh in shapes)

    # -- facts -----------------------------------------------------------------

    @property
    def scalar_output(self) -> bool:
        return self.output.kind == "scalar"

    @functools.cached_property
    def constructs(self) -> frozenset:
        """The constructs this program uses (a subset of ``CONSTRUCTS``)."""
        found: set = set()
        _constructs(self.body, found, scope_depth=0, in_scan=False)
        env = [False] * (3 if self.tree_input else 1)
        _variance(self.body, env, in_loop=False, in_remat=False, found=found)
        if self.tree_input:
            found.add("pytree_in")
        found.add({"scalar": "scalar_out", "array": "array_out",
                   "tree": "pytree_out"}[self.output.kind])
        return frozenset(found)

    @functools.cached_property
    def once_keys(self) -> list[Key]:
        """Sites sown exactly once per run (not in a loop)."""
        out: list = []
        _once(self.body, (), out, looped=False)
        return out

    @functools.cached_property
    def clobber_loop_keys(self) -> list[Key]:
        """Clobber sites in a scan or while loop."""
        out: list = []
        _clobber_loops(self.body, (), out, looped=False)
        return out

    @property
    def reverse_differentiable(self) -> bool:
        return "while" not in self.constructs

    def __repr__(self) -> str:
        args = "x, p" if self.tree_input else "x"
        lines = [f"def random_program({args}):  # tag={self.tag!r}, N={N}"]
        env = ["x"] + (['p["a"]', 'p["b"]'] if self.tree_input else [])
        counter = [len(env)]
        names = list(env)
        _render(self.body, names, counter, lines, "    ")
        srcs = ", ".join(names[i] for i in self.output.srcs)
        lines.append(f"    return {self.output.kind}_output({srcs})")
        return "\n".join(lines)


def _insert(shape: tuple, ax: int) -> tuple:
    ax = ax if ax >= 0 else len(shape) + 1 + ax
    return shape[:ax] + (B,) + shape[ax:]


def _constructs(body: tuple, found: set, scope_depth: int, in_scan: bool) -> None:
    for st in body:
        if isinstance(st, Op):
            found.add("elementwise")
        elif isinstance(st, Bin):
            found.add("binary")
        elif isinstance(st, Lin):
            found.add("linear")
        elif isinstance(st, Red):
            found.add("reduction")
        elif isinstance(st, Sow):
            found.add("site")
            if st.const is not None:
                found.add("constant")
            if len(st.srcs) == 2:
                found.add("pytree_site")
            if in_scan:
                found.add("scan_append" if st.mode == "append" else "scan_clobber")
        elif isinstance(st, Scope):
            found.add("scope")
            if scope_depth >= 1:
                found.add("nested_scope")
            _constructs(st.body, found, scope_depth + 1, in_scan)
        elif isinstance(st, Jit):
            found.add("jit")
            _constructs(st.body, found, scope_depth, in_scan)
        elif isinstance(st, Remat):
            found.add("checkpoint")
            _constructs(st.body, found, scope_depth, in_scan)
        elif isinstance(st, Scan):
            found.add("scan")
            if st.reverse:
                found.add("reverse_scan")
            if in_scan:
                found.add("nested_scan")
            _constructs(st.body, found, scope_depth, True)
        elif isinstance(st, Cond):
            found.update({st.kind, "site"})
            if in_scan:
                found.add("scan_append" if st.mode == "append" else "scan_clobber")
        elif isinstance(st, While):
            found.update({"while", "site"})
            if st.trips == 0:
                found.add("while_never_runs")
            if in_scan:
                found.add("scan_clobber")


def _variance(body: tuple, variant: list, in_loop: bool, in_remat: bool, found: set) -> list:
    """Data-flow facts: which variables change from one iteration of the
    innermost scan to the next (``variant``, parallel to the environment);
    adds "invariant_append_site" and "cond_in_checkpoint" to ``found``.
    Returns the flags of the variables ``body`` creates (errs towards
    "invariant")."""
    env = list(variant)
    start = len(env)
    for st in body:
        if isinstance(st, (Op, Lin, Red)):
            new = [env[st.src]]
        elif isinstance(st, Bin):
            new = [env[st.a] or env[st.b]]
        elif isinstance(st, Sow):
            v = st.const is None and any(env[i] for i in st.srcs)
            if in_loop and st.mode == "append" and not v:
                found.add("invariant_append_site")
            new = [v] * max(1, len(st.srcs))
        elif isinstance(st, (Scope, Jit)):
            new = _variance(st.body, env, in_loop, in_remat, found)
        elif isinstance(st, Remat):
            new = _variance(st.body, env, in_loop, True, found)
        elif isinstance(st, Scan):
            inner = [False] * len(env) + [True, True]
            _variance(st.body, inner, True, in_remat, found)
            v = env[st.carry] or env[st.xs]
            new = [v, v]
        elif isinstance(st, Cond):
            if in_remat:
                found.add("cond_in_checkpoint")
            v = env[st.operand] or env[st.pred]
            if in_loop and st.mode == "append" and not v:
                found.add("invariant_append_site")
            new = [v]
        elif isinstance(st, While):
            new = [env[st.src]]
        else:
            raise TypeError(st)
        env.extend(new)
    return env[start:]


def _once(body: tuple, scopes: tuple, out: list, looped: bool) -> None:
    for st in body:
        if isinstance(st, Sow) and not looped:
            out.append((*scopes, st.name))
        elif isinstance(st, Cond) and not looped:
            out.extend((*scopes, n) for n in st.names)
        elif isinstance(st, Scope):
            _once(st.body, scopes + (st.scope,), out, looped)
        elif isinstance(st, (Jit, Remat)):
            _once(st.body, scopes, out, looped)
        elif isinstance(st, While) and not looped and st.trips == 1:
            out.append((*scopes, st.name))


def _clobber_loops(body: tuple, scopes: tuple, out: list, looped: bool) -> None:
    for st in body:
        if isinstance(st, Sow) and looped and st.mode == "clobber":
            out.append((*scopes, st.name))
        elif isinstance(st, Cond) and looped and st.mode == "clobber":
            out.extend((*scopes, n) for n in st.names)
        elif isinstance(st, Scope):
            _clobber_loops(st.body, scopes + (st.scope,), out, looped)
        elif isinstance(st, (Jit, Remat)):
            _clobber_loops(st.body, scopes, out, looped)
        elif isinstance(st, Scan):
            _clobber_loops(st.body, scopes, out, True)
        elif isinstance(st, While):
            out.append((*scopes, st.name))


def _render(body: tuple, names: list, counter: list, lines: list, ind: str) -> None:
    def new(expr: str) -> None:
        v = f"v{counter[0]}"
        counter[0] += 1
        names.append(v)
        lines.append(f"{ind}{v} = {expr}")

    for st in body:
        if isinstance(st, Op):
            new(f"{st.fn}({names[st.src]})")
        elif isinstance(st, Bin):
            new(f"{st.fn}({names[st.a]}, {names[st.b]})")
        elif isinstance(st, Lin):
            new(f"W{st.seed} @ {names[st.src]}")
        elif isinstance(st, Red):
            new(f"{st.fn}({names[st.src]})")
        elif isinstance(st, Sow):
            if st.const is not None:
                val = f"const{st.const}"
            elif len(st.srcs) == 1:
                val = names[st.srcs[0]]
            else:
                val = f'{{"a": {names[st.srcs[0]]}, "b": {names[st.srcs[1]]}}}'
            if len(st.srcs) == 2 and st.const is None:
                a, b = f"v{counter[0]}", f"v{counter[0] + 1}"
                counter[0] += 2
                names += [a, b]
                lines.append(f'{ind}{a}, {b} = sow({val}, name={st.name!r}, '
                             f'mode={st.mode!r}).values()')
            else:
                new(f"sow({val}, name={st.name!r}, mode={st.mode!r})")
        elif isinstance(st, (Scope, Jit, Remat)):
            head = {Scope: lambda: f"nest(scope={getattr(st, 'scope', '')!r})",
                    Jit: lambda: "jax.jit", Remat: lambda: "jax.checkpoint"}[type(st)]()
            lines.append(f"{ind}with {head}:  # a block")
            _render(st.body, names, counter, lines, ind + "    ")
        elif isinstance(st, Scan):
            lines.append(f"{ind}scan(carry={names[st.carry]}, xs={names[st.xs]}, "
                         f"reverse={st.reverse}) as (c, xi):")
            inner = names + ["c", "xi"]
            _render(st.body, inner, counter, lines, ind + "    ")
            used = inner[len(names) + 2:] if st.dense else inner[-1:]
            total = " + ".join(f"fit({u})" for u in used)
            lines.append(f"{ind}    t = {total}; c = 0.5 * c + tanh(t); y = sum(t)")
            new("final carry")
            new("stacked y")
        elif isinstance(st, Cond):
            sites = ", ".join(f"after op {j}: sow {n!r} ({st.mode})"
                              for j, n in zip(st.sites, st.names))
            new(f"{st.kind}(pred=sum({names[st.pred]}), operand={names[st.operand]}, "
                f"branches={list(st.branches)}; {sites})")
        elif isinstance(st, While):
            new(f"while_loop({st.trips} trips: v = sow({'('.join(st.ops)}(v{')' * len(st.ops)}), "
                f"{st.name!r}, clobber), v={names[st.src]})")


# =============================================================================
# Random programs: the hypothesis strategies
# =============================================================================

def _strategies() -> Any:
    try:
        import hypothesis.strategies as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lazyharvest.testing: the random-program strategies need hypothesis "
            "(pip install hypothesis); the check_* functions do not.") from e
    return st


class _Gen:
    """State while drawing one program: variable shapes, names, depth."""

    def __init__(self, draw: Callable, allowed: frozenset, max_statements: int, max_depth: int,
                 dead_code: bool = True):
        self.draw = draw
        self.dead_code = dead_code
        self.allowed = allowed
        self.max_statements = max_statements
        self.max_depth = max_depth
        self.names: dict[tuple, int] = {}
        self.n_scopes = 0
        self.n_sites = 0

    def st(self) -> Any:
        return _strategies()

    def name(self, scopes: tuple) -> str:
        n = self.names.get(scopes, 0)
        self.names[scopes] = n + 1
        self.n_sites += 1
        return f"s{n}"

    def pick(self, shapes: list, want: tuple | None = None) -> int:
        ok = [i for i, s in enumerate(shapes) if want is None or s == want]
        # favour recent variables, so values flow through the program
        return self.draw(self.st().sampled_from(ok[::-1]))

    def block(self, shapes: list, scopes: tuple, depth: int, loop: bool,
              n_min: int, n_max: int) -> tuple[tuple, list]:
        """Statements and the shapes of the variables they create."""
        st = self.st()
        shapes = list(shapes)
        start = len(shapes)
        body = []
        kinds = ["op", "op", "bin", "lin", "red", "sow", "sow"]
        kinds += [k for k in ("pytree_site", "constant") if k in self.allowed]
        if depth < self.max_depth:
            kinds += [k for k in ("scope", "jit", "checkpoint", "scan", "cond", "switch",
                                  "while") if k in self.allowed]
        n = self.draw(st.integers(n_min, n_max))
        for _ in range(n):
            kind = self.draw(st.sampled_from(kinds))
            stmt, new = self.statement(kind, shapes, scopes, depth, loop)
            body.append(stmt)
            shapes += new
        return tuple(body), shapes[start:]

    def mode(self, loop: bool) -> str:
        if not loop:
            return "strict"
        options = [m for m in ("append", "clobber") if f"scan_{m}" in self.allowed]
        return self.draw(self.st().sampled_from(options or ["append"]))

    def statement(self, kind: str, shapes: list, scopes: tuple, depth: int,
                  loop: bool) -> tuple[Any, list]:
        st = self.st()
        draw = self.draw
        vec = (N,)
        if kind == "op":
            i = self.pick(shapes)
            return Op(draw(st.sampled_from(sorted(UNARY))), i), [shapes[i]]
        if kind == "bin":
            a, b = self.pick(shapes), self.pick(shapes)
            out = vec if vec in (shapes[a], shapes[b]) else ()
            return Bin(draw(st.sampled_from(sorted(BINARY))), a, b), [out]
        if kind == "lin":
            return Lin(self.pick(shapes, vec), draw(st.integers(0, 7))), [vec]
        if kind == "red":
            return Red(draw(st.sampled_from(sorted(REDUCE))), self.pick(shapes, vec)), [()]
        if kind == "sow":
            i = self.pick(shapes)
            return Sow(self.name(scopes), (i,), self.mode(loop)), [shapes[i]]
        if kind == "pytree_site":
            a, b = self.pick(shapes), self.pick(shapes)
            return Sow(self.name(scopes), (a, b), self.mode(loop)), [shapes[a], shapes[b]]
        if kind == "constant":
            shape = draw(st.sampled_from([(), vec]))
            return (Sow(self.name(scopes), (), self.mode(loop), const=shape,
                        seed=draw(st.integers(0, 7))), [shape])
        if kind == "scope":
            self.n_scopes += 1
            scope = f"b{self.n_scopes - 1}"
            body, new = self.block(shapes, scopes + (scope,), depth + 1, loop, 1, 3)
            return Scope(scope, body), new
        if kind in ("jit", "checkpoint"):
            body, new = self.block(shapes, scopes, depth + 1, loop, 1, 3)
            return (Jit(body) if kind == "jit" else Remat(body)), new
        if kind == "scan":
            carry = self.pick(shapes)
            xs = self.pick(shapes, vec)
            inner = shapes + [shapes[carry], ()]
            body, new = self.block(inner, scopes, depth + 1, True, 1, 3)
            if not any(isinstance(s, (Sow, Cond, While, Scope, Scan, Jit, Remat))
                       for s in body):
                body += (Sow(self.name(scopes), (len(inner) + len(new) - 1,),
                             self.mode(True)),)
            reverse = draw(st.booleans()) if "reverse_scan" in self.allowed else False
            return Scan(carry, xs, body, reverse, not self.dead_code), [shapes[carry], vec]
        if kind in ("cond", "switch"):
            n_br = 2 if kind == "cond" else 3
            length = draw(st.integers(1, 3))
            ops = st.sampled_from(sorted(UNARY))
            branches = tuple(tuple(draw(ops) for _ in range(length)) for _ in range(n_br))
            where = tuple(sorted(draw(st.sets(st.integers(0, length - 1), min_size=1,
                                              max_size=2))))
            names = tuple(self.name(scopes) for _ in where)
            operand = self.pick(shapes)
            return (Cond(self.pick(shapes), operand, branches, where, names, self.mode(loop)),
                    [shapes[operand]])
        if kind == "while":
            src = self.pick(shapes)
            ops = tuple(draw(st.lists(st.sampled_from(["sin", "tanh", "scale", "shift"]),
                                      min_size=1, max_size=2)))
            trips = draw(st.sampled_from([0, 1, 2]))
            return While(src, ops, trips, self.name(scopes)), [shapes[src]]
        raise ValueError(kind)


def programs(*, exclude: Iterable[str] = (), max_statements: int = 5, max_depth: int = 2,
             outputs: Sequence[str] = ("scalar", "array", "tree"), dead_code: bool = True,
             tag: str = "law") -> Any:
    """A hypothesis strategy of random ``Program`` s.

    ``exclude`` removes constructs from ``CONSTRUCTS`` (e.g. ``{"while"}``
    for reverse mode, ``{"constant"}``; constructs derived from the data flow
    are filtered out after drawing); ``outputs`` restricts the output
    kind (``"scalar"``, ``"array"`` or the pytree ``"tree"``). Programs are
    small: at most ``max_statements`` top-level statements, blocks nested
    ``max_depth`` deep. They always sow at least one site. With
    ``dead_code=False`` every variable reaches the output (the output and
    every scan carry combine all variables), so no site is dead code.
    """
    st = _strategies()
    exclude = frozenset(exclude)
    unknown = exclude - CONSTRUCTS
    if unknown:
        raise ValueError(f"programs: unknown constructs {sorted(unknown)}; "
                         f"known: {sorted(CONSTRUCTS)}")
    allowed = CONSTRUCTS - exclude

    @st.composite
    def draw_program(draw: Callable) -> Program:
        gen = _Gen(draw, allowed, max_statements, max_depth, dead_code)
        tree_input = "pytree_in" in allowed and draw(st.booleans())
        shapes: list = [(N,)] + ([(N,), ()] if tree_input else [])
        body, new = gen.block(shapes, (), 0, False, 1, max_statements)
        shapes += new
        if gen.n_sites == 0:
            body += (Sow(gen.name(()), (len(shapes) - 1,), "strict"),)
            shapes.append(shapes[-1])
        kinds = [k for k in outputs if {"scalar": "scalar_out", "array": "array_out",
                                        "tree": "pytree_out"}[k] in allowed]
        kind = draw(st.sampled_from(kinds))
        last = len(shapes) - 1
        if dead_code:
            rest = draw(st.sets(st.integers(0, last), max_size=2))
        else:
            rest = set(range(last))
        srcs = tuple(sorted(rest | {last}))
        if kind != "scalar" and all(shapes[i] == () for i in srcs):
            srcs = (0,) + srcs
        return Program(body, Output(kind, srcs), tree_input, tag)
    strategy = draw_program()
    if exclude:
        strategy = strategy.filter(lambda p: not p.constructs & exclude)
    return strategy


def transform_stacks(program: Program, *, max_depth: int = 3,
                     kinds: Sequence[str] = ("grad", "jacfwd", "jacrev", "vmap", "jit"),
                     min_depth: int = 1) -> Any:
    """A hypothesis strategy of ``Stack`` s that apply to ``program``.

    Up to ``max_depth`` recorded transforms, innermost first; ``grad`` only
    where the function is scalar, ``grad``/``jacrev`` only where it is
    reverse-differentiable (no ``while_loop``); ``vmap`` with random ``in_axes`` (0, -1 or
    per argument, one of them ``None``) and ``out_axes`` (0, -1, or for a
    pytree output a matching pytree).
    """
    st = _strategies()
    n_args = 2 if program.tree_input else 1

    @st.composite
    def draw_stack(draw: Callable) -> Stack:
        depth = draw(st.integers(min_depth, max_depth))
        scalar = program.scalar_output
        tree_out = program.output.kind == "tree"
        out: list = []
        for _ in range(depth):
            options = [k for k in kinds if (k != "grad" or scalar)
                       and (k not in ("grad", "jacrev") or program.reverse_differentiable)]
            kind = draw(st.sampled_from(options))
            if kind == "vmap":
                axes_options: list = [0, -1]
                if n_args == 2:
                    axes_options += [(0, None), (None, 0), (-1, 0)]
                in_axes = draw(st.sampled_from(axes_options))
                out_options: list = [0, -1]
                if tree_out and not out:
                    out_options.append({"out": -1, "aux": 0})
                out.append(Transform("vmap", in_axes, draw(st.sampled_from(out_options))))
                scalar = False
            elif kind == "jit":
                out.append(Transform("jit"))
            else:
                out.append(Transform(kind))
                scalar = False
                tree_out = False
        return Stack(tuple(out))
    return draw_stack()


def inputs(program: Program, stack: Stack | None = None) -> Any:
    """A hypothesis strategy of argument tuples for ``program`` under ``stack``."""
    st = _strategies()
    batch = stack.batch_dims(2 if program.tree_input else 1) if stack is not None else []
    return st.integers(0, 2 ** 16).map(lambda seed: program.example_args(seed, batch))
