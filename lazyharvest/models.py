"""Sites at the submodule calls of Equinox, Flax NNX and Flax linen models.

`sow_modules(model, tag=...)` returns the model with a `sow` after every
submodule call, keyed by the submodule's attribute path. Neither Equinox nor
Flax is imported here: a model of a kind can only exist once its library has
been imported, so the kind is read from `sys.modules`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from lazyharvest.errors import HarvestError
from lazyharvest.primitive import MODES, scoped, sow

#: The site name of a submodule's output; the path goes into the scopes. A
#: module's output is thus never a prefix of its children's keys (a key may not
#: be both a leaf and a sub-view), as in Flax's `capture_intermediates`.
OUTPUT_NAME = "__call__"

Path = tuple[str, ...]
Filter = Callable[[Path, Any], bool]


def sow_modules(model: Any, *, tag: Hashable, filter: Filter | None = None,
                mode: str = "strict") -> Any:
    """Returns `model` with the output of every submodule call sown.

    The output of the submodule at attribute path `p` (`model.layers[0].attn`
    has `p = ("layers", "0", "attn")`) is sown under the key
    `(*p, "__call__")`, so reaped values nest like the model:
    `d["layers", "0", "attn", "__call__"]`. The model's own behaviour is
    unchanged and `model` itself is not modified. The root call is not sown
    (its output is what the model returns). Array leaves of an output are sown;
    other leaves pass through. Only `__call__` is sown, not other methods.

    **Arguments:**

    - `model`: an `equinox.Module`, a `flax.nnx.Module`, or a bound method of
      a `flax.linen.Module` (`model.apply`).
    - `tag`: the harvest tag of the sites.
    - `filter`: `filter(path, module) -> bool` selects the submodules to sow
      (all when None); `path` is a tuple of strings.
    - `mode`: the `sow` mode of every site. A submodule called more than once
      in one run (a shared layer, a loop, a `scan` over layers) needs
      `"append"` (values stacked in call order) or `"clobber"` (last call).

    **Returns:**

    Equinox: a new module of the same type; each selected submodule is
    wrapped in a small module holding it (the array leaves are the same, in
    the same order). NNX: a clone whose selected submodules sow (`nnx.state`
    is the same). Linen: a function with `apply`'s signature.

    **Raises:**

    `lh.HarvestError` for an unknown `mode` and, at reap time, a `"strict"`
    submodule called twice; `TypeError` when `model` is none of the kinds
    above or `filter` is not callable.

    **Example:**

    >>> import equinox as eqx, jax, jax.numpy as jnp
    >>> import lazyharvest as lh
    >>> mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
    >>> sown = lh.sow_modules(mlp, tag="act")
    >>> d = lh.reap(lambda x: sown(x), tag="act")(jnp.ones(2))
    >>> print(d["layers", "0", "__call__"].shape)
    (8,)
    """
    keep = _checked_filter(tag, filter, mode)
    site = (tag, mode)
    if _is_instance(model, "equinox", "Module"):
        return _sow_equinox(model, site, keep)
    if _is_instance(model, "flax.nnx", "Module"):
        return _sow_nnx(model, site, keep)
    if inspect.ismethod(model) and _is_instance(model.__self__, "flax.linen", "Module"):
        return _sow_linen(model, site, keep)
    hint = (" For a Flax linen module, pass its bound method: "
            "sow_modules(model.apply, ...)."
            if _is_instance(model, "flax.linen", "Module") else "")
    raise TypeError(
        f"sow_modules: expected an equinox.Module, a flax.nnx.Module or a "
        f"flax.linen Module's bound method, got {type(model).__name__}.{hint}")


def _checked_filter(tag: Hashable, filter: Filter | None, mode: str) -> Filter:
    if mode not in MODES:
        raise HarvestError(
            f"sow_modules(tag={tag!r}): unknown mode {mode!r}; use one of "
            f"{', '.join(map(repr, MODES))}.")
    if filter is not None and not callable(filter):
        raise TypeError(f"sow_modules: filter must be callable, got {filter!r}")
    return filter if filter is not None else (lambda path, module: True)


def _is_instance(obj: Any, module: str, name: str) -> bool:
    lib = sys.modules.get(module)
    return lib is not None and isinstance(obj, getattr(lib, name))


def _is_array(x: Any) -> bool:
    # Python scalars stay static, as with `eqx.is_array`: sowing them would
    # turn them into arrays and change what the model returns.
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _sow_output(out: Any, path: Path, site: tuple[Hashable, str]) -> Any:
    """Sows the array leaves of `out` under `(*path, OUTPUT_NAME)`."""
    tag, mode = site
    leaves, tree = jax.tree_util.tree_flatten(out)
    arrays = [_is_array(x) for x in leaves]
    if not any(arrays):
        return out
    # Non-array leaves become None (an empty subtree) in the sown value.
    dynamic = tree.unflatten([x if a else None for x, a in zip(leaves, arrays)])
    with contextlib.ExitStack() as stack:
        for part in path:
            stack.enter_context(scoped(part))
        sown = sow(dynamic, tag=tag, name=OUTPUT_NAME, mode=mode)
    if all(arrays):
        return sown
    new = jax.tree_util.tree_leaves(sown, is_leaf=lambda x: x is None)
    return tree.unflatten([n if a else x for x, n, a in zip(leaves, new, arrays)])


def _key_part(entry: Any) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


# --- Equinox ---------------------------------------------------------------

@functools.cache
def _equinox_site_class() -> type:
    import equinox as eqx

    class SownModule(eqx.nn.StatefulLayer):
        """Calls `inner` and sows its output; a pytree holding `inner`.

        A `StatefulLayer`, so that `eqx.nn.Sequential` calls a stateful inner
        layer with its state, as it would without the wrapper.
        """
        inner: Any
        path: tuple = eqx.field(static=True)
        site: tuple = eqx.field(static=True)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = self.inner(*args, **kwargs)
            if (self.is_stateful() and isinstance(out, tuple) and len(out) == 2
                    and isinstance(out[1], eqx.nn.State)):
                # The state is the whole model's: sow the layer's output only.
                return _sow_output(out[0], self.path, self.site), out[1]
            return _sow_output(out, self.path, self.site)

        def is_stateful(self) -> bool:
            return (isinstance(self.inner, eqx.nn.StatefulLayer)
                    and self.inner.is_stateful())

        def __getattr__(self, name: str) -> Any:
            # The parent may read the submodule's fields (`self.linear.weight`).
            if name == "inner" or name.startswith("__"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    SownModule.__qualname__ = "SownModule"
    SownModule.__module__ = __name__
    return SownModule


def _sow_equinox(model: Any, site: tuple, keep: Filter) -> Any:
    import equinox as eqx
    sown_cls = _equinox_site_class()

    def rebuild(node: Any, path: Path) -> Any:
        def visit(keypath: tuple, child: Any) -> Any:
            if not isinstance(child, eqx.Module):
                return child
            return wrap(child, path + tuple(_key_part(k) for k in keypath))
        return jax.tree_util.tree_map_with_path(
            visit, node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module))

    def wrap(child: Any, path: Path) -> Any:
        if isinstance(child, sown_cls):  # sown for another tag: same path
            return eqx.tree_at(lambda s: s.inner, child, wrap(child.inner, path))
        new = rebuild(child, path)
        if (callable(child) and not isinstance(child, eqx.nn.StateIndex)
                and keep(path, child)):
            return sown_cls(new, path, site)
        return new

    return rebuild(model, ())


# --- Flax NNX --------------------------------------------------------------

_NNX_SITES = "_lazyharvest_sites"


@functools.cache
def _nnx_sown_class(cls: type) -> type:
    """A subclass of `cls` whose `__call__` sows at the instance's sites."""
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = super(sown, self).__call__(*args, **kwargs)
        for path, site in vars(self)[_NNX_SITES]:
            out = _sow_output(out, path, site)
        return out

    def body(ns: dict) -> None:
        ns.update(__call__=__call__, __module__=__name__,
                  __qualname__=f"Sown{cls.__qualname__}")
    sown = types.new_class(f"Sown{cls.__name__}", (cls,),
                           {"pytree": cls._pytree__is_pytree}, body)
    sown._lazyharvest_base = cls
    return sown


