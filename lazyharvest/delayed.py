"""`DelayedDict`: a read-only mapping whose leaves are computed when read."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from lazyharvest import _jax
from lazyharvest import keys as keys_mod
from lazyharvest.errors import HarvestError, closest
from lazyharvest.program import NO_PLANTS, PlantSpec, Traced, flatten_args


class HarvestKeyError(HarvestError, KeyError):
    """An unknown key; also a `KeyError`, so `in` and `.get` work."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class _Store:
    """State shared by a DelayedDict and its sub-views."""

    def __init__(self, traced: Traced, args: list, plants: PlantSpec,
                 plant_leaves: list):
        self.traced = traced
        self.args = args
        self.plants = plants
        self.plant_leaves = plant_leaves
        self.traced_inputs = _jax.any_tracer(args) or _jax.any_tracer(plant_leaves)
        self.values: dict = {}
        self.lock = threading.RLock()

    def force(self, raw_keys: list) -> None:
        with self.lock:
            missing = [k for k in dict.fromkeys(raw_keys) if k not in self.values]
            if not missing:
                return
            if self.traced_inputs and any(
                    _jax.tracer_is_dead(x) for x in (*self.args, *self.plant_leaves)):
                names = ", ".join(repr(keys_mod.display(self.traced.key_of[k][0]))
                                  for k in missing)
                raise HarvestError(
                    f"harvest of tag {self.traced.harvest.tag!r}: cannot force "
                    f"{names}: the DelayedDict was made inside a transformation "
                    f"(jit/vmap/grad...) whose trace has ended. Force the leaves "
                    f"inside it (e.g. return d.compute() from the traced function).")
            prog = self.traced.program(missing, with_out=False, plants=self.plants)
            flat = prog(*self.args, *self.plant_leaves)
            it = iter(flat)
            for k in missing:
                site = self.traced.sites[k]
                leaves = [next(it) for _ in site.avals]
                self.values[k] = jax.tree_util.tree_unflatten(site.tree, leaves)


