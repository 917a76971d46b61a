"""`DelayedDict`: a read-only mapping whose leaves are computed when read."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lazyharvest import _jax
from lazyharvest import keys as keys_mod
from lazyharvest._interpreter import split_list
from lazyharvest.errors import HarvestError, closest
from lazyharvest.program import NO_PLANTS, PlantSpec, Traced, canonical_keys, flatten_args


class HarvestKeyError(HarvestError, KeyError):
    """An unknown key; also a `KeyError`, so `in` and `.get` work."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


_MISSING = object()
_PLANS_PER_TRACE = 256  # `compute` key plans kept per trace


_ARRAYS = {_jax.ArrayImpl}
_aval = operator.attrgetter("aval")
_ONE_LEAF = jax.tree_util.tree_structure(0)


class _Store:
    """State shared by a DelayedDict and its sub-views."""

    __slots__ = ("traced", "args", "plants", "plant_leaves", "traced_inputs",
                 "values", "lock", "reads")

    def __init__(self, traced: Traced, args: Sequence[Any], plants: PlantSpec = NO_PLANTS,
                 plant_leaves: Sequence[Any] = (), concrete: bool = False,
                 reads: set | None = None):
        self.traced = traced
        # (the raw keys read, where the next call predicts its reads from
        # this one's: an eager `call_and_reap`)
        self.reads = reads
        self.args = args
        self.plants = plants
        self.plant_leaves = plant_leaves
        # Made inside a trace (inputs or closed-over values are tracers): its
        # leaves belong to that trace, and die with it. (`concrete`: the
        # caller knows `args` are arrays, not tracers.)
        self.traced_inputs = (traced.tracer_consts or (not concrete and _jax.any_tracer(args))
                              or (plant_leaves and _jax.any_tracer(plant_leaves)))
        self.values: dict = {}
        # (the trace's: one per call would cost more than the call's other
        # bookkeeping; programs are built and compiled under it anyway)
        self.lock = traced.lock

    @property
    def inputs(self) -> tuple:
        return (*self.args, *self.plant_leaves, *self.traced.jaxpr.consts)

    def force_one(self, raw: Any) -> Any:
        """The value of one leaf (`force([raw])[raw]`, with less work)."""
        if self.reads is not None:
            self.reads.add(raw)
        if not self.traced_inputs:
            value = self.values.get(raw, _MISSING)
            if value is not _MISSING:
                return value  # memoized: no lock needed
        with self.lock:
            if self.traced_inputs and any(map(_jax.tracer_is_dead, self.inputs)):
                raise self._ended([raw])
            value = self.values.get(raw, _MISSING)
            if value is not _MISSING:
                return value
            if self.plants.entries:
                prog = self.traced.program((raw,), with_out=False, plants=self.plants)
                flat = prog(*self.args, *self.plant_leaves)
                value = self.traced.sites[raw].tree.unflatten(flat)
            else:
                hit = self.traced.plain_programs.get((raw,))
                prog, spans = self.traced.plain_program((raw,)) if hit is None else hit
                prog.used = True  # see Traced.plain_program
                flat = prog(*self.args)
                value = flat[0] if spans is None else spans[0][3].unflatten(flat)
            if self.traced_inputs or not _jax.any_tracer(flat):
                self.values[raw] = value
            return value

    def force(self, raw_keys: Sequence[Any], unique: bool = False) -> dict:
        """The values of `raw_keys` (`unique`: listed once each), computing
        the missing ones in one program.

        A DelayedDict made outside any trace but read inside one (`jax.jit`
        of a closure over it) stages its program into that trace and keeps
        nothing: memoizing a tracer would poison it for later reads.
        """
        if self.reads is not None:
            self.reads.update(raw_keys)
        with self.lock:
            keys = (raw_keys if unique or len(raw_keys) < 2
                    else tuple(dict.fromkeys(raw_keys)))
            if self.traced_inputs and any(map(_jax.tracer_is_dead, self.inputs)):
                raise self._ended(keys)
            values = self.values
            missing: Sequence[Any] = keys
            out: dict = {}
            if values:
                out = {k: values[k] for k in keys if k in values}
                if len(out) == len(keys):
                    return out
                missing = [k for k in keys if k not in out]
            if self.plants.entries:
                prog = self.traced.program(missing, with_out=False, plants=self.plants)
                flat = prog(*self.args, *self.plant_leaves)
                sites = self.traced.sites
                *chunks, _ = split_list(flat, [len(sites[k].avals) for k in missing])
                for k, leaves in zip(missing, chunks):
                    out[k] = sites[k].tree.unflatten(leaves)
            else:
                wanted = tuple(missing)
                hit = self.traced.plain_programs.get(wanted)
                prog, spans = self.traced.plain_program(wanted) if hit is None else hit
                prog.used = True  # see Traced.plain_program
                flat = prog(*self.args)
                if spans is None:
                    out.update(zip(missing, flat))
                else:
                    for k, start, stop, tree in spans:
                        out[k] = flat[start] if tree is None else tree.unflatten(flat[start:stop])
            if self.traced_inputs or not _jax.any_tracer(flat):
                values.update(out)
            return out

    def _ended(self, keys: Sequence[Any]) -> HarvestError:
        names = ", ".join(repr(keys_mod.display(self.traced.key_of[k][0])) for k in keys)
        return HarvestError(
            f"harvest of tag {self.traced.harvest.tag!r}: cannot read {names}: the "
            f"DelayedDict was made inside a transformation (jit/vmap/grad...) whose "
            f"trace has ended. Force the leaves inside it (e.g. return d.compute() "
            f"from the traced function).")


