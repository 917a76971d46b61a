"""A random program as one description (``Program``), from which come the
function with sites, each site's value written with JAX alone, the planted and
perturbed programs, and the facts the tests filter on (constructs, keys).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest.keys import Key
from lazyharvest.testing._oracle import Interpreter
from lazyharvest.testing.statements import (
    LABEL_NAMES, B, Bin, Cond, Custom, Jit, Lin, N, Op, Output, Passes, Red, Remat, Repeat,
    Scan, Scope, Sow, While)


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

    @functools.cached_property
    def fn(self) -> Callable[..., Any]:
        """The program, with ``lh.sow`` sites."""
        if self.tree_input:
            def program(x: Any, p: Any) -> Any:
                return Interpreter(self, True).run((x, p))[0]
        else:
            def program(x: Any) -> Any:
                return Interpreter(self, True).run((x,))[0]
        program.__qualname__ = program.__name__ = "random_program"
        return program

    @functools.cached_property
    def sites_fn(self) -> Callable[..., dict]:
        """Every site's value, ``{key: value}``, computed with JAX alone."""
        return jax.jit(lambda *args: Interpreter(self, False).run(args)[1])

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
        return Interpreter(self, False, plants=plants).run(args)[0]

    def perturb(self, eps: Mapping[Any, Any], *args: Any) -> Any:
        """The output with ``eps[k]`` added to the reaped sow of site ``k``."""
        return Interpreter(self, False, eps=eps).run(args)[0]

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
        dead = _dead_statements(self.body, self.output, 3 if self.tree_input else 1)
        if any(isinstance(st, Sow) for st in dead):
            found.add("dead_site")
        nested = [st for b in self.body for st in _nested(b)]
        if any(_sown_before(st) for st in dead + nested):
            found.add("dead_while_sown_before")
        env = [False] * (3 if self.tree_input else 1)
        _variance(self.body, env, in_loop=False, in_remat=False, found=found)
        if self.tree_input:
            found.add("pytree_in")
        found.add({"scalar": "scalar_out", "array": "array_out",
                   "tree": "pytree_out"}[self.output.kind])
        return frozenset(found)

    def split(self, key: Key) -> tuple[tuple, tuple]:
        """(labels, rest) of one of ``keys``, every level of differentiation
        in the program written: for a site of ``Passes``, ``("vjp",)`` for
        its cotangent, ``("primal",)`` for its value; else no labels."""
        key = tuple(key)
        if key in self.pass_cotangent_keys:
            return key[:1], key[1:]
        if ("vjp", *key) in self.pass_cotangent_keys:
            return ("primal",), key
        return (), key

    @functools.cached_property
    def pass_cotangent_keys(self) -> frozenset:
        """The keys ``("vjp", *scopes, name)`` of the sites of ``Passes``."""
        out: list = []
        _passes(self.body, (), out)
        return frozenset(("vjp", *k) for k in out)

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

    @property
    def forward_differentiable(self) -> bool:
        """JAX has no forward mode through a ``custom_vjp`` function."""
        return not {"custom_vjp", "custom_vjp_closure", "custom_vjp_recompute"} & self.constructs

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


_ARITHMETIC = {Op: "elementwise", Bin: "binary", Lin: "linear", Red: "reduction"}


def _sow_constructs(st: Sow, found: set, in_scan: bool) -> None:
    found.add("site")
    if st.const is not None:
        found.add("constant")
    if len(st.srcs) == 2:
        found.add("pytree_site")
    if st.stop_gradient:
        found.add("stop_gradient_site")
    if in_scan:
        found.add("scan_append" if st.mode == "append" else "scan_clobber")
        if st.const is not None or st.stop_gradient:
            found.add("constant_in_scan")


def _context_constructs(st: Any, found: set, in_remat: bool, constant: bool) -> None:
    """Constructs a statement makes by where it runs."""
    if constant and isinstance(st, Custom) and st.kind == "jvp":
        found.add("custom_jvp_without_tangents")
    if in_remat and getattr(st, "mode", "") == "append":
        found.add("checkpoint_append")


