"""Hypothesis strategies: random programs, recorded-transform stacks that fit
them, and matching inputs.

``hypothesis`` is imported when a strategy is built, not with this module, so
the checkers work without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lazyharvest.testing.random_programs import Program
from lazyharvest.testing.stacks import Stack, Transform
from lazyharvest.testing.statements import (
    BINARY, CONSTRUCTS, LABEL_NAMES, OPT_IN, REDUCE, UNARY, Bin, Cond, Custom, Jit, Lin, N, Op,
    Output, Passes, Red, Remat, Repeat, Scan, Scope, Sow, While)

#: The statements a Python loop's layer may hold (see ``_Gen.repeat``).
LAYER_KINDS = ("op", "op", "bin", "lin", "red", "sow", "sow", "pytree_site", "constant",
               "checkpoint")


def _strategies() -> Any:
    """``hypothesis.strategies``, imported on first use."""
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
        self.labels: dict[tuple, set] = {}
        self.n_scopes = 0
        self.n_sites = 0
        self.n_passes = 0

    def st(self) -> Any:
        return _strategies()

    def name(self, scopes: tuple) -> str:
        """A new site name in ``scopes``: ``s0, s1, ...``, or now and then
        (``label_names``) one spelled like a label."""
        n = self.names.get(scopes, 0)
        self.names[scopes] = n + 1
        self.n_sites += 1
        if "label_names" in self.allowed and self.draw(self.st().integers(0, 5)) == 5:
            used = self.labels.setdefault(scopes, set())
            free = [w for w in LABEL_NAMES if w not in used]
            if free:
                used.add(free[0])
                return free[0]
        return f"s{n}"

    def pick(self, shapes: list, want: tuple | None = None) -> int:
        ok = [i for i, s in enumerate(shapes) if want is None or s == want]
        # favour recent variables, so values flow through the program
        return self.draw(self.st().sampled_from(ok[::-1]))

    def kinds(self, depth: int, only: tuple | None) -> list[str]:
        """The statement kinds a block at ``depth`` draws from (within ``only``)."""
        kinds = ["op", "op", "bin", "lin", "red", "sow", "sow"]
        kinds += [k for k in ("pytree_site", "constant") if k in self.allowed]
        if {"custom_jvp", "custom_vjp", "custom_vjp_closure",
                "custom_vjp_recompute"} & self.allowed:
            kinds.append("custom")
        if OPT_IN & self.allowed:
            kinds.append("passes")
        if depth < self.max_depth:
            kinds += [k for k in ("scope", "jit", "checkpoint", "scan", "cond", "switch",
                                  "while") if k in self.allowed]
            if "scan" in self.allowed and {"zero_trip_scan", "zero_trip_keeps_earlier"} & (
                    self.allowed):
                kinds.append("clobber_scan")
            kinds += [k for k in ("python_loop", "jit_layer") if k in self.allowed]
        return [k for k in kinds if only is None or k in only]

    def block(self, shapes: list, scopes: tuple, depth: int, loop: bool,
              n_min: int, n_max: int, only: tuple | None = None) -> tuple[tuple, list]:
        """Statements and the shapes of the variables they create."""
        st = self.st()
        shapes = list(shapes)
        start = len(shapes)
        body = []
        kinds = self.kinds(depth, only)
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
        """One statement of `kind` and the shapes of the variables it creates."""
        if kind in ("op", "bin", "lin", "red"):
            return self.arithmetic(kind, shapes)
        if kind in ("sow", "pytree_site", "constant"):
            return self.site(kind, shapes, scopes, loop)
        if kind in ("scope", "jit", "checkpoint"):
            return self.wrapped(kind, shapes, scopes, depth, loop)
        if kind == "scan":
            return self.scan(shapes, scopes, depth)
        if kind in ("cond", "switch"):
            return self.branches(kind, shapes, scopes, loop)
        if kind in ("while", "clobber_scan"):
            return self.while_loop(shapes, scopes, kind)
        if kind in ("python_loop", "jit_layer"):
            return self.repeat(kind, shapes, scopes, depth)
        if kind == "custom":
            return self.custom(shapes, scopes, loop)
        if kind == "passes":
            return self.passes(shapes, scopes)
        raise ValueError(kind)

    def passes(self, shapes: list, scopes: tuple) -> tuple[Any, list]:
        """Several gradient steps, each a backward pass (``Passes``)."""
        kinds = [k for k in ("steps", "scan", "while") if f"grad_{k}" in self.allowed]
        self.n_passes += 1
        src = self.pick(shapes)
        kind = self.draw(self.st().sampled_from(kinds))
        times = self.draw(self.st().integers(2, 3))
        mode = "clobber" if kind == "while" else self.mode(True)  # (append: not in a while_loop)
        return Passes(src, self.name(scopes), mode, times, kind), [shapes[src]]

    def custom(self, shapes: list, scopes: tuple, loop: bool) -> tuple[Any, list]:
        """A function with a custom rule whose primal body sows."""
        kinds = [k for k, c in (("jvp", "custom_jvp"), ("vjp", "custom_vjp"),
                                ("vjp_closure", "custom_vjp_closure"),
                                ("vjp_recompute", "custom_vjp_recompute"))
                 if c in self.allowed]
        src = self.pick(shapes)
        kind = self.draw(self.st().sampled_from(kinds))
        return Custom(src, self.name(scopes), self.mode(loop), kind, self.pick(shapes)), [
            shapes[src]]

    def arithmetic(self, kind: str, shapes: list) -> tuple[Any, list]:
        st, draw, vec = self.st(), self.draw, (N,)
        if kind == "op":
            i = self.pick(shapes)
            return Op(draw(st.sampled_from(sorted(UNARY))), i), [shapes[i]]
        if kind == "bin":
            a, b = self.pick(shapes), self.pick(shapes)
            out = vec if vec in (shapes[a], shapes[b]) else ()
            return Bin(draw(st.sampled_from(sorted(BINARY))), a, b), [out]
        if kind == "lin":
            return Lin(self.pick(shapes, vec), draw(st.integers(0, 7))), [vec]
        return Red(draw(st.sampled_from(sorted(REDUCE))), self.pick(shapes, vec)), [()]

    def site(self, kind: str, shapes: list, scopes: tuple, loop: bool) -> tuple[Any, list]:
        st, draw = self.st(), self.draw
        if kind == "sow":
            i = self.pick(shapes)
            stop = "stop_gradient_site" in self.allowed and draw(st.integers(0, 4)) == 4
            return Sow(self.name(scopes), (i,), self.mode(loop), stop_gradient=stop), [shapes[i]]
        if kind == "pytree_site":
            a, b = self.pick(shapes), self.pick(shapes)
            return Sow(self.name(scopes), (a, b), self.mode(loop)), [shapes[a], shapes[b]]
        shape = draw(st.sampled_from([(), (N,)]))
        return (Sow(self.name(scopes), (), self.mode(loop), const=shape,
                    seed=draw(st.integers(0, 7))), [shape])

    def wrapped(self, kind: str, shapes: list, scopes: tuple, depth: int,
                loop: bool) -> tuple[Any, list]:
        if kind == "scope":
            self.n_scopes += 1
            scope = f"b{self.n_scopes - 1}"
            if "label_scopes" in self.allowed and self.draw(self.st().integers(0, 2)) == 2:
                scope = self.draw(self.st().sampled_from(LABEL_NAMES))
            body, new = self.block(shapes, scopes + (scope,), depth + 1, loop, 1, 3)
            return Scope(scope, body), new
        body, new = self.block(shapes, scopes, depth + 1, loop, 1, 3)
        if kind == "jit":
            return Jit(body), new
        return Remat(body, self.sometimes("constant_checkpoint")), new

    def sometimes(self, construct: str, one_in: int = 4) -> bool:
        """True now and then (one draw in ``one_in``) where ``construct`` is allowed."""
        return construct in self.allowed and self.draw(self.st().integers(1, one_in)) == 1

    def scan(self, shapes: list, scopes: tuple, depth: int) -> tuple[Any, list]:
        vec = (N,)
        carry = self.pick(shapes)
        xs = self.pick(shapes, vec)
        inner = shapes + [shapes[carry], ()]
        body, new = self.block(inner, scopes, depth + 1, True, 1, 3)
        if not any(isinstance(s, (Sow, Cond, While, Scope, Scan, Jit, Remat)) for s in body):
            body += (Sow(self.name(scopes), (len(inner) + len(new) - 1,), self.mode(True)),)
        reverse = self.draw(self.st().booleans()) if "reverse_scan" in self.allowed else False
        constant = self.sometimes("constant_scan") or self.sometimes(
            "constant_scan_in_checkpoint")
        return Scan(carry, xs, body, reverse, not self.dead_code, constant,
                    self.sometimes("checkpointed_scan_body")), [shapes[carry], vec]

    def branches(self, kind: str, shapes: list, scopes: tuple, loop: bool) -> tuple[Any, list]:
        st, draw = self.st(), self.draw
        n_br = 2 if kind == "cond" else 3
        length = draw(st.integers(1, 3))
        ops = st.sampled_from(sorted(UNARY))
        branches = tuple(tuple(draw(ops) for _ in range(length)) for _ in range(n_br))
        where = tuple(sorted(draw(st.sets(st.integers(0, length - 1), min_size=1,
                                          max_size=2))))
        names = tuple(self.name(scopes) for _ in where)
        operand = self.pick(shapes)
        pred, mode = self.pick(shapes), self.mode(loop)
        vmap = "vmap_cond" in self.allowed and draw(st.integers(0, 3)) == 3
        sows: tuple = ()
        pre = False
        if "cond_different_sites" in self.allowed and draw(st.booleans()):
            sows, mode = self.sown_subsets(n_br, len(names)), "clobber"
            # in a loop the name's earlier value would be the previous
            # iteration's: sow it before the cond, so every iteration sows it
            pre = loop or draw(st.booleans())
        return (Cond(pred, operand, branches, where, names, mode, sows, pre, vmap),
                [shapes[operand]])

    def sown_subsets(self, n_br: int, n_names: int) -> tuple:
        """Per branch, the positions of the names it sows: each name is sown
        by some branch, and some branch does not sow every name."""
        st = self.st()
        subsets = [set(self.draw(st.sets(st.integers(0, n_names - 1), max_size=n_names)))
                   for _ in range(n_br)]
        subsets[0] |= set(range(n_names)) - set().union(*subsets)
        if all(len(s) == n_names for s in subsets):
            subsets[-1] = set(range(n_names - 1))
        return tuple(tuple(sorted(s)) for s in subsets)

    def while_loop(self, shapes: list, scopes: tuple, kind: str) -> tuple[Any, list]:
        """A clobber loop: a ``while_loop`` (maybe with an inner loop) or a
        ``scan`` (``clobber_scan``, maybe of length 0 or with an inner scan)."""
        st, draw = self.st(), self.draw
        src = self.pick(shapes)
        ops = tuple(draw(st.lists(st.sampled_from(["sin", "tanh", "scale", "shift"]),
                                  min_size=1, max_size=2)))
        trips = draw(st.sampled_from([0, 1, 2]))
        pre = bool({"zero_trip_keeps_earlier", "dead_while_sown_before"} & self.allowed) and (
            draw(st.booleans()))
        inner_options = [""]
        if kind == "while":
            inner_options += [k for k, c in (("while", "nested_while"), ("scan", "scan_in_while"))
                              if c in self.allowed]
        elif "nested_scan" in self.allowed:
            inner_options.append("scan")
        inner = draw(st.sampled_from(inner_options))
        inner_trips = draw(st.sampled_from([1, 2, 0])) if inner else 0
        loop = "while" if kind == "while" else "scan"
        constant = self.sometimes("live_and_constant_clobber", 3)
        pre = pre or constant  # the name's live occurrence comes before the loop
        return While(src, ops, trips, self.name(scopes), loop, pre, inner, inner_trips,
                     constant), [shapes[src]]

    def repeat(self, kind: str, shapes: list, scopes: tuple, depth: int) -> tuple[Any, list]:
        """A Python loop over 2 or 3 layers (``jit_layer``: a jitted layer)."""
        src = self.pick(shapes)
        inner = shapes + [shapes[src]]
        body, new = self.block(inner, scopes, depth + 1, True, 1, 3, LAYER_KINDS)
        if not any(isinstance(s, (Sow, Remat)) for s in body):  # a layer sows
            body += (Sow(self.name(scopes), (len(inner) + len(new) - 1,), self.mode(True)),)
        times = self.draw(self.st().integers(2, 3))
        return Repeat(src, body, times, kind == "jit_layer", not self.dead_code), [shapes[src]]


def programs(*, exclude: Iterable[str] = (), include: Iterable[str] = (),
             max_statements: int = 5, max_depth: int = 2,
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
    ``include`` adds constructs of ``OPT_IN`` (several differentiation
    passes, whose keys carry labels); the program then holds one at least,
    and no site name nor scope is spelled like a label, so that
    ``Program.split`` tells a cotangent key from a value's.
    """
    st = _strategies()
    exclude, include = frozenset(exclude), frozenset(include)
    unknown = (exclude | include) - CONSTRUCTS
    if unknown or include - OPT_IN:
        raise ValueError(f"programs: unknown constructs {sorted(unknown)}, or "
                         f"{sorted(include - OPT_IN - unknown)} not opt-in; known: "
                         f"{sorted(CONSTRUCTS)}, opt-in: {sorted(OPT_IN)}")
    allowed = (CONSTRUCTS - OPT_IN - exclude) | (include - exclude)
    if include:
        allowed -= {"label_names", "label_scopes"}

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
        if OPT_IN & allowed and not gen.n_passes:  # asked for: one at least
            stmt, new = gen.passes(shapes, ())
            body += (stmt,)
            shapes += new
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
    reverse-differentiable (no ``while_loop``), ``jacfwd`` only where it is
    forward-differentiable (no ``custom_vjp``); ``vmap`` with random ``in_axes`` (0, -1 or
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
                       and (k not in ("grad", "jacrev") or program.reverse_differentiable)
                       and (k != "jacfwd" or program.forward_differentiable)]
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
