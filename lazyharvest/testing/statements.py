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
    "dead_site",  # a top-level site no later statement nor the output reads
    "checkpoint_append",  # an append site inside jax.checkpoint (in a loop)
    # repeated sows outside scans:
    "python_loop", "jit_layer",
    "stop_gradient_site",  # a site on a value after lax.stop_gradient
    "cond_different_sites",  # branches sow different clobber names
    "vmap_cond",  # plain jax.vmap of a cond / switch with a batched predicate
    "zero_trip_scan",  # a scan of length 0 (sowing a clobber name)
    "zero_trip_keeps_earlier",  # a loop that never runs, its name sown before
    # a while loop nothing may read, its name sown before (top level: nothing
    # reads it; in a nested block: any, deadness there is not tracked)
    "dead_while_sown_before",
    "nested_while", "scan_in_while",  # a clobber site in the inner loop's body
    # a site in the primal function of a custom rule (closing over an array):
    "custom_jvp", "custom_vjp", "custom_vjp_closure", "custom_vjp_recompute",
    "label_names",  # sites named like the labels of keys ("jvp", "vjp", ...)
    "label_scopes",  # lh.nest scopes spelled like labels
    "constant_in_jit",  # a constant site directly inside jax.jit
    "constant_in_scan",  # a constant or stop_gradient site directly in a scan body
    # inputs that carry no tangent into a construct (``lax.stop_gradient``):
    "constant_checkpoint",  # a jax.checkpoint none of whose inputs has a tangent
    "constant_scan",  # a scan none of whose inputs has a tangent
    "constant_scan_in_checkpoint",  # such a scan inside jax.checkpoint
    "checkpointed_scan_body",  # a scan whose body is a jax.checkpoint
    # a clobber name sown before a loop (live) and in it, on a value without a
    # tangent, inside jax.checkpoint (constant)
    "live_and_constant_clobber",
    # derived: a custom_jvp call inside such a constant construct (its inputs
    # have no tangent)
    "custom_jvp_without_tangents",
    # several differentiation passes in one program (``Passes``): a Python
    # loop of jax.grad steps, a jax.grad before a lax.scan / lax.while_loop of
    # them; only drawn when asked for (``OPT_IN``)
    "grad_steps", "grad_scan", "grad_while",
})

#: Constructs drawn only when ``programs(include=...)`` names them: their keys
#: carry labels (``("vjp", name)``, the inner passes' cotangents), which not
#: every law's checker reads.
OPT_IN = frozenset({"grad_steps", "grad_scan", "grad_while"})

