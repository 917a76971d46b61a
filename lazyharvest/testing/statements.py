"""The statements a random program is made of, and the constructs they use.

A program body is a tuple of statements; each statement creates variables,
referred to by their index in the environment (the arguments first).
Variables are ``f32[N]`` vectors or ``f32[]`` scalars.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True)
class Op:
    """``UNARY[fn](v[src])``: an elementwise function of one variable, keeping
    its shape (a vector stays a vector)."""

    fn: str
    src: int


@dataclasses.dataclass(frozen=True)
class Bin:
    """``BINARY[fn](v[a], v[b])`` (a vector if either is one)."""

    fn: str
    a: int
    b: int


@dataclasses.dataclass(frozen=True)
class Lin:
    """``W @ v[src]`` for a fixed random ``N x N`` matrix ``W`` drawn from ``seed``."""

    src: int
    seed: int

    def matrix(self) -> np.ndarray:
        rng = np.random.RandomState(self.seed)
        return (rng.standard_normal((N, N)) / np.sqrt(N)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Red:
    """``REDUCE[fn](v[src])``: a vector to a scalar (a loss, a norm), so that
    programs have scalar outputs to differentiate."""

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

    def constant(self) -> np.ndarray:
        """The constant sown when ``const`` is set: uniform in [-1, 1), from ``seed``."""
        return (np.random.RandomState(self.seed).uniform(-1, 1, self.const)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Scope:
    """``body`` inside ``lh.nest(..., scope=scope)``."""

    scope: str
    body: tuple


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """``body`` inside a transformation that keeps its values (a subclass each)."""

    body: tuple


class Jit(_Wrapped):
    """``body`` inside ``jax.jit``."""


class Remat(_Wrapped):
    """``body`` inside ``jax.checkpoint``."""


@dataclasses.dataclass(frozen=True)
class Scan:
    """``lax.scan`` of ``body`` over ``v[xs]`` from the carry ``v[carry]``.

    Creates the final carry and the stacked per-step outputs; see
    ``_oracle.Interpreter.scan`` for how the body's variables update the carry.
    """

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
    """The program's result: a weighted combination of ``v[srcs]``."""

    kind: str  # "scalar", "array" or "tree"
    srcs: tuple[int, ...]