def _constructs(body: tuple, found: set, scope_depth: int, in_scan: bool,
                in_remat: bool = False, constant: bool = False) -> None:
    for st in body:
        _context_constructs(st, found, in_remat, constant)
        if set(getattr(st, "names", (getattr(st, "name", ""),))) & set(LABEL_NAMES):
            found.add("label_names")
        if isinstance(st, (Op, Bin, Lin, Red)):
            found.add(_ARITHMETIC[type(st)])
        elif isinstance(st, Sow):
            _sow_constructs(st, found, in_scan)
        elif isinstance(st, Scope):
            found.add("scope")
            if st.scope in LABEL_NAMES:
                found.add("label_scopes")
            if scope_depth >= 1:
                found.add("nested_scope")
            _constructs(st.body, found, scope_depth + 1, in_scan, in_remat, constant)
        elif isinstance(st, Jit):
            found.add("jit")
            if any(isinstance(s, Sow) and s.const is not None for s in st.body):
                found.add("constant_in_jit")
            _constructs(st.body, found, scope_depth, in_scan, in_remat, constant)
        elif isinstance(st, Remat):
            found.update({"checkpoint"} | ({"constant_checkpoint"} if st.constant else set()))
            _constructs(st.body, found, scope_depth, in_scan, True, constant or st.constant)
        elif isinstance(st, Repeat):
            found.add("jit_layer" if st.jit else "python_loop")
            _constructs(st.body, found, scope_depth, in_scan, in_remat, constant)
        elif isinstance(st, Scan):
            found.add("scan")
            if st.reverse:
                found.add("reverse_scan")
            if in_scan:
                found.add("nested_scan")
            if st.constant:
                found.add("constant_scan_in_checkpoint" if in_remat else "constant_scan")
            if st.remat:
                found.add("checkpointed_scan_body")
            _constructs(st.body, found, scope_depth, True, in_remat or st.remat,
                        constant or st.constant)
        elif isinstance(st, Cond):
            found.update({st.kind, "site"})
            if st.sows:
                found.add("cond_different_sites")
            if st.vmap:
                found.add("vmap_cond")
            if in_scan:
                found.add("scan_append" if st.mode == "append" else "scan_clobber")
        elif isinstance(st, While):
            _loop_constructs(st, found, in_scan)
        elif isinstance(st, Custom):
            found.update({"site", st.construct})
            if in_scan:
                found.add("scan_append" if st.mode == "append" else "scan_clobber")
        elif isinstance(st, Passes):
            found.update({"site", st.construct, "scan_append" if st.mode == "append"
                          else "scan_clobber"})
            found.update({"scan": {"scan"}, "while": {"while"}}.get(st.kind, set()))


def _loop_constructs(st: While, found: set, in_scan: bool) -> None:
    found.add("site")
    found.update({"while"} if st.has_while else set())
    found.update({"scan"} if "scan" in (st.kind, st.inner) else set())
    if st.kind == "while" and st.trips == 0:
        found.add("while_never_runs")
    never = st.trips == 0 or (st.inner != "" and st.inner_trips == 0)
    if st.kind == "scan" and never:
        found.add("zero_trip_scan")
    if st.pre and never:
        found.add("zero_trip_keeps_earlier")
    if st.kind == "while" and st.inner and not never:
        found.add("nested_while" if st.inner == "while" else "scan_in_while")
    if in_scan:
        found.add("scan_clobber")
    if st.constant and st.pre and not never:
        found.add("live_and_constant_clobber")


def _n_created(st: Any) -> int:
    """How many variables statement ``st`` creates."""
    if isinstance(st, Sow):
        return max(1, len(st.srcs))
    if isinstance(st, (Scope, Jit, Remat)):
        return sum(_n_created(s) for s in st.body)
    return 2 if isinstance(st, Scan) else 1


