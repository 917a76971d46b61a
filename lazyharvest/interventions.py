"""Interventions: a plant that is a function of the sown value.

The hook of TransformerLens (`fwd_hooks=[(name, fn)]`) and the in-trace
assignment of nnsight, as a plant: `lh.plant(f, tag)({"h3": fn}, x)` runs
`fn(h)` inside the program, where the site is, on each occurrence's value,
and its result replaces the value (with `mode="add"`, is added to it). Arrays
the function reads that change from call to call are its operands
(`lh.intervention(fn, *operands)`): they enter the program as arguments, so a
sweep over them compiles once and `jax.vmap` over them runs it as one
program (docs/semantics.md, section 5a).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax

from lazyharvest.errors import HarvestError


@attrs.frozen(eq=False)
class Intervention:
    """`fn(value, *operands)` in place of a site's value; see `intervention`."""

    fn: Callable
    operands: tuple = ()


def intervention(fn: Callable, *operands: Any) -> Intervention:
    """A plant computed from the sown value: `fn(value, *operands)`.

    Planted at a key (`lh.plant`, `lh.harvest`), it runs inside the program,
    at every occurrence of the site, on that occurrence's value (a cotangent,
    at a cotangent site of a backward function); its result replaces the
    value, or is added to it with `mode="add"`. A bare function is planted
    the same way, without operands.

    **Arguments:**

    - `fn`: a function of the site's value (a pytree like the sown one) and
      of the operands; it returns a value of the same structure, shapes and
      dtypes. Define it once: a new function object is a new program.
    - `operands`: arrays (or pytrees of arrays) `fn` reads. They enter the
      program as arguments, so calls with new operands of the same shapes
      reuse one compiled program, and `jax.vmap` over them batches the
      intervened program.

    **Returns:** an `Intervention`, to use as a plant's value.

    **Raises:** `HarvestError` when `fn` is not callable; at the call of the
    planted function, one naming the site when `fn` returns another
    structure, shape or dtype.

    **Example:**

    >>> import jax.numpy as jnp, lazyharvest as lh
    >>> def f(x):
    ...     return 2 * lh.sow(x + 1, tag="t", name="h")
    >>> patch = lambda h, v: h.at[0].set(v)
    >>> print(lh.plant(f, tag="t")({"h": lh.intervention(patch, 10.)}, jnp.zeros(2)))
    [20.  2.]
    """
    if not callable(fn):
        raise HarvestError(f"intervention: {fn!r} is not callable; pass a function of "
                           f"the sown value (and of the operands that follow it).")
    return Intervention(fn, operands)


def as_intervention(value: Any) -> Intervention | None:
    """A plant's value as an intervention, if it is one (a bare callable is
    one without operands); None for a planted value."""
    if isinstance(value, Intervention):
        return value
    return Intervention(value) if callable(value) else None


@attrs.frozen
class Applied:
    """The static part of an intervention at one site: hashable, so programs
    are cached by it (the same function object, the same program)."""

    fn: Callable
    tree: Any  # the site's pytree structure
    operand_tree: Any
    where: str  # names the site, for errors

    def __call__(self, vals: list, operand_leaves: list) -> list:
        """The intervened leaves of one occurrence, checked against `vals`."""
        value = jax.tree_util.tree_unflatten(self.tree, vals)
        operands = jax.tree_util.tree_unflatten(self.operand_tree, operand_leaves)
        leaves, tree = jax.tree_util.tree_flatten(self.fn(value, *operands))
        if tree != self.tree:
            raise HarvestError(
                f"{self.where}: the intervention returned a value of structure {tree}; "
                f"the site sows {self.tree}. Return a value like the one it is given.")
        for v, out in zip(vals, leaves):
            want, got = jax.typeof(v), jax.typeof(out)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise HarvestError(
                    f"{self.where}: the intervention returned shape {got.shape} and "
                    f"dtype {got.dtype}; the site's value has shape {want.shape} and "
                    f"dtype {want.dtype}. Return a value of the same shape and dtype.")
        return leaves