def _sow_nnx(model: Any, site: tuple, keep: Filter) -> Any:
    from flax import nnx
    clone = nnx.clone(model)
    for path, module in list(nnx.iter_modules(clone)):
        path = tuple(str(p) for p in path)
        if not path or not callable(module) or not keep(path, module):
            continue
        cls = type(module)
        base = getattr(cls, "_lazyharvest_base", cls)
        sites = vars(module).get(_NNX_SITES, ()) + ((path, site),)
        # Set beneath NNX's attribute checks: the sites are a static attribute
        # (part of the graph definition, never of `nnx.state`), and the class
        # is swapped on this clone's instance only.
        object.__setattr__(module, _NNX_SITES, sites)
        object.__setattr__(module, "__class__", _nnx_sown_class(base))
    return clone


# --- Flax linen ------------------------------------------------------------

def _sow_linen(apply: Callable, site: tuple, keep: Filter) -> Callable:
    import flax.linen as nn

    def interceptor(next_fun: Callable, args: tuple, kwargs: dict,
                    context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        path = tuple(str(p) for p in context.module.path)
        if not path or not keep(path, context.module):
            return out
        return _sow_output(out, path, site)

    @functools.wraps(apply)
    def sown_apply(*args: Any, **kwargs: Any) -> Any:
        # Flax's own per-thread interceptor stack, active for this call only.
        with nn.intercept_methods(interceptor):
            return apply(*args, **kwargs)
    return sown_apply