def _refs(body: tuple, out: set) -> None:
    """Every variable index a statement of ``body`` (at any depth) reads."""
    for st in body:
        for field in ("src", "a", "b", "carry", "xs", "pred", "operand"):
            if isinstance(getattr(st, field, None), int):
                out.add(getattr(st, field))
        if isinstance(st, Sow):
            out.update(st.srcs)
        if hasattr(st, "body"):
            _refs(st.body, out)


def _nested(st: Any) -> list:
    """The statements of the blocks nested in ``st``, at any depth."""
    inner = list(getattr(st, "body", ()))
    return inner + [x for b in inner for x in _nested(b)]


def _sown_before(st: Any) -> bool:
    """A ``while_loop`` whose name is sown before it."""
    return isinstance(st, While) and st.pre and st.has_while


def _dead_statements(body: tuple, output: Output, n_args: int) -> list:
    """The top-level statements whose variables nothing reads. A statement
    reads only variables made before it (a larger index read in its nested
    blocks is a variable of theirs)."""
    used = set(output.srcs)
    i = n_args
    for st in body:
        reads: set = set()
        _refs((st,), reads)
        used |= {j for j in reads if j < i}
        i += _n_created(st)
    dead, i = [], n_args
    for st in body:
        n = _n_created(st)
        if not used & set(range(i, i + n)):
            dead.append(st)
        i += n
    return dead


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
        elif isinstance(st, Repeat):
            _variance(st.body, env + [env[st.src]], in_loop, in_remat, found)
            new = [env[st.src]]
        elif isinstance(st, Scan):
            inner = [False] * len(env) + [True, True]
            _variance(st.body, inner, True, in_remat or st.remat, found)
            v = env[st.carry] or env[st.xs]
            new = [v, v]
        elif isinstance(st, Cond):
            if in_remat:
                found.add("cond_in_checkpoint")
            v = env[st.operand] or env[st.pred]
            if in_loop and st.mode == "append" and not v:
                found.add("invariant_append_site")
            new = [v]
        elif isinstance(st, (While, Custom, Passes)):
            if (isinstance(st, (Custom, Passes)) and in_loop and st.mode == "append"
                    and not env[st.src]):
                found.add("invariant_append_site")
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
        elif (isinstance(st, While) and not looped and st.trips == 1 and not st.pre
              and st.inner_trips == (1 if st.inner else 0)):
            out.append((*scopes, st.name))


def _passes(body: tuple, scopes: tuple, out: list) -> None:
    for st in body:
        if isinstance(st, Passes):
            out.append((*scopes, st.name))
        elif isinstance(st, Scope):
            _passes(st.body, scopes + (st.scope,), out)
        elif hasattr(st, "body"):
            _passes(st.body, scopes, out)