class DelayedDict(Mapping):
    """Reaped values keyed by `(*labels, *scopes, name)`, computed on access.

    `keys()`, `len`, `in` and `avals` need no computation. `d[key]` compiles
    and runs only the slice of the program that produces that value (once:
    it is memoized). A key that is a prefix of longer keys gives a sub-view.
    `compute(*keys)` forces several leaves in one program.
    """

    def __init__(self, store: _Store, prefix: tuple = ()):
        self._store = store
        self._prefix = prefix
        n = len(prefix)
        index = store.traced.key_index(store.plants)
        self._leaves = index if not n else {
            k[n:]: r for k, r in index.items() if k[:n] == prefix and k[n:]}

    @classmethod
    def from_trace(cls, traced: Traced, args: list, plants: PlantSpec = NO_PLANTS,
                   plant_leaves: list | tuple = ()) -> DelayedDict:
        """The DelayedDict of one call: a trace, the call's flat arguments and,
        when the call plants, which sites it plants and the planted leaves."""
        return cls(_Store(traced, list(args), plants, list(plant_leaves)))

    # -- Mapping --------------------------------------------------------------

    @_jax.api_boundary
    def __getitem__(self, key: Any) -> Any:
        k = keys_mod.normalize(key)
        raw = self._leaves.get(k)
        if raw is not None:
            self._store.force([raw])
            return self._store.values[raw]
        if any(full[:len(k)] == k for full in self._leaves):
            return DelayedDict(self._store, self._prefix + k)
        raise self._unknown(k)

    def __iter__(self) -> Iterator[Any]:
        return (keys_mod.display(k) for k in self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, key: object) -> bool:
        return keys_mod.normalize(key) in self._leaves

    # -- laziness -------------------------------------------------------------

    def thunk(self, *key: Any) -> Callable[[], Any]:
        """The zero-argument function that forces `key`."""
        raw = self._raw(key)
        def force() -> Any:
            self._store.force([raw])
            return self._store.values[raw]
        return force

    def fn(self, *key: Any) -> Callable[..., Any]:
        """The leaf as a function of the reaped function's inputs.

        It runs the same compiled slice; arguments must have the shapes and
        dtypes of the call that made this DelayedDict.
        """
        raw = self._raw(key)
        store = self._store
        traced = store.traced

        def continuation(*args: Any, **kwargs: Any) -> Any:
            flat, _, avals = flatten_args(args, kwargs)
            if avals != traced.in_avals:
                raise HarvestError(
                    f"harvest of tag {traced.harvest.tag!r}: the continuation of "
                    f"{keys_mod.display(traced.key_of[raw][0])!r} takes arguments "
                    f"shaped like the original call {traced.in_avals}, got "
                    f"{avals}. Call the reaped function again for new shapes.")
            prog = traced.program([raw], with_out=False, plants=store.plants)
            leaves = prog(*flat, *store.plant_leaves)
            return jax.tree_util.tree_unflatten(traced.sites[raw].tree, leaves)
        return continuation

    def compute(self, *keys: Any) -> dict:
        """Forces the given leaves (all when none) in one program.

        Returns a plain nested dict of arrays, nested by key parts. With no
        keys, each leaf appears once, under its shortest alias.
        """
        wanted = self._expand(keys) if keys else self._shortest()
        self._store.force([self._leaves[k] for k in wanted])
        out: dict = {}
        for k in wanted:
            node = out
            for part in k[:-1]:
                node = node.setdefault(part, {})
            node[k[-1]] = self._store.values[self._leaves[k]]
        return out

    def lower(self, *keys: Any) -> Any:
        """The `jax.stages.Lowered` program that `compute(*keys)` runs.

        For inspection: `.as_text()`, `.compile().memory_analysis()`,
        `.cost_analysis()`.
        """
        wanted = self._expand(keys) if keys else self._shortest()
        raws = list(dict.fromkeys(self._leaves[k] for k in wanted))
        prog = self._store.traced.program(raws, with_out=False, plants=self._store.plants)
        return prog.fn.lower(*self._store.args, *self._store.plant_leaves)

    @property
    def avals(self) -> dict:
        """Shape and dtype of every leaf (as `jax.ShapeDtypeStruct` pytrees)."""
        sites = self._store.traced.sites
        return {keys_mod.display(k): jax.tree_util.tree_unflatten(
                    sites[r].tree,
                    [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in sites[r].avals])
                for k, r in self._leaves.items()}

    def is_computed(self, *key: Any) -> bool:
        return self._raw(key) in self._store.values

    # -- helpers --------------------------------------------------------------

    def _raw(self, key: tuple) -> Any:
        k = tuple(key) if len(key) != 1 else keys_mod.normalize(key[0])
        raw = self._leaves.get(k)
        if raw is None:
            raise self._unknown(k)
        return raw

    def _shortest(self) -> list:
        best: dict = {}
        for k, r in self._leaves.items():
            if r not in best or len(k) < len(best[r]):
                best[r] = k
        return list(best.values())

    def _expand(self, keys: tuple) -> list:
        out = []
        for key in keys:
            k = keys_mod.normalize(key)
            if k in self._leaves:
                out.append(k)
                continue
            below = [full for full in self._leaves if full[:len(k)] == k]
            if not below:
                raise self._unknown(k)
            out += below
        return list(dict.fromkeys(out))

    def _unknown(self, k: tuple) -> HarvestKeyError:
        shown = [keys_mod.display(x) for x in self._leaves]
        near = closest(str(keys_mod.display(k)), [str(s) for s in shown])
        return HarvestKeyError(
            f"harvest of tag {self._store.traced.harvest.tag!r}: no key "
            f"{keys_mod.display(k)!r}. Closest keys: {near}. All keys: {shown}.")

    def _tree(self) -> dict:
        out: dict = {}
        values = self._store.values
        sites = self._store.traced.sites
        for k, r in self._leaves.items():
            node = out
            for part in k[:-1]:
                node = node.setdefault(part, {})
            node[k[-1]] = (_Shown(values[r]) if r in values
                           else _Pending(sites[r].avals))
        return out

    def __repr__(self) -> str:
        return f"DelayedDict({self._tree()!r})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text("DelayedDict(...)" if cycle else repr(self))

    # -- notebooks (lazyharvest/display.py; imported here, lazily, as it reads us)

    def _repr_html_(self) -> str:
        """A collapsible HTML tree of the leaves; forces nothing."""
        from lazyharvest import display
        return display.to_html(self)

    def summary(self, compute: bool = False) -> Any:
        """A table of every leaf: key, shape, dtype, state, L2 norm, max |x|.

        Arguments:
          compute: first force every leaf, in one program (`self.compute()`);
            otherwise pending leaves stay pending and show no numbers.
        Returns:
          a `lazyharvest.display.SummaryTable`: `str()` gives aligned text,
          notebooks render it as HTML, `.rows` holds the values.

        Example: `print(lh.reap(jax.grad(loss), tag="act")(p, x).summary(True))`.
        """
        from lazyharvest import display
        return display.summary(self, compute=compute)


class _Pending:
    def __init__(self, avals: tuple):
        self.avals = avals

    def __repr__(self) -> str:
        shown = ", ".join(a.str_short(short_dtypes=True) for a in self.avals)
        return f"<pending {shown}>"


class _Shown:
    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        leaves, tree = jax.tree_util.tree_flatten(self.value)
        shown = [_short(x) for x in leaves]
        return repr(jax.tree_util.tree_unflatten(tree, [_Raw(s) for s in shown]))


class _Raw:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _short(x: Any) -> str:
    if _jax.is_tracer(x):
        return f"<traced {jax.typeof(x).str_short(short_dtypes=True)}>"
    a = np.asarray(x)
    if a.size <= 8:
        if np.issubdtype(a.dtype, np.floating):  # 6 significant digits, as float32 has
            return repr(np.vectorize(lambda v: float(f"{v:.6g}"), otypes=[float])(a).tolist())
        return repr(a.tolist())
    return f"<{jax.typeof(x).str_short(short_dtypes=True)}>"
