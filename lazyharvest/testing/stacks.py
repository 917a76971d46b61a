"""Recorded-transform stacks (SPEC 3.3): ``lh.grad``, ``lh.jacfwd``, ``lh.jacrev``,
``lh.vmap`` and ``lh.jit`` applied around a function, and what law 7 expects
of the keys they give, written with JAX alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax

import lazyharvest as lh

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
