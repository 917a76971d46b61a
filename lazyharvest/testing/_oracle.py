"""Runs a program description: with lazyharvest sites, or with JAX alone.

With JAX alone (the oracle) it collects every site's value and applies plants
and perturbations itself, so a law's expected values never come from
lazyharvest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lazyharvest as lh
from lazyharvest.keys import normalize
from lazyharvest.testing.statements import (
    BINARY, REDUCE, UNARY, Bin, Cond, Custom, Jit, Lin, N, Op, Output, Passes, Red, Remat,
    Repeat, Scan, Scope, Sow, While)


def closure_weight(seed: int, shape: tuple) -> Any:
    """The concrete array a ``vjp_closure`` custom function closes over. (A
    custom rule that closed over a traced value would leak it: JAX asks for
    such values to be passed as arguments, ``jax.closure_convert``.)"""
    n = int(np.prod(shape))  # numpy: a jnp array made while tracing is traced
    return (1.0 + 0.5 * np.tanh(np.linspace(-1.0, 1.0, n) + seed)).reshape(shape).astype(
        np.float32)


def _with_rule(kind: str, fn: Callable, out: Callable, derivative: Callable, u: Any,
               c: Any) -> Any:
    """``fn(u, c)`` under the custom rule of ``kind``: its outputs ``out(u, c)``
    and ``derivative(u)`` for ``u`` (``"vjp_recompute"``: the rule
    differentiates ``fn`` again); ``c`` is a constant for the rule."""
    if kind == "jvp":
        gj = jax.custom_jvp(fn)
        gj.defjvp(lambda p, t: (out(*p), derivative(p[0]) * t[0]))
        return gj(u, c)
    gv = jax.custom_vjp(fn)
    if kind == "vjp_recompute":
        gv.defvjp(lambda u, c: (fn(u, c), (u, c)), lambda r, ct: jax.vjp(fn, *r)[1](ct))
    else:
        gv.defvjp(lambda u, c: (out(u, c), (u, c)), lambda r, ct: (
            derivative(r[0]) * ct, jax.tree_util.tree_map(jnp.zeros_like, r[1])))
    return gv(u, c)


class Description(Protocol):
    """What the interpreter reads of a ``Program``."""

    @property
    def body(self) -> tuple: ...

    @property
    def output(self) -> Output: ...

    @property
    def tree_input(self) -> bool: ...

    @property
    def tag(self) -> str: ...


def _shape_of(x: Any) -> tuple:
    return tuple(np.shape(x))


def output_value(output: Output, env: list) -> Any:
    """The program's result: a weighted sum of its output variables."""
    parts = [env[i] for i in output.srcs]
    weights = [0.5 + 0.25 * (j % 3) for j in range(len(parts))]
    scalar = sum(w * jnp.sum(p) for w, p in zip(weights, parts))
    vector = sum(w * jnp.broadcast_to(p, (N,)) for w, p in zip(weights, parts))
    if output.kind == "scalar":
        return scalar
    if output.kind == "array":
        return vector
    return {"out": vector, "aux": scalar}


def _fit(v: Any, shape: tuple) -> Any:
    """`v` made to `shape` (sum a vector to a scalar, broadcast a scalar)."""
    if _shape_of(v) == shape:
        return v
    if shape == ():
        return jnp.sum(v)
    return jnp.broadcast_to(v, shape)


def _loop(kind: str, n: int, body: Callable, state: tuple) -> tuple:
    """``state = body(i, state)`` for ``i < n``: a ``lax.while_loop`` or a ``lax.scan``."""
    if kind == "while":
        out = lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, *body(s[0], s[1:])),
                             (0, *state))
        return tuple(out[1:])
    return lax.scan(lambda s, i: (tuple(body(i, s)), None), state, jnp.arange(n))[0]


class Ctx:
    """Where a statement runs: nest scopes, and (oracle) the loop it is in."""

    def __init__(self, scopes: tuple = (), idx: Any = None, last: Any = None):
        self.scopes, self.idx, self.last = scopes, idx, last

    def scoped(self, scope: str) -> Ctx:
        return Ctx(self.scopes + (scope,), self.idx, self.last)

    def iteration(self, i: Any, length: int, is_last: Any) -> Ctx:
        idx = i if self.idx is None else self.idx * length + i
        last = is_last if self.last is None else jnp.logical_and(self.last, is_last)
        return Ctx(self.scopes, idx, last)

    def only_if(self, cond: Any) -> Ctx:
        """A clobber occurrence that is reaped only where ``cond`` holds."""
        last = cond if self.last is None else jnp.logical_and(self.last, cond)
        return Ctx(self.scopes, self.idx, last)