#: Site names spelled like labels (docs/semantics.md, section 2).
LABEL_NAMES = ("grad", "jvp", "vjp", "vmap", "jit")


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
    stop_gradient: bool = False  # sow ``lax.stop_gradient(v[src])``

    def constant(self) -> np.ndarray:
        """The constant sown when ``const`` is set: uniform in [-1, 1), from ``seed``."""
        return np.asarray(np.random.RandomState(self.seed).uniform(-1, 1, self.const),
                          dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Scope:
    """``body`` inside ``lh.nest(..., scope=scope)``."""

    scope: str
    body: tuple


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """``body`` inside a transformation that keeps its values (a subclass
    each). With ``constant``, the block reads every variable through
    ``lax.stop_gradient``: none of its inputs has a tangent."""

    body: tuple
    constant: bool = False


class Jit(_Wrapped):
    """``body`` inside ``jax.jit``."""


class Remat(_Wrapped):
    """``body`` inside ``jax.checkpoint``."""


@dataclasses.dataclass(frozen=True)
class Repeat:
    """A Python loop over ``times`` layers: ``h = v[src]``, then per layer
    ``body`` runs on the variables and ``h``, and ``h = 0.5 * h + tanh(t)``
    with ``t`` its last variable (fitted to ``h``'s shape). With ``jit`` the
    layer is one ``jax.jit`` function called ``times`` times. Its sites
    (``append``/``clobber``) are sown once per layer. Creates the final ``h``."""

    src: int
    body: tuple
    times: int
    jit: bool = False
    dense: bool = False  # ``t`` sums every layer variable, not only the last


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
    constant: bool = False  # carry, xs and the variables read through lax.stop_gradient
    remat: bool = False  # the body is a jax.checkpoint


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
    # per branch, the positions in ``names`` it sows (empty: every branch sows
    # every name); only for ``clobber`` sites
    sows: tuple[tuple[int, ...], ...] = ()
    pre: bool = False  # sow the operand under every name before the cond
    vmap: bool = False  # plain jax.vmap over a batch of B operands (see below)

    def sown_by(self, branch: int) -> tuple[int, ...]:
        """The positions in ``names`` that ``branch`` sows."""
        return self.sows[branch] if self.sows else tuple(range(len(self.names)))

    @property
    def kind(self) -> str:
        return "cond" if len(self.branches) == 2 else "switch"


@dataclasses.dataclass(frozen=True)
class While:
    """A loop running ``trips`` times: ``v = sow(chain(v))`` (clobber; with
    ``constant``, ``v = checkpoint(u -> sow(chain(u)))(stop_gradient(v))``).

    ``kind``: the loop is a ``lax.while_loop`` or a ``lax.scan`` of length
    ``trips``. With ``pre``, ``v[src]`` is sown under the same name before the
    loop. With ``inner`` (``"while"`` or ``"scan"``), each trip runs an inner
    loop of ``inner_trips`` trips whose body is the chain and its site."""

    src: int
    ops: tuple[str, ...]
    trips: int
    name: str
    kind: str = "while"
    pre: bool = False
    inner: str = ""
    inner_trips: int = 0
    # each trip's chain and site run in a jax.checkpoint without tangents
    constant: bool = False

    @property
    def has_while(self) -> bool:
        """Whether it runs a ``lax.while_loop`` (no reverse mode)."""
        return "while" in (self.kind, self.inner)


@dataclasses.dataclass(frozen=True)
class Custom:
    """``g(v[src])`` with ``g(u) = tanh(sow(sin(u) * w))`` given a custom
    derivative rule (the exact derivative, computed without the site):
    ``kind`` ``"jvp"`` (``jax.custom_jvp``, ``w = 1``), ``"vjp"``
    (``jax.custom_vjp``, ``w = 1``), ``"vjp_closure"`` (``jax.custom_vjp``
    whose primal function and rule close over a module-level array ``w``,
    ``_oracle.closure_weight(closure, shape)``) or ``"vjp_recompute"``
    (``jax.custom_vjp`` whose backward rule recomputes ``g``, site included,
    and differentiates it with ``jax.vjp``: a checkpointing rule; its
    recomputed site is no new occurrence, and its cotangent is the forward
    occurrence's)."""

    src: int
    name: str
    mode: str
    kind: str
    closure: int = 0

    @property
    def construct(self) -> str:
        return {"jvp": "custom_jvp", "vjp": "custom_vjp", "vjp_closure": "custom_vjp_closure",
                "vjp_recompute": "custom_vjp_recompute"}[self.kind]


@dataclasses.dataclass(frozen=True)
class Passes:
    """Gradient steps ``h = h - 0.25 * jax.grad(loss)(h)`` from ``h = v[src]``,
    with ``loss(h) = sum(tanh(sow(sin(h) * 1.5)))``: each step is a backward
    pass, and the site's cotangent in it is reaped as ``("vjp", name)``.
    ``kind``: ``"steps"`` (``times`` steps in a Python loop), ``"scan"`` or
    ``"while"`` (one step, then a ``lax.scan`` / ``lax.while_loop`` of
    ``times - 1`` steps). Creates the final ``h``."""

    src: int
    name: str
    mode: str
    times: int
    kind: str

    @property
    def construct(self) -> str:
        return f"grad_{self.kind}"


@dataclasses.dataclass(frozen=True)
class Output:
    """The program's result: a weighted combination of ``v[srcs]``."""

    kind: str  # "scalar", "array" or "tree"
    srcs: tuple[int, ...]