class DelayedDict(Mapping):
    """Reaped values keyed by `(*labels, *scopes, name)`, computed on access.

    A read-only mapping. `keys()`, `len`, `in`, iteration and `avals` need
    no computation and show each leaf once, under its canonical (shortest)
    key; structural aliases (keys that add `"jit"`/`"vmap"` labels) are
    accepted wherever a key is. `d[key]` compiles and runs only the slice of
    the program that produces that value, once (it is memoized). A key that
    is a prefix of longer keys gives a sub-view: `d["grad"]["x3"]`.

    Calling convention: a *key* is always one argument, a string or a tuple
    of strings. Single-leaf methods (`thunk`, `fn`, `is_computed`, `aliases`)
    take one key; multi-leaf methods (`compute`, `lower`) take any number of
    keys. (`d.fn("grad", "x3")`, the parts as separate arguments, still works.)

    Not a pytree, not an array: to return reaped values from `jax.jit` (or
    `vjp`, `make_jaxpr`...), return `d.compute()`.

    **Example:**

    >>> import lazyharvest as lh
    >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
    >>> d
    DelayedDict({'x3': <pending f32[]>, 'grad': {'x3': <pending f32[]>}})
    >>> print(d["x3"], d["grad", "x3"], d["grad"]["x3"])
    8.0 12.0 12.0
    """

    __slots__ = ("_store", "_prefix", "_leaves", "_canonical")

    def __init__(self, store: _Store, prefix: tuple = ()):
        self._store = store
        self._prefix = prefix
        traced = store.traced
        both = traced.indexes.get(None) if store.plants is NO_PLANTS else None
        index, canonical = traced.key_index(store.plants) if both is None else both
        if prefix:
            n = len(prefix)
            index = {k[n:]: r for k, r in index.items() if k[:n] == prefix and k[n:]}
            canonical = canonical_keys(index)
        self._leaves, self._canonical = index, canonical

    @classmethod
    def from_trace(cls, traced: Traced, args: list, plants: PlantSpec = NO_PLANTS,
                   plant_leaves: list | tuple = (),
                   computed: tuple[list, Sequence[Any]] = ([], ()),
                   reads: set | None = None) -> DelayedDict:
        """The DelayedDict of one call.

        **Arguments:**
        - traced: the abstract trace of the harvested function.
        - args: the call's flat array arguments.
        - plants, plant_leaves: which sites the call plants, and the planted leaves.
        - computed: (raw keys, their flat leaves) already computed by the call.
        - reads: a set the raw keys read are added to.
        """
        store = _Store(traced, args, plants, plant_leaves, reads=reads)
        keys, leaves = computed
        if keys:
            *chunks, _ = split_list(leaves, [len(traced.sites[k].avals) for k in keys])
            for k, ls in zip(keys, chunks):
                store.values[k] = jax.tree_util.tree_unflatten(traced.sites[k].tree, ls)
        return cls(store)

    # -- Mapping --------------------------------------------------------------

    @_jax.api_boundary
    def __getitem__(self, key: Any) -> Any:
        k = key if isinstance(key, tuple) else (key,)
        raw = self._leaves.get(k)
        if raw is not None:
            return self._store.force_one(raw)
        if self._has_prefix(k):
            return DelayedDict(self._store, self._prefix + k)
        raise self._unknown(k)

    def __iter__(self) -> Iterator[Any]:
        return (keys_mod.display(k) for k in self._canonical)

    def __len__(self) -> int:
        return len(self._canonical)

    def __contains__(self, key: object) -> bool:
        k = keys_mod.normalize(key)
        return k in self._leaves or self._has_prefix(k)

    # -- one leaf ---------------------------------------------------------------

    def thunk(self, key: Any, *parts: Any) -> Callable[[], Any]:
        """The zero-argument function that forces one leaf.

        **Arguments:**
        - key: one key (a string or a tuple of strings).

        **Returns:** a function `() -> value`; calling it forces and memoizes
        the leaf, as `d[key]` does.

        **Raises:** `HarvestKeyError` for an unknown key.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> print(d.thunk(("grad", "x3"))())
        12.0
        """
        raw = self._raw(key, parts)
        store = self._store
        return lambda: store.force_one(raw)

    def fn(self, key: Any, *parts: Any) -> Callable[..., Any]:
        """One leaf as a function of the reaped function's inputs (its continuation).

        **Arguments:**
        - key: one key (a string or a tuple of strings).

        **Returns:** a function taking the reaped function's arguments and
        returning the leaf's value for them; it runs the same compiled slice.

        **Raises:** `HarvestKeyError` for an unknown key; the returned function
        raises `HarvestError` when its arguments differ in shape or dtype from
        the call that made this DelayedDict.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> print(d.fn(("grad", "x3"))(3.))
        27.0
        """
        raw = self._raw(key, parts)
        store = self._store
        traced = store.traced
        # (avals, jitted slice, leaf tree or None) once a call of positional
        # arrays has run: later such calls of those avals run the slice at
        # once, at the cost of jax.jit's own call (a loop over new inputs)
        fast: list = []

        def continuation(*args: Any, **kwargs: Any) -> Any:
            if fast and not kwargs and set(map(type, args)) == _ARRAYS:
                avals, run, tree = fast[0]
                if tuple(map(_aval, args)) == avals:
                    out = run(*args, *store.plant_leaves)
                    return out[0] if tree is None else tree.unflatten(out)
            flat, spec, avals = flatten_args(args, kwargs)
            if spec != traced.arg_spec or not _same_avals(avals, traced.in_avals):
                raise HarvestError(
                    f"harvest of tag {traced.harvest.tag!r}: the continuation of "
                    f"{keys_mod.display(traced.key_of[raw][0])!r} takes arguments "
                    f"structured and shaped like the original call "
                    f"({traced.arg_spec.in_tree}, {traced.in_avals}); got "
                    f"({spec.in_tree}, {avals}). Call the reaped function again "
                    f"for other arguments.")
            prog = traced.program([raw], with_out=False, plants=store.plants)
            leaves = prog(*flat, *store.plant_leaves)
            tree = traced.sites[raw].tree
            if not kwargs and set(map(type, args)) == _ARRAYS and not store.traced_inputs:
                fast[:] = [(avals, prog.fn, None if tree == _ONE_LEAF else tree)]
            return tree.unflatten(leaves)
        return continuation

    def is_computed(self, key: Any, *parts: Any) -> bool:
        """Whether one leaf has been computed (and memoized) already.

        **Arguments:** `key`: one key. **Returns:** a bool; computes nothing.
        **Raises:** `HarvestKeyError` for an unknown key.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> d.is_computed("x3"), float(d["x3"]), d.is_computed("x3")
        (False, 8.0, True)
        """
        return self._raw(key, parts) in self._store.values

    def aliases(self, key: Any, *parts: Any) -> list:
        """Every key of one leaf, canonical first (the others add structural labels).

        **Arguments:** `key`: one key (any of its aliases). **Returns:** a list
        of keys. **Raises:** `HarvestKeyError` for an unknown key.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.jit(lambda x: lh.sow(x * 2, tag="t", name="y")), tag="t")(1.)
        >>> d.aliases("y")
        ['y', ('jit', 'y')]
        """
        raw = self._raw(key, parts)
        keys = [k for k, r in self._leaves.items() if r == raw]
        keys.sort(key=len)
        return [keys_mod.display(k) for k in keys]

    # -- several leaves ---------------------------------------------------------

    def compute(self, *keys: Any) -> dict:
        """Forces several leaves in one compiled program.

        **Arguments:**
        - *keys: any number of keys (each a string or a tuple); a prefix
          stands for every key below it. None: every leaf.

        **Returns:** a plain nested dict of arrays, nested by key parts, each
        leaf once under the key it was asked by (canonical when none given).

        **Raises:** `HarvestKeyError` for an unknown key.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> out = d.compute("x3", ("grad", "x3"))
        >>> print(out["x3"], out["grad"]["x3"])
        8.0 12.0
        """
        wanted, raws, unique, names = self._plan(keys)
        values = self._store.force(unique, unique=True)
        if names is not None:  # one-part keys: a flat dict
            return dict(zip(names, map(values.__getitem__, raws)))
        return _nest((k, values[r]) for k, r in zip(wanted, raws))

    def _plan(self, keys: tuple) -> tuple[list, list, tuple, tuple | None]:
        """The user keys `compute(*keys)` returns, the leaf of each, the
        leaves once each, and the keys' names if every key has one part;
        kept per trace, plants and view, so a repeated call looks them up once."""
        store = self._store
        plans = store.traced.plans
        plan_key: Any = (store.plants if store.plants.entries else None, self._prefix, keys)
        try:
            plan = plans.get(plan_key)
        except TypeError:  # an unhashable key: reported below
            plan = plan_key = None
        if plan is None:
            wanted = self._expand(keys) if keys else list(self._canonical)
            raws = [self._leaves[k] for k in wanted]
            flat = all(len(k) == 1 for k in wanted)
            plan = (wanted, raws, tuple(dict.fromkeys(raws)),
                    tuple(k[0] for k in wanted) if flat else None)
            if plan_key is not None:
                if len(plans) >= _PLANS_PER_TRACE:
                    plans.clear()
                plans[plan_key] = plan
        return plan

    def lower(self, *keys: Any) -> Any:
        """The `jax.stages.Lowered` program that `compute(*keys)` runs.

        **Arguments:** `*keys`, as for `compute`. **Returns:** the lowered
        program, for inspection: `.as_text()`, `.compile().memory_analysis()`,
        `.cost_analysis()`. **Raises:** `HarvestKeyError` for an unknown key.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> "stablehlo.multiply" in d.lower("x3").as_text()
        True
        """
        wanted = self._expand(keys) if keys else list(self._canonical)
        raws = list(dict.fromkeys(self._leaves[k] for k in wanted))
        prog = self._store.traced.program(raws, with_out=False, plants=self._store.plants)
        return prog.lower(*self._store.args, *self._store.plant_leaves)

    @property
    def avals(self) -> dict:
        """Shape and dtype of every leaf (`jax.ShapeDtypeStruct` pytrees), by
        canonical key; computes nothing.

        **Example:**

        >>> import lazyharvest as lh
        >>> d = lh.reap(lh.grad(lambda x: lh.sow(x ** 3, tag="t", name="x3")), tag="t")(2.)
        >>> d.avals["x3"]
        ShapeDtypeStruct(shape=(), dtype=float32)
        """
        sites = self._store.traced.sites
        return {keys_mod.display(k): jax.tree_util.tree_unflatten(
                    sites[r].tree,
                    [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in sites[r].avals])
                for k, r in ((k, self._leaves[k]) for k in self._canonical)}

    # -- not an array, not copyable -----------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DelayedDict holds a traced program and its arguments and cannot be "
            "pickled or copied; save or copy d.compute() (a plain dict of arrays).")

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce_ex__(None)


    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(self._not_an_array())

    def _not_an_array(self) -> str:
        return (f"a DelayedDict (harvest of tag {self._store.traced.harvest.tag!r}) is "
                f"a lazy mapping, not an array or a pytree: use d[key] for one leaf, "
                f"or d.compute() for a nested dict of arrays (return that from "
                f"jax.jit).")

    # -- helpers --------------------------------------------------------------

    def _has_prefix(self, k: tuple) -> bool:
        n = len(k)
        return n > 0 and any(full[:n] == k and len(full) > n for full in self._leaves)

    def _raw(self, key: Any, parts: tuple = ()) -> Any:
        k = (key, *parts) if parts else keys_mod.normalize(key)
        raw = self._leaves.get(k)
        if raw is None:
            raise self._unknown(k)
        return raw

    def _expand(self, keys: tuple) -> list:
        out = []
        for key in keys:
            k = keys_mod.normalize(key)
            if k in self._leaves:
                out.append(k)
                continue
            below = [full for full in self._canonical if full[:len(k)] == k]
            if not below:
                raise self._unknown(k)
            out += below
        return list(dict.fromkeys(out))

    def _unknown(self, k: tuple) -> HarvestKeyError:
        traced = self._store.traced
        tag = traced.harvest.tag
        shown = [keys_mod.display(x) for x in self._canonical]
        if not traced.names and not self._prefix:
            others = sorted(map(repr, traced.other_tags))
            hint = (f" Tags sown in this program: {', '.join(others)}." if others
                    else " No site of any tag is sown in this program.")
            return HarvestKeyError(
                f"harvest of tag {tag!r}: no key {keys_mod.display(k)!r}: no site "
                f"of tag {tag!r} is sown.{hint} Check the tag's spelling.")
        flat = tuple(p for part in k for p in (part if isinstance(part, tuple) else (part,)))
        if flat != k:  # a tuple inside the key: d[(("vjp", "h1"),)]
            return HarvestKeyError(
                f"harvest of tag {tag!r}: no key {k!r}: a key is one flat tuple of its "
                f"parts, not a tuple holding a tuple; write d[{', '.join(map(repr, flat))}]"
                f" (the key {keys_mod.display(flat)!r}).")
        by_text = {str(s): s for s in shown}
        near = [by_text[t] for t in closest(str(keys_mod.display(k)), by_text)]
        return HarvestKeyError(
            f"harvest of tag {tag!r}: no key {keys_mod.display(k)!r}. "
            f"Closest keys: {near}. All keys: {shown}.")

    def _tree(self) -> dict:
        values = self._store.values
        sites = self._store.traced.sites
        return _nest((k, _Shown(values[r]) if (r := self._leaves[k]) in values
                      else _Pending(sites[r].avals)) for k in self._canonical)

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