class Interpreter:
    """Runs a program description: with lazyharvest sites (``use_lh=True``) or
    with JAX alone, collecting every site's value and applying plants and
    perturbations (``use_lh=False``)."""

    def __init__(self, prog: Description, use_lh: bool, plants: Mapping | None = None,
                 eps: Mapping | None = None):
        self.prog = prog
        self.lh = use_lh
        self.plants = {normalize(k): v for k, v in (plants or {}).items()}
        self.eps = {normalize(k): v for k, v in (eps or {}).items()}

    # -- sites -----------------------------------------------------------------

    def site(self, name: str, value: Any, mode: str, ctx: Ctx, sites: dict,
             under_rule: bool = False) -> Any:
        """The site's value, planted and perturbed. ``under_rule``: a site in a
        function with a custom derivative rule, which says how the outputs
        depend on the inputs only: a perturbation there is a constant for it
        (as a plant is), so it gets no cotangent (docs/semantics.md)."""
        if self.lh:
            return lh.sow(value, tag=self.prog.tag, name=name, mode=mode)
        key = (*ctx.scopes, name)
        v = value
        if key in self.plants:
            p = self.plants[key]
            if mode == "append":
                row = 0 if ctx.idx is None else ctx.idx
                p = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[row], p)
            v = jax.tree_util.tree_map(lambda a, b: jnp.asarray(a, jnp.result_type(b)), p, v)
        if key in self.eps:
            e = self.occurrence_eps(key, mode, ctx)
            if under_rule:
                e = lax.stop_gradient(e)
            v = jax.tree_util.tree_map(jnp.add, v, e)
        sites[key] = (mode, jax.tree_util.tree_map(lambda a: a[None], v) if mode == "append" else v)
        return v

    def occurrence_eps(self, key: tuple, mode: str, ctx: Ctx) -> Any:
        """The perturbation of ``key`` at this occurrence: its row (append),
        or all of it at the reaped occurrence and zero elsewhere (clobber)."""
        e = self.eps[key]
        if mode == "append":
            row = 0 if ctx.idx is None else ctx.idx
            return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[row], e)
        if ctx.last is not None:
            return jax.tree_util.tree_map(lambda a: jnp.where(ctx.last, a, 0), e)
        return e

    # -- blocks ----------------------------------------------------------------

    def block(self, stmts: Sequence[Any], env: list, ctx: Ctx) -> tuple[list, dict]:
        env = list(env)
        start = len(env)
        sites: dict = {}
        for st in stmts:
            env.extend(self.stmt(st, env, ctx, sites))
        return env[start:], sites

    def _sub(self, body: tuple, env: list, ctx: Ctx, sites: dict) -> list:
        new, sub_sites = self.block(body, env, ctx)
        sites.update(sub_sites)
        return new

    def stmt(self, st: Any, env: list, ctx: Ctx, sites: dict) -> list:
        if isinstance(st, Op):
            return [UNARY[st.fn](env[st.src])]
        if isinstance(st, Bin):
            return [BINARY[st.fn](env[st.a], env[st.b])]
        if isinstance(st, Lin):
            return [jnp.asarray(st.matrix()) @ env[st.src]]
        if isinstance(st, Red):
            return [REDUCE[st.fn](env[st.src])]
        if isinstance(st, Sow):
            if st.const is not None:
                value: Any = jnp.asarray(st.constant())
            elif len(st.srcs) == 1:
                value = env[st.srcs[0]]
                if st.stop_gradient:
                    value = lax.stop_gradient(value)
            else:
                value = {"a": env[st.srcs[0]], "b": env[st.srcs[1]]}
            out = self.site(st.name, value, st.mode, ctx, sites)
            return [out] if not isinstance(out, dict) else [out["a"], out["b"]]
        if isinstance(st, (Scope, Jit, Remat)):
            return self.wrapped(st, env, ctx, sites)
        if isinstance(st, Scan):
            return self.scan(st, env, ctx, sites)
        if isinstance(st, Repeat):
            return self.repeat(st, env, ctx, sites)
        if isinstance(st, Cond):
            run = self.vmap_cond if st.vmap else self.cond
            return run(st, env, ctx, sites)
        if isinstance(st, While):
            return self.while_(st, env, ctx, sites)
        if isinstance(st, Custom):
            return self.custom(st, env, ctx, sites)
        if isinstance(st, Passes):
            return self.passes(st, env, ctx, sites)
        raise TypeError(f"unknown statement {st!r}")

    def wrapped(self, st: Any, env: list, ctx: Ctx, sites: dict) -> list:
        if getattr(st, "constant", False):  # no input with a tangent
            env = [lax.stop_gradient(v) for v in env]
        if not self.lh:  # jit and checkpoint are the identity; scopes prefix keys
            sub = ctx.scoped(st.scope) if isinstance(st, Scope) else ctx
            return self._sub(st.body, env, sub, sites)

        def run(env_tuple: tuple) -> tuple:
            return tuple(self.block(st.body, list(env_tuple), ctx)[0])
        if isinstance(st, Scope):
            fn = lh.nest(run, scope=st.scope)
        elif isinstance(st, Jit):
            fn = jax.jit(run)
        else:
            fn = jax.checkpoint(run)
        return list(fn(tuple(env)))

    def scan(self, st: Scan, env: list, ctx: Ctx, sites: dict) -> list:
        if st.constant:  # no input with a tangent
            env = [lax.stop_gradient(v) for v in env]
        carry0, xs = env[st.carry], env[st.xs]
        length = _shape_of(xs)[0]
        shape = _shape_of(carry0)
        last_i = length - 1  # clobber: the highest index, also for reverse=True

        def body(c: Any, inp: Any) -> Any:
            xi, i = inp
            local = list(env) + [c, xi]
            sub = ctx if self.lh else ctx.iteration(i, length, i == last_i)
            new, body_sites = self.block(st.body, local, sub)
            modes.update({k: m for k, (m, _) in body_sites.items()})  # static
            used = new if st.dense else new[-1:]
            total = sum(_fit(v, shape) for v in used)
            c2 = 0.5 * c + jnp.tanh(total)
            y = _fit(total, ())
            return c2, (y, {k: v for k, (_, v) in body_sites.items()}
                        if not self.lh else {})
        if st.remat and self.lh:
            body = jax.checkpoint(body)
        modes: dict = {}
        c, (ys, stacked) = lax.scan(body, carry0, (xs, jnp.arange(length)),
                                    reverse=st.reverse)
        for k, v in stacked.items():
            if modes[k] == "append":  # (length, rows, ...) -> (length * rows, ...)
                v = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), v)
                sites[k] = ("append", v)
            else:
                sites[k] = (modes[k], jax.tree_util.tree_map(lambda a: a[last_i], v))
        return [c, ys]

    def repeat(self, st: Repeat, env: list, ctx: Ctx, sites: dict) -> list:
        """A Python loop over layers: every layer's sites in program order."""
        h = env[st.src]
        shape = _shape_of(h)

        def layer(env_tuple: tuple, h: Any, sub: Ctx) -> tuple:
            new, layer_sites = self.block(st.body, [*env_tuple, h], sub)
            total = sum(_fit(v, shape) for v in (new if st.dense else new[-1:]))
            return 0.5 * h + jnp.tanh(total), layer_sites
        if self.lh:
            run = jax.jit(lambda e, h: layer(e, h, ctx)[0]) if st.jit else (
                lambda e, h: layer(e, h, ctx)[0])
            for _ in range(st.times):
                h = run(tuple(env), h)
            return [h]
        layers = []
        for i in range(st.times):
            h, layer_sites = layer(tuple(env), h, ctx.iteration(i, st.times, i == st.times - 1))
            layers.append(layer_sites)
        for k, (mode, _) in layers[0].items():
            if mode == "append":  # occurrences stack in program order
                sites[k] = (mode, jax.tree_util.tree_map(
                    lambda *a: jnp.concatenate(a), *[s[k][1] for s in layers]))
            else:
                sites[k] = layers[-1][k]
        return [h]

    def cond(self, st: Cond, env: list, ctx: Ctx, sites: dict) -> list:
        out, chosen = self._cond(st, env[st.pred], env[st.operand], ctx)
        for k, v in chosen.items():
            sites[k] = (st.mode, v)
        return [out]

    def _cond(self, st: Cond, pred: Any, operand: Any, ctx: Ctx) -> tuple[Any, dict]:
        """The cond's output and (oracle) each name's value after it: the taken
        branch's, or the earlier one where that branch does not sow the name."""
        total = jnp.sum(pred)
        if st.kind == "cond":  # lax.cond(total > 0, branches[0], branches[1])
            index = jnp.where(total > 0, 0, 1)
        else:
            index = (total > 0).astype(jnp.int32) + (total > 1).astype(jnp.int32)
        n_br = len(st.branches)
        earlier = [jnp.zeros_like(operand)] * len(st.names)
        if st.pre:  # the pre-sow is the reaped occurrence where the branch does not sow
            for j, n in enumerate(st.names):
                unsown = jnp.asarray([j not in st.sown_by(b) for b in range(n_br)])[index]
                operand = self.site(n, operand, "clobber", ctx.only_if(unsown), {})
                earlier[j] = operand

        def make(b: int) -> Callable:
            def branch(v: Any) -> Any:
                local: dict = {}
                for j, op in enumerate(st.branches[b]):
                    v = UNARY[op](v)
                    if j in st.sites and st.sites.index(j) in st.sown_by(b):
                        v = self.site(st.names[st.sites.index(j)], v, st.mode, ctx, local)
                if self.lh:
                    return v, {}
                keys = [(*ctx.scopes, n) for n in st.names]
                return v, {k: local[k][1] if k in local else earlier[j]
                           for j, k in enumerate(keys)}
            return branch
        branches = [make(b) for b in range(n_br)]
        if st.kind == "cond":
            return lax.cond(total > 0, branches[0], branches[1], operand)
        return lax.switch(index, branches, operand)

    def vmap_cond(self, st: Cond, env: list, ctx: Ctx, sites: dict) -> list:
        """``jax.vmap`` of the cond over ``[(p, u), (-p, -u)]``: the predicates
        differ per element. The oracle runs the elements one by one, with the
        plants and perturbations of each element (axis 0; axis 1 for append)."""
        preds = jnp.stack([env[st.pred], -env[st.pred]])
        operands = jnp.stack([env[st.operand], -env[st.operand]])
        if self.lh:
            outs = jax.vmap(lambda p, u: self._cond(st, p, u, ctx)[0])(preds, operands)
            return [outs[0] + 0.5 * outs[1]]
        axis = 1 if st.mode == "append" else 0
        keys = {(*ctx.scopes, n) for n in st.names}

        def element(table: dict, b: int) -> dict:
            return {k: jax.tree_util.tree_map(lambda a: jnp.take(a, b, axis), v)
                    if k in keys else v for k, v in table.items()}
        outs, chosen = [], []
        for b in range(2):
            sub = Interpreter(self.prog, False, element(self.plants, b), element(self.eps, b))
            out, c = sub._cond(st, preds[b], operands[b], ctx)
            outs.append(out)
            chosen.append(c)
        for k in chosen[0]:
            sites[k] = (st.mode, jax.tree_util.tree_map(
                lambda *a: jnp.stack(a, axis), *[c[k] for c in chosen]))
        return [outs[0] + 0.5 * outs[1]]

    def while_(self, st: While, env: list, ctx: Ctx, sites: dict) -> list:
        """The loop carries ``(v, last)``: ``last`` is the site's value so far
        (the pre-sow's, zeros if none): the last evaluation when the loop ends."""
        def sow(v: Any, reaped: Any) -> Any:
            return self.site(st.name, v, "clobber", ctx.only_if(reaped), {})

        def chain(v: Any, reaped: Any) -> tuple:
            def run(v: Any) -> Any:
                for op in st.ops:
                    v = UNARY[op](v)
                return sow(v, reaped)
            if st.constant:  # a checkpoint none of whose inputs has a tangent
                v = lax.stop_gradient(v)
                v = jax.checkpoint(run)(v) if self.lh else run(v)
            else:
                v = run(v)
            return v, v
        v = env[st.src]
        last = jnp.zeros_like(v)
        if st.pre:  # reaped when no trip sows
            runs = st.trips > 0 and (not st.inner or st.inner_trips > 0)
            v = last = sow(v, not runs)

        def step(i: Any, state: tuple) -> tuple:
            final = i == st.trips - 1
            if not st.inner:
                return chain(state[0], final)
            m = st.inner_trips
            return _loop(st.inner, m, lambda j, s: chain(s[0], jnp.logical_and(final, j == m - 1)),
                         state)
        v, last = _loop(st.kind, st.trips, step, (v, last))
        if not self.lh:
            sites[(*ctx.scopes, st.name)] = ("clobber", last)
        return [v]

    def custom(self, st: Custom, env: list, ctx: Ctx, sites: dict) -> list:
        """``tanh(sow(sin(u) * w))``; with lazyharvest, under its custom rule
        (the oracle needs no rule: JAX differentiates the plain function).
        Planted, the oracle keeps the rule too: it stays in force for the
        derivatives of the planted function, and the plant is a constant for
        it (SPEC 9); the outputs are the planted function's, also under
        differentiation (docs/semantics.md, section 12)."""
        w: Any = 1.0
        if st.kind == "vjp_closure":  # a module-level weight: both close over it
            w = closure_weight(st.closure, jnp.shape(env[st.src]))

        # A recomputing rule differentiates the site itself: it has the
        # cotangent JAX gives the plain function.
        recomputes = st.kind == "vjp_recompute"

        def sown(u: Any, record: dict) -> Any:  # (JAX's custom functions bind defaults)
            return jnp.tanh(self.site(st.name, jnp.sin(u) * w, st.mode, ctx, record,
                                      under_rule=not recomputes))

        def primal(u: Any) -> Any:
            return sown(u, sites)

        def plain(u: Any) -> Any:
            return jnp.tanh(jnp.sin(u) * w)

        def derivative(u: Any) -> Any:  # d plain / du, elementwise
            return (1 - jnp.tanh(jnp.sin(u) * w) ** 2) * jnp.cos(u) * w
        u = env[st.src]
        if self.lh:
            return [_with_rule(st.kind, lambda u, _: primal(u), lambda u, _: plain(u),
                               derivative, u, ())]
        value = primal(u)  # (records the site outside any rule's trace)
        if (*ctx.scopes, st.name) not in self.plants:
            return [value]
        # The planted function's outputs do not depend on ``u``; they are an
        # operand, as a custom function may not close over a loop's tracers.
        return [_with_rule(st.kind, lambda u, c: c, lambda u, c: c, derivative, u, value)]

    def passes(self, st: Passes, env: list, ctx: Ctx, sites: dict) -> list:
        """Gradient steps, each a backward pass. The oracle unrolls them and
        writes each step's gradient by the chain rule: the cotangent at the
        site (``jax.grad`` of the loss in the site's value), plus a
        perturbation of it (``eps[("vjp", *key)]``), pulled back through the
        site's own computation. A plant replaces the value the cotangent is
        taken at; the step still differentiates through the site's
        computation (docs/semantics.md, section 5)."""
        if self.lh:
            def loss(h: Any) -> Any:
                return jnp.sum(jnp.tanh(lh.sow(jnp.sin(h) * 1.5, tag=self.prog.tag,
                                               name=st.name, mode=st.mode)))

            def step(h: Any) -> Any:
                return h - 0.25 * jax.grad(loss)(h)
            h = env[st.src]
            if st.kind == "steps":
                for _ in range(st.times):
                    h = step(h)
                return [h]
            h = step(h)
            if st.kind == "scan":
                return [lax.scan(lambda c, _: (step(c), None), h, None, length=st.times - 1)[0]]
            return [lax.while_loop(lambda s: s[0] < st.times - 1,
                                   lambda s: (s[0] + 1, step(s[1])), (0, h))[1]]
        key = (*ctx.scopes, st.name)
        ct_key = ("vjp", *key)
        h, steps = env[st.src], []
        for i in range(st.times):
            sub = ctx.iteration(i, st.times, i == st.times - 1)
            ct_eps = self.occurrence_eps(ct_key, st.mode, sub) if ct_key in self.eps else 0.

            local: dict = {}
            v = self.site(st.name, jnp.sin(h) * 1.5, st.mode, sub, local)
            ct = jax.grad(lambda u: jnp.sum(jnp.tanh(u)))(v)
            local[ct_key] = (st.mode, ct[None] if st.mode == "append" else ct)
            steps.append(local)
            h = h - 0.25 * jax.vjp(lambda h: jnp.sin(h) * 1.5, h)[1](ct + ct_eps)[0]
        for k in (key, ct_key):
            rows = [s[k][1] for s in steps]
            sites[k] = (st.mode, jnp.concatenate(rows) if st.mode == "append" else rows[-1])
        return [h]

    # -- the whole program ---------------------------------------------------------

    def run(self, args: Sequence[Any]) -> tuple[Any, dict]:
        env = [args[0]]
        if self.prog.tree_input:
            env += [args[1]["a"], args[1]["b"]]
        new, sites = self.block(self.prog.body, env, Ctx())
        env += new
        return output_value(self.prog.output, env), {k: v for k, (_, v) in sites.items()}
