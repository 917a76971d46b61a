"""The laws of docs/laws.md as checkers: ``check_<law>(f, *args, tag=...)``
checks one law on one function and one set of inputs; ``check_all`` runs
every law that applies.

A failure is an ``AssertionError`` naming the law, the key and the largest
error. Expected values come from JAX alone (or from slices the caller
writes), never from the harvest being checked.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import lazyharvest as lh
from lazyharvest.keys import Key, display, normalize
from lazyharvest.testing._compare import (
    ATOL, RTOL, compare, compare_dicts, guard, missing, only_on_left, same_keys)
from lazyharvest.testing._sites import (
    Evidence, default_keys, flat, get_nested, label_split, reaped, spelling, split_labels,
    split_of)
from lazyharvest.testing._values import (
    all_zero, float_leaves, is_float, random_like, zeros_like_tree)
from lazyharvest.testing.stacks import Stack

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


def _law(n: int, part: str = "") -> str:
    stmt = LAWS[n][1]
    return f"law {n} ({stmt}{'; ' + part if part else ''})"


def _split_linear(got: Mapping[Key, Any],
                  split: Callable[[Key], tuple[tuple, tuple]] = split_labels
                  ) -> tuple[dict, dict]:
    """(tangents, values) of a reaped linear function, keyed by plain keys.

    Normally its keys are plain and hold tangents. When the function holds a
    primal computation too (``jax.linearize`` of a ``lax.while_loop`` puts the
    whole loop in it), its keys are those of ``jax.jvp``: ``("jvp", *k)`` for
    the tangents, ``k`` for the values of the sites that run there.
    """
    def tangent(k: Key) -> bool:  # (labels are innermost first: the outer level last)
        return split(k)[0][-1:] == ("jvp",)
    if not any(tangent(k) for k in got):
        return dict(got), {}

    def plain(labels: tuple, rest: tuple) -> Key:  # a shared key is spelled out
        return (*(x for x in labels if x not in ("primal", "|")), *rest)
    tangents = {plain(split(k)[0][:-1], split(k)[1]): v for k, v in got.items() if tangent(k)}
    values = {plain(*split(k)): v for k, v in got.items() if not tangent(k)}
    return tangents, values


def check_linearize(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                    atol: float = ATOL, tangents: Any = None,
                    strict_keys: bool = False) -> None:
    """Law 1: ``reap(linearize(f, *args)[1])(t) == linearize(reap(f), *args)[1](t)``.

    Left: the reaped linear function, a dict ``{(*scopes, name): tangent}``
    (plain names). Right: the linear map of ``x -> reap(f)(x).compute()``.
    Every tangent on the left must be on the right with the same value. A key
    of the right may be missing on the left only for a constant or dead site;
    when ``f`` runs a ``while_loop`` the left has ``jax.jvp``'s keys instead
    (tangents under ``("jvp", *k)``, values of the loop's sites under ``k``,
    equal to ``reap(f)``'s), see docs/laws.md. ``strict_keys=True`` checks the
    law as SPEC states it.
    """
    law = _law(1)
    t = random_like(args, 1) if tangents is None else tangents

    def left() -> dict:
        _, lin = jax.linearize(f, *args)
        return reaped(lin, tag, t)

    def right() -> dict:
        _, lin = jax.linearize(lambda *a: reaped(f, tag, a), *args)
        return lin(*t)
    got = guard(law, left)
    want = guard(law, right)
    got_t, got_v = (dict(got), {}) if strict_keys else _split_linear(
        got, label_split(jax.linearize(f, *args)[1], tag, t))
    only_on_left(law, [display(k) for k in got_t if k not in want])
    missing(law, [k for k in want if k not in got_t], Evidence(f, args, tag).dead,
            "constant or dead sites", strict_keys)
    for k in got_t:
        compare(law, k, got_t[k], want[k], rtol, atol)
    if got_v:
        values = guard(law, lambda: reaped(f, tag, args))
        only_on_left(law, [display(k) for k in got_v if k not in values])
        for k, v in got_v.items():
            compare(_law(1, "values in the linear function"), k, v, values[k], rtol, atol)


def _tangent_parts(key: Key, split: Callable[[Key], tuple[tuple, tuple]]) -> tuple:
    """(labels, rest) of the tangent key of ``key``: ``"jvp"`` after its labels."""
    labels, rest = split(key)
    return (*labels, "jvp"), rest


def check_jvp(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, tangents: Any = None, strict_keys: bool = False) -> None:
    """Law 2: reaping ``jvp(f)`` gives ``jvp(reap(f))``: values and tangents.

    Left: ``reap(lambda *x: jax.jvp(f, x, t))(*args)``, keys ``k`` and
    ``("jvp", *k)``. Right: ``jax.jvp(lambda *x: reap(f)(*x).compute(), args, t)``
    as ``(values, tangents)``; the tangent of key ``k`` is expected under
    ``("jvp", *k)`` (after ``k``'s labels, if any). A tangent key may be
    missing only where the tangent is zero (a constant site, docs/laws.md);
    ``strict_keys=True`` requires every one.
    """
    law = _law(2)
    t = random_like(args, 2) if tangents is None else tangents
    left = guard(law, lambda: lh.reap(lambda *a: jax.jvp(f, a, t), tag=tag)(*args))
    got = guard(law, lambda: flat(left))
    primals, tans = guard(law, lambda: jax.jvp(lambda *a: reaped(f, tag, a), tuple(args), t))
    split, spelled = label_split(f, tag, args), spelling(left)

    def spelled_as(labels: tuple, rest: Key) -> Key:  # a shared key is spelled out
        plain = tuple(x for x in labels if x not in ("primal", "|"))
        return spelled.get((plain, rest), (*labels, *rest))
    primals = {spelled_as(*split(k)): v for k, v in primals.items()}
    want = dict(primals)
    want.update({spelled_as(*_tangent_parts(k, split)): v for k, v in tans.items()})
    only_on_left(law, [display(k) for k in got if k not in want])
    missing(law, [k for k in primals if k not in got], lambda k: False, "", True)
    missing(law, [k for k in want if k not in got], lambda k: all_zero(want[k]),
            "zero tangents (constant sites)", strict_keys)
    for k in got:
        compare(law, k, got[k], want[k], rtol, atol)


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
    want = guard(law, lambda: jax.vmap(lambda *a: reaped(f, tag, a), in_axes=in_axes,
                                       out_axes=site_axes)(*args))
    out, d = guard(law, lambda: lh.call_and_reap(batched, tag=tag)(*args))
    compare(law, None, out, jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(*args),
            rtol, atol)
    for k, v in want.items():
        compare(law, k, guard(law, lambda: d[k]), v, rtol, atol)
        vk = ("vmap", *k)
        if vk in d:
            compare(law, vk, guard(law, lambda: d[vk]), v, rtol, atol)


def check_jit(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, jit: Callable | None = None) -> None:
    """Law 4: ``reap(jit(f))(x) == reap(f)(x)``, and ``jit(reap(f))`` too.

    ``jit`` defaults to ``jax.jit``; pass ``lh.jit`` to check the recorded
    one (its plain keys are compared; structural labels are aliases).
    """
    law = _law(4)
    jit = jax.jit if jit is None else jit
    want = guard(law, lambda: reaped(f, tag, args))
    d = guard(law, lambda: lh.reap(jit(f), tag=tag)(*args))
    same_keys(_law(4, "reap(jit(f))"), list(map(normalize, d.keys())), want)
    for k, v in want.items():
        compare(_law(4, "reap(jit(f))"), k, guard(law, lambda: d[k]), v, rtol, atol)
    staged = guard(law, lambda: jax.jit(lambda *a: reaped(f, tag, a))(*args))
    compare_dicts(_law(4, "jit(reap(f))"), staged, want, rtol, atol)


def _subset(keys: Sequence[Key], seed: int | None) -> list[Key]:
    """``keys``, or with a ``seed`` a random non-empty subset of them: a plant
    of some sites must leave the others as they were."""
    keys = list(keys)
    if seed is None or not keys:
        return keys
    chosen = np.random.RandomState(seed).rand(len(keys)) < 0.5
    chosen[np.random.RandomState(seed + 1).randint(len(keys))] = True
    return [k for k, c in zip(keys, chosen) if c]


def _plant_gradient(f: Callable, args: Sequence[Any], tag: Hashable, key: Key, value: Any,
                    ct_out: Any) -> Any:
    """``grad_p <ct_out, plant(f)({key: p}, *args)>`` at ``p = value``."""
    planted = lambda p: lh.plant(f, tag=tag)({key: p}, *args)  # noqa: E731
    return jax.vjp(planted, value)[1](ct_out)[0]


def _vjp_of_call_and_reap(f: Callable, args: Sequence[Any], tag: Hashable, ct_out: Any,
                          ct_sites: Mapping[Key, Any]) -> Any:
    """The VJP of ``x -> (f(x), reap(f)(x))`` fed ``ct_out`` and ``ct_sites``
    (zeros for the other sites)."""
    def out_and_sites(*a: Any) -> Any:
        o, d = lh.call_and_reap(f, tag=tag)(*a)
        return o, flat(d)
    (_, sites), full_vjp = jax.vjp(out_and_sites, *args)
    cts = {k: ct_sites.get(k, zeros_like_tree(v)) for k, v in sites.items()}
    return full_vjp((ct_out, cts))


def check_vjp(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
              atol: float = ATOL, keys: Iterable[Any] | None = None,
              plant_keys: Iterable[Any] | None = None, cotangent: Any = None,
              strict_keys: bool = False, subset: int | None = None) -> None:
    """Law 5: ``reap∘vjp = vjp∘reap`` through planting (SPEC 5.5).

    With ``bwd = jax.vjp(f, *args)[1]`` and a random ``ct_out``:

    (b) ``reap(bwd)(ct_out)`` has every key of ``reap(f)`` (except constant
        or dead sites, docs/laws.md; all of them with ``strict_keys``) and,
        for ``k`` in ``keys``, equals ``grad_p <ct_out, plant(f)({k: p}, x)>``
        at ``p = reap(f)(x)[k]``. Default ``keys``: the sites sown exactly
        once per run (for a site sown several times the plant gradient is a
        partial derivative, the cotangent a total one).
    (a) The VJP of ``x -> (f(x), reap(f)(x))`` fed ``(ct_out, ct_sites)``
        equals ``plant(bwd)(ct_sites, ct_out)``: the backward function with
        the site cotangents planted (added). ``plant_keys``: the sites given
        a cotangent; default every key of ``reap(bwd)``, or with ``subset``
        (a seed) a random non-empty subset of them.
    """
    law_a, law_b = _law(5, "(a) VJP of call_and_reap"), _law(5, "(b) reap of backward")
    values = guard(law_a, lambda: reaped(f, tag, args))
    out = guard(law_a, lambda: f(*args))
    ct_out = random_like(out, 5) if cotangent is None else cotangent

    # (b)
    bwd = guard(law_b, lambda: jax.vjp(f, *args)[1])
    got_b = guard(law_b, lambda: reaped(bwd, tag, (ct_out,)))
    only_on_left(law_b, [display(k) for k in got_b if k not in values])
    missing(law_b, [k for k in values if k not in got_b], Evidence(f, args, tag).dead,
            "constant or dead sites", strict_keys)
    if keys is None:  # (not a cotangent of a pass f runs: one per pass)
        split = label_split(f, tag, args)
        keys = [k for k in default_keys(f, args, tag, values, lambda i: i.once)
                if "vjp" not in split(k)[0]]
    for k in map(normalize, keys):
        if k in got_b:  # a missing key was excused above
            want_k = guard(law_b, lambda k=k: _plant_gradient(f, args, tag, k, values[k], ct_out))
            compare(law_b, k, got_b[k], want_k, rtol, atol)

    # (a)
    plant_keys = (_subset(got_b, subset) if plant_keys is None
                  else [normalize(k) for k in plant_keys])
    ct_sites = {k: random_like(values[k], 50 + i) for i, k in enumerate(plant_keys)}
    got = guard(law_a, lambda: _vjp_of_call_and_reap(f, args, tag, ct_out, ct_sites))
    want = guard(law_a, lambda: lh.plant(bwd, tag=tag)(ct_sites, ct_out))
    compare(law_a, None, got, want, rtol, atol)


def check_roundtrip(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                    atol: float = ATOL, keys: Iterable[Any] | None = None,
                    subset: int | None = None, planted: Callable | None = None,
                    forward: bool = True, reverse: bool = True) -> None:
    """Law 6: ``plant(f)(reap(f)(x), x) == f(x)``, and harvest keeps the rest.

    Plants the reaped values of ``keys`` (default: every key except
    cotangent keys, which plant additively, and clobber sites sown more than
    once, whose plant replaces every sow); with ``subset`` (a seed) a random
    non-empty subset of those, the others passing through. Also checks that
    ``harvest(f)(half, x)`` returns ``f(x)`` and reaps every other key with
    its value.

    With ``planted(plants, *args)`` (``f`` with ``plants`` written in place
    of its sites, in JAX alone, its custom rules kept) random plants at the
    same keys: ``plant(f)(plants, x)`` equals it, and so do its JVP
    (``forward``) and VJP (``reverse``) with respect to ``x``: a planted
    value is a constant of the program, also for a custom rule that
    differentiates it (SPEC 9, "Plants and custom rules").
    """
    law = _law(6)
    values = guard(law, lambda: reaped(f, tag, args))
    if keys is None:
        keys = default_keys(f, args, tag, values,
                            lambda i: not (i.mode == "clobber" and i.count > 1))
        split = label_split(f, tag, args)
        keys = _subset([k for k in keys if "vjp" not in split(k)[0]], subset)
    keys = [normalize(k) for k in keys]
    want = guard(law, lambda: f(*args))
    got = guard(law, lambda: lh.plant(f, tag=tag)({k: values[k] for k in keys}, *args))
    compare(_law(6, "plant"), None, got, want, rtol, atol)
    half = keys[::2]
    out, d = guard(law, lambda: lh.harvest(f, tag=tag)({k: values[k] for k in half}, *args))
    compare(_law(6, "harvest output"), None, out, want, rtol, atol)
    rest = {k: v for k, v in values.items() if k not in half}
    compare_dicts(_law(6, "harvest reaps the unplanted sites"),
                  guard(law, lambda: flat(d)), rest, rtol, atol)
    if planted is not None and keys:
        plants = {k: random_like(values[k], 60 + i) for i, k in enumerate(keys)}
        _check_planted_program(f, args, tag, plants, planted, forward, reverse, rtol, atol)


def _check_planted_program(f: Callable, args: Sequence[Any], tag: Hashable,
                           plants: Mapping[Key, Any], planted: Callable, forward: bool,
                           reverse: bool, rtol: float, atol: float) -> None:
    """Law 6 with new values: ``plant(f)(plants, .)`` against ``planted(plants, .)``,
    as a function and under ``jax.jvp`` / ``jax.vjp`` in the inputs."""
    ours = lambda *a: lh.plant(f, tag=tag)(plants, *a)  # noqa: E731
    theirs = lambda *a: planted(plants, *a)  # noqa: E731
    law = _law(6, "new values planted")
    compare(law, None, guard(law, lambda: ours(*args)), guard(law, lambda: theirs(*args)),
            rtol, atol)
    if forward:
        law, t = _law(6, "jvp of the planted program"), random_like(args, 9)
        compare(law, None, guard(law, lambda: jax.jvp(ours, args, t)[1]),
                guard(law, lambda: jax.jvp(theirs, args, t)[1]), rtol, atol)
    if reverse:
        law, ct = _law(6, "vjp of the planted program"), random_like(jax.eval_shape(f, *args), 10)
        compare(law, None, guard(law, lambda: jax.vjp(ours, *args)[1](ct)),
                guard(law, lambda: jax.vjp(theirs, *args)[1](ct)), rtol, atol)


def check_compute(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL,
                  atol: float = ATOL) -> None:
    """Law 8: ``d.compute(*keys)`` equals forcing the leaves one by one.

    Also: a sub-set and every prefix sub-view computes the same values, and
    ``d.thunk(*k)()`` / ``d.fn(*k)(*args)`` agree with ``d[k]``.
    """
    law = _law(8)
    one = guard(law, lambda: lh.reap(f, tag=tag)(*args))
    by_one = {normalize(k): guard(law, lambda k=k: one[k]) for k in list(one.keys())}
    together = guard(law, lambda: reaped(f, tag, args))
    compare_dicts(_law(8, "compute()"), together, by_one, rtol, atol)
    keys = list(by_one)
    if len(keys) >= 2:
        some = [keys[0], keys[-1]]
        d = guard(law, lambda: lh.reap(f, tag=tag)(*args))
        nested = guard(law, lambda: d.compute(*map(display, some)))
        for k in some:
            compare(_law(8, "compute(k1, k2)"), k, get_nested(nested, k), by_one[k],
                    rtol, atol)
    prefixes = {k[:i] for k in keys for i in range(1, len(k))}
    for pre in sorted(prefixes, key=len)[:4]:
        d = guard(law, lambda: lh.reap(f, tag=tag)(*args))
        sub = guard(law, lambda: d[display(pre)])
        nested = guard(law, lambda: sub.compute())
        for k in keys:
            if k[:len(pre)] == pre:
                compare(_law(8, f"sub-view {pre!r}"), k, get_nested(nested, k[len(pre):]),
                        by_one[k], rtol, atol)
    d = lh.reap(f, tag=tag)(*args)
    for k in keys[:3]:
        compare(_law(8, "thunk"), k, guard(law, lambda: d.thunk(*k)()), by_one[k], rtol, atol)
        compare(_law(8, "fn"), k, guard(law, lambda: d.fn(*k)(*args)), by_one[k], rtol, atol)


def _insert_scope(key: Key, scope: str, split: Callable[[Key], tuple[tuple, tuple]]) -> Key:
    labels, rest = split(key)
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
    plain = guard(law, lambda: reaped(f, tag, args))
    nested_f = lh.nest(f, scope=scope)
    out, d = guard(law, lambda: lh.call_and_reap(nested_f, tag=tag)(*args))
    compare(_law(9, "output"), None, out, f(*args), rtol, atol)
    got = guard(law, lambda: flat(d))
    split = label_split(f, tag, args)
    want = {_insert_scope(k, scope, split): v for k, v in plain.items()}
    compare_dicts(law, got, want, rtol, atol)
    unlabelled = {k: v for k, v in plain.items() if not split(k)[0]}
    if unlabelled:
        sub = guard(law, lambda: flat(d[scope]))
        sub = {k: v for k, v in sub.items() if not split(k)[0]}
        compare_dicts(_law(9, f"sub-view d[{scope!r}]"), sub, unlabelled, rtol, atol)
        plants = {k: jax.tree_util.tree_map(
            lambda v: v * 0.5 + 0.25 if is_float(v) else v, v) for k, v in unlabelled.items()}
        want_out = guard(law, lambda: lh.plant(f, tag=tag)(plants, *args))
        got_out = guard(law, lambda: lh.plant(nested_f, tag=tag)({scope: plants}, *args))
        compare(_law(9, "plant"), None, got_out, want_out, rtol, atol)


# --- law 7 --------------------------------------------------------------------

class _Spellings(Mapping):
    """Perturbations keyed by key tuples that also take a one-part key's bare
    name (``eps["h0"]`` or ``eps[("h0",)]``), as ``slices`` and DelayedDict do."""

    def __init__(self, table: Mapping) -> None:
        self._table = table

    def __getitem__(self, key: Any) -> Any:
        return self._table[normalize(key)]

    def __iter__(self) -> Any:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class _Law7:
    """The parts of law 7 for one function, its inputs and its slices."""

    def __init__(self, f: Callable, args: tuple, tag: Hashable, slices: Mapping[Key, Callable],
                 rtol: float, atol: float, strict_keys: bool,
                 split: Callable[[Key], tuple[tuple, tuple]] | None = None):
        self.f, self.args, self.tag, self.slices = f, args, tag, slices
        self.rtol, self.atol, self.strict_keys = rtol, atol, strict_keys
        self.split = split or (lambda k: ((), tuple(k)))

    def reap(self, f: Callable, *args: Any) -> Any:
        return lh.reap(f, tag=self.tag)(*args)

    def under(self, label: str | None = None) -> dict[Key, tuple[tuple, tuple]]:
        """Per slice key, (labels, rest) of its key under one more, outer,
        level (``label``; None: the same key). Labels are written innermost
        first: the tangent of an inner pass's cotangent ``("vjp", k)`` is
        ``("vjp", "jvp", k)``."""
        out = {}
        for k in self.slices:
            labels, rest = self.split(k)
            out[k] = ((*labels, label) if label else labels, rest)
        return out

    def leaves(self, law: str, d: Any, keys: Mapping[Key, tuple[tuple, tuple]],
               expected: Mapping[Key, Any], excuse: Callable[[Key], bool] = lambda k: False,
               what: str = "") -> None:
        """``d[(*labels, *rest)] == expected[k]`` for ``keys[k] = (labels,
        rest)``, one leaf at a time (the lazy path); a key absent from ``d``
        must be excused by ``excuse``."""
        present = {normalize(k) for k in d}
        # a key two sites would share is spelled out (scopes like labels;
        # the levels of a site inside an inner differentiation, "primal"
        # included: `split`)
        spelled = spelling(d)

        def spelled_as(lab: tuple, rest: tuple) -> Key:
            short = tuple(x for x in lab if x != "primal")
            full = spelled.get((("|",) + lab, rest)) if "primal" in lab else None
            return full or spelled.get((short, rest), (*short, *rest))
        keys = {k: spelled_as(lab, rest) for k, (lab, rest) in keys.items()}
        missing(law, [k for k, dk in keys.items() if dk not in present], excuse, what,
                self.strict_keys)
        for k, dk in keys.items():
            if dk in present:
                compare(law, dk, guard(law, lambda: d[dk]), expected[k], self.rtol, self.atol)

    def under_stack(self, stack: Stack) -> None:
        """Every key ``Stack.key_labels`` names, against ``Stack.expected``."""
        law = _law(7, f"recorded transforms {stack}")
        d = guard(law, lambda: self.reap(stack.apply(self.f), *self.args))
        spelled = spelling(d)
        for mask, labels in stack.key_labels():
            for k, s in self.slices.items():
                value = guard(law, lambda s=s: stack.expected(s, mask)(*self.args))
                key = (*labels, *k)
                if key not in d:  # a key two sites would share is spelled out
                    key = spelled.get((tuple(labels), k), key)
                compare(law, key, guard(law, lambda: d[key]), value, self.rtol, self.atol)

    def plain(self) -> dict[Key, Any]:
        """Checks the plain keys; returns the slices' values."""
        want = {k: guard(_law(7, "slice"), lambda s=s: s(*self.args))
                for k, s in self.slices.items()}
        law = _law(7, "plain keys")
        d = guard(law, lambda: self.reap(self.f, *self.args))
        same_keys(law, map(normalize, d.keys()), want)
        for k in want:  # one leaf at a time: the lazy path
            compare(law, k, guard(law, lambda: d[k]), want[k], self.rtol, self.atol)
        return want

    def tangent_keys(self, want: Mapping[Key, Any], t: Any) -> dict[Key, Any]:
        """Checks the keys under ``jax.jvp``; returns the slices' tangents."""
        law = _law(7, "jvp keys")
        tan = {k: guard(law, lambda s=s: jax.jvp(s, tuple(self.args), t)[1])
               for k, s in self.slices.items()}
        d = guard(law, lambda: self.reap(lambda *a: jax.jvp(self.f, a, t), *self.args))
        self.leaves(law, d, self.under(), want)
        self.leaves(law, d, self.under("jvp"), tan, lambda k: all_zero(tan[k]), "constant sites")
        return tan

    def cotangent_keys(self, want: Mapping[Key, Any], perturb: Callable, ct: Any,
                       constant: Callable[[Key], bool]) -> dict[Key, Any]:
        """Checks the keys under ``jax.vjp``; returns the perturbations' cotangents."""
        law = _law(7, "vjp keys")
        eps0 = {k: zeros_like_tree(v) for k, v in want.items()}
        ct_sites = guard(law, lambda: jax.vjp(lambda e: perturb(_Spellings(e), *self.args),
                                              eps0)[1](ct)[0])
        d = guard(law, lambda: self.reap(lambda *a: jax.vjp(self.f, *a)[1](ct), *self.args))
        self.leaves(_law(7, "values under reverse mode"), d, self.under(), want)
        self.leaves(law, d, self.under("vjp"), ct_sites, constant, "constant sites")
        return ct_sites

    def backward_function(self, ct: Any, ct_sites: Mapping[Key, Any],
                          constant: Callable[[Key], bool]) -> None:
        """The reaped backward function of ``jax.vjp``: plain keys, cotangent values."""
        law = _law(7, "reaped backward function")
        _, bwd = jax.vjp(self.f, *self.args)
        db = guard(law, lambda: self.reap(bwd, ct))
        self.leaves(law, db, self.under(), ct_sites,
                    lambda k: constant(k) or all_zero(ct_sites[k]), "constant or dead sites")

    def linear_function(self, want: Mapping[Key, Any], t: Any, tan: Mapping[Key, Any],
                        ct_sites: Mapping[Key, Any] | None) -> None:
        """The reaped linear function of ``jax.linearize``: plain keys, tangent values."""
        law = _law(7, "reaped linear function")
        _, lin = jax.linearize(self.f, *self.args)
        dl = guard(law, lambda: self.reap(lin, *t))
        if ct_sites is not None:
            dead = lambda k: all_zero(tan[k]) or all_zero(ct_sites[k])  # noqa: E731
        else:
            ev = Evidence(self.f, self.args, self.tag)
            dead = lambda k: all_zero(tan[k]) or ev.dead(k)  # noqa: E731
        what = "constant or dead sites"
        _, got_v = _split_linear({normalize(k): None for k in dl}, split_of(dl))
        if got_v and not self.strict_keys:  # a while_loop: jax.jvp's keys (law 1)
            self.leaves(law, dl, {k: v for k, v in self.under().items() if k in got_v}, want)
            self.leaves(law, dl, self.under("jvp"), tan, dead, what)
            return
        self.leaves(law, dl, self.under(), tan, dead, what)
        only_on_left(law, [k for k in map(normalize, dl.keys()) if k not in self.slices])


def check_lazy(f: Callable, *args: Any, tag: Hashable, slices: Mapping[Any, Callable],
               perturb: Callable | None = None, stack: Stack | None = None,
               forward: bool = True, linear: bool = True, rtol: float = RTOL,
               atol: float = ATOL, tangents: Any = None, cotangent: Any = None,
               strict_keys: bool = False,
               split: Callable[[Key], tuple[tuple, tuple]] | None = None) -> None:
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

    A derivative key may be missing only for a constant site (zero tangent)
    or, for the linear/backward functions, a dead one (zero cotangent), as
    docs/laws.md narrows SPEC; ``strict_keys=True`` requires every key.
    ``split(k)`` gives (labels, rest) of a slice key whose site lies inside
    a differentiation of ``f``: every level written, ``("primal",)`` for
    its value, ``("vjp",)`` for the cotangent an inner ``jax.grad`` gives it
    (``Program.split``); default: keys carry no labels. The keys the checks
    read drop ``"primal"`` but where two sites would share one.
    """
    law7 = _Law7(f, args, tag, {normalize(k): s for k, s in slices.items()}, rtol, atol,
                 strict_keys, split)
    if stack is not None:
        law7.under_stack(stack)
        return
    want = law7.plain()
    t: Any = None
    tan: dict = {}
    if forward:
        t = random_like(args, 7) if tangents is None else tangents
        tan = law7.tangent_keys(want, t)
    ct_sites = None
    if perturb is not None:
        ct = random_like(jax.eval_shape(f, *args), 8) if cotangent is None else cotangent
        constant = (lambda k: all_zero(tan[k])) if forward else (lambda k: True)
        ct_sites = law7.cotangent_keys(want, perturb, ct, constant)
        if linear:
            law7.backward_function(ct, ct_sites, constant)
    if forward and linear:
        law7.linear_function(want, t, tan, ct_sites)


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
        other = x * 0.75 + 0.125 if is_float(x) else x
        return jnp.stack([x, other], axis=in_axes)
    return tuple(jax.tree_util.tree_map(one, a) for a in args)


def _what_applies(f: Callable, args: Sequence[Any],
                  tag: Hashable) -> tuple[bool, str | None, str | None]:
    """(whether f's keys carry labels, why forward mode does not apply, why
    reverse mode does not); a reason is None where the mode applies."""
    try:
        keys = list(reaped(f, tag, args))
        out_shape = jax.eval_shape(f, *args)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"check_all: reaping f failed: {type(e).__name__}: {e}") from e
    split = label_split(f, tag, args)
    labelled = any(split(k)[0] for k in keys)
    if not (float_leaves(args) and float_leaves(out_shape)):
        why = "needs floating inputs and outputs"
        return labelled, why, why
    forward: str | None = None
    try:  # JAX cannot run forward mode through a custom_vjp function (an
        # error only when run: not seen by eval_shape)
        jax.linearize(f, *args)[1](*random_like(args, 0))
    except TypeError as e:
        forward = f"f is not forward-differentiable ({type(e).__name__})"
    try:
        ct = random_like(out_shape, 0)
        jax.eval_shape(lambda *a: jax.vjp(f, *a)[1](ct), *args)
        # (JAX drops a while loop nothing reads from jax.vjp(f), not from
        # the VJP of call_and_reap(f), where its sites are outputs)
        jax.eval_shape(lambda *a: _vjp_of_call_and_reap(f, a, tag, ct, {}), *args)
    except Exception as e:  # noqa: BLE001
        return labelled, forward, f"f is not reverse-differentiable ({type(e).__name__})"
    return labelled, forward, None


class _Runner:
    """Runs the chosen laws one by one, so that every failure is reported."""

    def __init__(self, laws: Iterable[int], verbose: bool = False):
        self.laws = set(laws)
        self.verbose = verbose
        self.results: dict[int, str] = {}
        self.failures: list[AssertionError] = []

    def __call__(self, n: int, thunk: Callable[[], Any], skip: str | None = None) -> None:
        if n not in self.laws:
            return
        if skip:
            self.results[n] = f"skipped: {skip}"
        else:
            start = time.perf_counter()
            try:
                thunk()
            except AssertionError as e:
                self.failures.append(e)
                self.results[n] = "failed"
            else:
                self.results[n] = "passed"
            took = time.perf_counter() - start
        if self.verbose:  # one line per law, as it finishes: long runs show progress
            when = "" if skip else f" ({took:.1f} s)"
            print(f"law {n} ({LAWS[n][0]}): {self.results[n]}{when}", flush=True)

    def report(self) -> LawReport:
        if self.failures:
            # (the first failure's cause, an error a law raised, stays reachable)
            first = self.failures[0]
            raise AssertionError("\n\n".join(map(str, self.failures))) from (
                first.__cause__ or first)
        return LawReport(self.results)


def check_all(f: Callable, *args: Any, tag: Hashable, rtol: float = RTOL, atol: float = ATOL,
              slices: Mapping[Any, Callable] | None = None, perturb: Callable | None = None,
              vmap_axes: Sequence[tuple[Any, Any]] = ((0, 0), (0, -1)),
              scope: str = "law9", laws: Iterable[int] = tuple(LAWS),
              verbose: bool = False) -> LawReport:
    """Runs every law of docs/laws.md that applies to ``f`` at ``args``.

    Laws 1, 2 (forward mode) need floating inputs and outputs; law 5 needs
    ``f`` to be reverse-differentiable (no ``while_loop``); laws 1, 2, 5 need
    keys without labels (``f`` does not differentiate inside); law 3 needs
    ``lh.vmap`` and runs for each ``(in_axes, out_axes)`` in ``vmap_axes`` on
    two stacked copies of ``args``; law 7 needs ``slices`` (and ``perturb``
    for the cotangent keys). Every failing law is reported in one
    ``AssertionError``; otherwise a ``LawReport`` says what ran. With
    ``verbose``, one line per law is printed as it finishes (time, result).
    """
    run = _Runner(laws, verbose)
    kw: dict[str, Any] = dict(tag=tag, rtol=rtol, atol=atol)
    labelled, forward_skip, reverse_skip = _what_applies(f, args, tag)
    label_skip = "keys carry labels (f differentiates inside)" if labelled else None
    run(1, lambda: check_linearize(f, *args, **kw), label_skip or forward_skip)
    run(2, lambda: check_jvp(f, *args, **kw), label_skip or forward_skip)
    vmap = getattr(lh, "vmap", None)

    def law3() -> None:
        for in_axes, out_axes in vmap_axes:
            bargs = _batched(args, in_axes)
            check_vmap(f, *bargs, in_axes=in_axes, out_axes=out_axes, **kw)
    run(3, law3, None if vmap is not None else "needs lh.vmap (recorded transforms)")
    run(4, lambda: check_jit(f, *args, **kw))
    run(5, lambda: check_vjp(f, *args, **kw), label_skip or reverse_skip)
    run(6, lambda: check_roundtrip(f, *args, **kw))
    run(7, lambda: check_lazy(f, *args, slices=slices or {}, forward=forward_skip is None,
                              perturb=perturb if reverse_skip is None else None, **kw),
        None if slices is not None else "needs slices= (the sites written with JAX alone)")
    run(8, lambda: check_compute(f, *args, **kw))
    run(9, lambda: check_nest(f, *args, scope=scope, **kw))
    return run.report()