def _clobber_loops(body: tuple, scopes: tuple, out: list, looped: bool) -> None:
    for st in body:
        if (isinstance(st, (Sow, Custom)) and looped or isinstance(st, Passes)) and (
                st.mode == "clobber"):
            out.append((*scopes, st.name))
        elif isinstance(st, Cond) and looped and st.mode == "clobber":
            out.extend((*scopes, n) for n in st.names)
        elif isinstance(st, Scope):
            _clobber_loops(st.body, scopes + (st.scope,), out, looped)
        elif isinstance(st, (Jit, Remat)):
            _clobber_loops(st.body, scopes, out, looped)
        elif isinstance(st, (Scan, Repeat)):
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
            _render_sow(st, names, counter, lines, ind)
        elif isinstance(st, (Scope, Jit, Remat)):
            head = {Scope: lambda: f"nest(scope={getattr(st, 'scope', '')!r})",
                    Jit: lambda: "jax.jit", Remat: lambda: "jax.checkpoint"}[type(st)]()
            reads = ", reading every variable through stop_gradient" if (
                getattr(st, "constant", False)) else ""
            lines.append(f"{ind}with {head}:  # a block{reads}")
            _render(st.body, names, counter, lines, ind + "    ")
        elif isinstance(st, Scan):
            flags = "".join(f", {f}=True" for f in ("constant", "remat") if getattr(st, f))
            lines.append(f"{ind}scan(carry={names[st.carry]}, xs={names[st.xs]}, "
                         f"reverse={st.reverse}{flags}) as (c, xi):")
            inner = names + ["c", "xi"]
            _render(st.body, inner, counter, lines, ind + "    ")
            used = inner[len(names) + 2:] if st.dense else inner[-1:]
            total = " + ".join(f"fit({u})" for u in used)
            lines.append(f"{ind}    t = {total}; c = 0.5 * c + tanh(t); y = sum(t)")
            new("final carry")
            new("stacked y")
        elif isinstance(st, Repeat):
            lines.append(f"{ind}h = {names[st.src]}")
            head = "layer = jax.jit(layer); " if st.jit else ""
            lines.append(f"{ind}{head}for _ in range({st.times}):  # layer(h)")
            _render(st.body, names + ["h"], counter, lines, ind + "    ")
            t = "fit(every layer variable), summed" if st.dense else "fit(<last>)"
            lines.append(f"{ind}    h = 0.5 * h + tanh({t})")
            new("h")
        elif isinstance(st, Cond):
            new(_render_cond(st, names))
        elif isinstance(st, While):
            new(_render_loop(st, names))
        elif isinstance(st, Passes):
            step = (f"h = h - 0.25 * grad(h -> sum(tanh(sow(sin(h) * 1.5, name={st.name!r}, "
                    f"mode={st.mode!r}))))(h)")
            loop = {"steps": f"{st.times} times in a Python loop",
                    "scan": f"once, then in a lax.scan of {st.times - 1}",
                    "while": f"once, then in a lax.while_loop of {st.times - 1}"}[st.kind]
            new(f"(h = {names[st.src]}; {step}, {loop}; h)")
        elif isinstance(st, Custom):
            w = f" * W{st.closure}" if st.kind == "vjp_closure" else ""
            new(f"custom_{st.kind.split('_')[0]}(u -> tanh(sow(sin(u){w}, name={st.name!r}, "
                f"mode={st.mode!r})), exact rule)({names[st.src]})")


def _render_sow(st: Sow, names: list, counter: list, lines: list, ind: str) -> None:
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
        if st.stop_gradient:
            val = f"stop_gradient({val})"
        _new_var(names, counter, lines, ind, f"sow({val}, name={st.name!r}, mode={st.mode!r})")


def _new_var(names: list, counter: list, lines: list, ind: str, expr: str) -> None:
    v = f"v{counter[0]}"
    counter[0] += 1
    names.append(v)
    lines.append(f"{ind}{v} = {expr}")


def _render_cond(st: Cond, names: list) -> str:
    sites = ", ".join(f"after op {j}: sow {n!r} ({st.mode})" for j, n in zip(st.sites, st.names))
    text = (f"{st.kind}(pred=sum({names[st.pred]}), operand={names[st.operand]}, "
            f"branches={list(st.branches)}; {sites}")
    if st.sows:
        text += f"; branch b sows only names[i] for i in {list(st.sows)}[b]"
    if st.pre:
        text += f"; operand sown first as each of {list(st.names)} (clobber)"
    if st.vmap:
        text = f"jax.vmap over [(pred, operand), (-pred, -operand)] of {text}; out = o0 + 0.5 * o1"
    return text + ")"


def _render_loop(st: While, names: list) -> str:
    chain = f"v = sow({'('.join(st.ops)}(v{')' * len(st.ops)}), {st.name!r}, clobber)"
    if st.constant:
        chain = f"v = checkpoint(v -> {chain[4:]})(stop_gradient(v))"
    if st.inner:
        chain = f"{st.inner}({st.inner_trips} trips: {chain})"
    loop = "while_loop" if st.kind == "while" else "scan"
    pre = f"sow({names[st.src]}, {st.name!r}, clobber)" if st.pre else names[st.src]
    return f"{loop}({st.trips} trips: {chain}, v={pre})"