LEAF_AT_PREFIX = ""
"""The key, in `compute()`'s nested dict, of a leaf whose key is also a
prefix of other keys (a site named like a scope or a label)."""


def _nest(pairs: Iterable[tuple[tuple, Any]]) -> dict:
    """A dict nested by key parts, with string keys only (a JAX pytree). A
    key that is both a leaf and a prefix of others (a site named like a scope
    or a label) holds a dict there, with the leaf under `LEAF_AT_PREFIX`."""
    pairs = list(pairs)
    prefixes = {k[:i] for k, _ in pairs for i in range(1, len(k))}
    out: dict = {}
    for key, value in pairs:
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        if key in prefixes:
            node = node.setdefault(key[-1], {})
            node[LEAF_AT_PREFIX] = value
        else:
            node[key[-1]] = value
    return out


def _same_avals(a: tuple, b: tuple) -> bool:
    """Equal shapes and dtypes; weak types may differ (a Python float for f32)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


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
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        return f"<{jax.typeof(x).str_short(short_dtypes=True)}>"  # no numbers to show
    if not getattr(x, "is_fully_addressable", True):  # spread over processes
        return f"<{jax.typeof(x).str_short(short_dtypes=True)} not addressable here>"
    a = np.asarray(x)
    if a.size <= 8:
        if np.issubdtype(a.dtype, np.floating):  # 6 significant digits, as float32 has
            return repr(np.vectorize(lambda v: float(f"{v:.6g}"), otypes=[float])(a).tolist())
        return repr(a.tolist())
    return f"<{jax.typeof(x).str_short(short_dtypes=True)}>"


def _refuse_flatten(d: DelayedDict) -> Any:
    raise TypeError(d._not_an_array())


# Not a pytree: any use as one (returning it from jax.jit, tree_map over it)
# gets the error that says what to do, not JAX's generic one.
jax.tree_util.register_pytree_node(
    DelayedDict, _refuse_flatten, lambda aux, children: None)  # type: ignore[arg-type,return-value]
