"""One side of the differential import test (tests/test_import_changes_nothing.py).

    python tests/import_differential.py {with,without} PROGRAMS OUT

runs a corpus of JAX programs, no harvest anywhere, and pickles to OUT what
JAX made of them: per program and transformation (jit, grad, vjp, jvp,
linearize, vmap, checkpoint) the jaxpr as a string, traced with
`jax_check_tracer_leaks` on, and the values (or the errors); the device
arrays still alive once everything is deleted, stack depths inside functions
JAX calls and the frames of filtered tracebacks (those two first, before any
site is sown: lazyharvest hooks `call_hi_primitive` from its first use on).
`with` imports lazyharvest first; `without` never runs its package (the
random programs' description and interpreter are loaded from their files,
`lh.sow`/`lh.nest` being the identity). The test compares the two files.

The corpus: the random programs pickled in PROGRAMS, each run twice on the
`with` side: with `sow` the identity (the same code as the `without` side:
everything must be identical), and with lazyharvest's `sow` outside any
harvest (`sown:` entries: values and errors must be those of the sow-free
program; not the jaxprs, which hold the sites, and under differentiation
their dead and constant sites, docs/semantics.md section 2a);
plain-JAX models (an MLP, a transformer, Equinox, Flax, diffrax where
installed); and programs that once differed (issue 32).
"""

from __future__ import annotations

import gc
import inspect
import os
import pickle
import re
import sys
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_IDENTITY = types.SimpleNamespace(sow=lambda value, **_: value, nest=lambda f, scope: f)


def _program_modules(side: str):
    """(random_programs, _oracle), loaded without lazyharvest's package on
    the `without` side."""
    if side == "with":
        import lazyharvest  # noqa: F401  (installs its rules)
    else:
        for name, path in (("lazyharvest", "lazyharvest"),
                           ("lazyharvest.testing", os.path.join("lazyharvest", "testing"))):
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(ROOT, path)]  # type: ignore[attr-defined]
            sys.modules[name] = stub
        sys.modules["lazyharvest"].sow = _IDENTITY.sow  # type: ignore[attr-defined]
        sys.modules["lazyharvest"].nest = _IDENTITY.nest  # type: ignore[attr-defined]
    from lazyharvest.testing import _oracle, random_programs
    return random_programs, _oracle


# Modules of lazyharvest the `without` side may load: none that touches JAX's rules.
WITHOUT_MODULES = {"lazyharvest", "lazyharvest.keys", "lazyharvest.testing",
                   "lazyharvest.testing._oracle", "lazyharvest.testing.statements",
                   "lazyharvest.testing.random_programs"}


def main(side: str, programs_path: str, out_path: str) -> None:
    os.environ.setdefault("JAX_TRACEBACK_FILTERING", "remove_frames")
    records = corpus(side, programs_path)
    import jax

    out = {"side": side, "jax": jax.__version__, **records}
    jax.clear_caches()
    gc.unfreeze()
    gc.collect()
    out["live arrays at the end"] = len(jax.live_arrays())
    out["lazyharvest modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "lazyharvest")
    with open(out_path, "wb") as f:
        pickle.dump(out, f)


def corpus(side: str, programs_path: str) -> dict:
    """The records of every program (plain data: nothing of JAX's outlives it)."""
    random_programs, oracle = _program_modules(side)
    # (first: lazyharvest hooks call_hi_primitive's binds from its first
    # site on, which the sown programs below make)
    measured = {"depths": depths(), "tracebacks": filtered_tracebacks()}
    with open(programs_path, "rb") as f:
        described = pickle.load(f)
    out: dict = {}
    real_lh = oracle.lh
    for i, fields in enumerate(described):
        prog = random_programs.Program(*fields)
        oracle.lh = _IDENTITY
        out[f"random {i}"] = record(_fresh(prog.fn), prog.example_args(i))
        if side == "with":
            oracle.lh = real_lh
            out[f"sown: random {i}"] = record(_fresh(prog.fn), prog.example_args(i))
        oracle.lh = real_lh
    for name, (fn, args, which, *check_leaks) in models().items():
        out[name] = record(fn, args, which, *check_leaks)
    out.update(issue_programs())
    return {"programs": out, **measured}


def _fresh(fn):
    """A new function object calling `fn`: jit's caches never share a trace
    between the two ways a program runs."""
    return lambda *args: fn(*args)


# --- the transformations --------------------------------------------------------

def _scalar(f):
    import jax
    import jax.numpy as jnp

    return lambda *a: sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(f(*a)))


def _cotangents_like(tree):
    """Values (0.75) shaped like `tree`: tangents, cotangents."""
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda v: 0.5 * jnp.ones_like(v) + 0.25, tree)


def transforms() -> dict:
    import jax
    import jax.numpy as jnp

    def vjp(f, args):
        out, pull = jax.vjp(f, *args)
        return pull(_cotangents_like(out))

    def vmapped(f, args):
        batch = jax.tree_util.tree_map(lambda a: jnp.stack([a, -0.5 * a + 0.125]), args)
        return jax.vmap(f)(*batch)

    argnums = lambda args: tuple(range(len(args)))  # noqa: E731
    return {
        "jit": lambda f, args: jax.jit(f)(*args),
        "grad": lambda f, args: jax.grad(_scalar(f), argnums(args))(*args),
        "vjp": vjp,
        "jvp": lambda f, args: jax.jvp(f, args, _cotangents_like(args)),
        "linearize": lambda f, args: jax.linearize(f, *args)[1](*_cotangents_like(args)),
        "vmap": vmapped,
        "checkpoint": lambda f, args: jax.grad(_scalar(jax.checkpoint(f)), argnums(args))(*args),
    }


def _outcome(thunk) -> tuple:
    try:
        return "ok", thunk()
    except Exception as e:  # noqa: BLE001  (compared between the two sides)
        text = str(e)
        first = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
        # a leaked trace: through which closures (JAX's memoized thunks...)
        via = sorted(set(re.findall(r"\((\w+)\) closed-over variable", text)))
        return "error", first + (f" (via {', '.join(via)})" if via else "")


def record(fn, args, which=None, check_leaks=True) -> dict:
    """What JAX makes of `fn` at `args` under each transformation (those in
    `which`, default all): the jaxpr, traced with `jax_check_tracer_leaks` on
    (or the error), and the values (of one jit of every transformation that
    traced)."""
    import jax
    import numpy as np

    rec: dict = {}
    ok = {}
    jax.config.update("jax_check_tracer_leaks", check_leaks)
    try:
        for name, t in transforms().items():
            if which is not None and name not in which:
                continue
            kind, jaxpr = _outcome(lambda t=t: jax.make_jaxpr(lambda *a: t(fn, a))(*args))
            rec[name] = {"jaxpr": str(jaxpr) if kind == "ok" else jaxpr,
                         "primitives": _primitives(jaxpr.jaxpr) if kind == "ok" else None}
            if kind == "ok":
                ok[name] = t
    finally:
        jax.config.update("jax_check_tracer_leaks", False)
    kind, values = _outcome(lambda: jax.jit(lambda *a: {n: t(fn, a) for n, t in ok.items()})(
        *args))
    for name, t in ok.items():
        if kind != "ok":  # (one that fails when compiled: each on its own)
            one, value = _outcome(lambda t=t: jax.jit(lambda *a: t(fn, a))(*args))
        else:
            one, value = kind, values[name]
        # (copies: a view of a device buffer would keep its array alive)
        rec[name]["value"] = (jax.tree_util.tree_map(lambda v: np.array(v, copy=True), value)
                              if one == "ok" else value)
    # (JAX collects garbage after every trace it checks for leaks: what is
    # alive now is not scanned again)
    gc.collect()
    gc.freeze()
    return rec


def _primitives(jaxpr) -> list:
    """The primitives of `jaxpr`'s eqns, nested bodies included, in order."""
    out: list = []
    for e in jaxpr.eqns:
        out.append(e.primitive.name)
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(x, "jaxpr", x)
                if hasattr(inner, "eqns"):
                    out += ["{", *_primitives(inner), "}"]
    return out


# --- models ----------------------------------------------------------------------

def models() -> dict:
    """name -> (function, args, transformations or None for all[, whether
    to trace them with leak checks])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    rng = np.random.RandomState(0)
    w = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    found: dict = {}

    mlp = {"w1": w(3, 8), "b1": w(8), "w2": w(8, 2)}

    def mlp_fn(x):
        return jnp.tanh(x @ mlp["w1"] + mlp["b1"]) @ mlp["w2"]
    found["model: mlp"] = (mlp_fn, (x,), None)

    @jax.custom_vjp
    def clip_grad(v):
        return v

    clip_grad.defvjp(lambda v: (v, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    def block(h, p):
        def norm(v):
            m = v.mean(-1, keepdims=True)
            return (v - m) / jnp.sqrt(((v - m) ** 2).mean(-1, keepdims=True) + 1e-5)
        q, k, v = (norm(h) @ p[n] for n in ("q", "k", "v"))
        att = jax.nn.softmax(q @ k.T / np.sqrt(8.0), axis=-1)
        h = h + clip_grad(att @ v)
        return h + jnp.tanh(norm(h) @ p["up"]) @ p["down"]

    layers = {n: w(2, 8, 8) for n in ("q", "k", "v", "up", "down")}
    embed = w(3, 8)

    def transformer(x):
        h = x @ embed
        h, _ = lax.scan(lambda h, p: (jax.checkpoint(block)(h, p), None), h, layers)
        return jnp.mean(h, axis=-1)
    found["model: transformer (scan of checkpointed blocks, custom_vjp)"] = (
        transformer, (x,), None)

    try:
        import equinox as eqx
    except ImportError:
        pass
    else:
        net = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(1))
        found["model: equinox mlp"] = (lambda x: jax.vmap(net)(x), (x,), None)

        def eqx_loop(x):
            return eqx.internal.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1]) * mlp["b1"][:3]),
                (0, x[0]), max_steps=4, kind="checkpointed")[1]
        found["model: equinox checkpointed while"] = (eqx_loop, (x,),
                                                      ("jit", "grad", "vmap"))
    try:
        from flax import linen as nn
    except ImportError:
        pass
    else:
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.remat(nn.Dense)(8)(x)
                return nn.Dense(2)(jnp.tanh(x))
        flax_net = Net()
        variables = flax_net.init(jax.random.PRNGKey(2), x)
        found["model: flax linen (remat)"] = (lambda x: flax_net.apply(variables, x), (x,), None)
    try:
        import diffrax
    except ImportError:
        pass
    else:
        def solve(y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, th: -th * y), diffrax.Euler(), 0.0, 1.0, 0.25,
                y0, args=mlp["b1"][:3], max_steps=8)
            return sol.ys
        # (no leak checks: JAX's checker takes minutes on its grad)
        found["model: diffrax solve"] = (solve, (x[0],), ("jit", "grad"), False)
    return found


# --- the programs of issue 32 --------------------------------------------------------

def _left_alive(make) -> int:
    """Arrays left alive by running a jitted function that reads a device
    array, then clearing its cache and deleting both."""
    import jax
    import numpy as np

    gc.collect()
    before = len(jax.live_arrays())
    data = jax.device_put(np.ones(1024, np.float32))
    f = make(data)
    jax.block_until_ready(f())
    f.clear_cache()
    del f, data
    gc.collect()
    return len(jax.live_arrays()) - before


def issue_programs() -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    out: dict = {}
    for name, make in {
        "jit in jit": lambda d: jax.jit(lambda: jax.jit(lambda: d[0])()),
        "cond": lambda d: jax.jit(lambda: lax.cond(True, lambda: d[0], lambda: d[1])),
        "scan": lambda d: jax.jit(lambda: lax.scan(lambda c, _: (c + d[0], None), 0.0, None,
                                                   length=3)[0]),
    }.items():
        out[f"issue: arrays left by a {name} reading a device array"] = {
            "live": _left_alive(make)}

    a = jnp.arange(3.0)

    def scanned(x):
        return lax.scan(lambda c, y: (c * a.sum() + jnp.sin(y), None), x, jnp.ones(4))[0]
    jax.config.update("jax_check_tracer_leaks", True)
    try:
        out["issue: grad of a checkpointed scan closing over an array, leaks checked"] = {
            "grad": _outcome(lambda: float(jax.grad(jax.checkpoint(scanned))(1.0)))}
    finally:
        jax.config.update("jax_check_tracer_leaks", False)
    return out


# --- stack depths and filtered tracebacks ----------------------------------------------

def depths() -> dict:
    """`len(inspect.stack())` inside the functions JAX calls, less the
    caller's: JAX's own TracebackTest (tests/api_test.py) counts these."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    seen: dict = {}
    base = [0]

    def mark(name):
        seen.setdefault(name, []).append(len(inspect.stack()) - base[0])

    @jax.custom_vjp
    def f(x):
        mark("custom_vjp f")
        return x

    def f_fwd(x):
        mark("custom_vjp fwd")
        return x, None

    def f_bwd(_, g):
        mark("custom_vjp bwd")
        return (g,)
    f.defvjp(f_fwd, f_bwd)

    @jax.custom_jvp
    def g(x):
        mark("custom_jvp f")
        return x

    @g.defjvp
    def g_jvp(p, t):
        mark("custom_jvp jvp")
        return p[0], t[0]

    def marked(name):
        def fn(*a):
            mark(name)
            return a[0] if a else None
        return fn

    cases = [
        lambda: lax.scan(lambda c, x: (marked("scan body")(c), ()), 0, jnp.arange(4)),
        lambda: lax.cond(True, marked("cond branch"), lambda: None),
        lambda: jax.jit(marked("jit body"))(1),
        lambda: jax.grad(marked("grad"))(1.0),
        lambda: jax.vmap(marked("vmap"))(np.arange(3)),
        lambda: f(1.0),
        lambda: jax.grad(f)(1.0),
        lambda: g(1.0),
        lambda: jax.grad(g)(1.0),
        lambda: jax.jvp(g, (1.0,), (1.0,)),
    ]
    for case in cases:
        base[0] = len(inspect.stack())
        case()
    return seen


def filtered_tracebacks() -> dict:
    """The frames (file, function) of the filtered traceback of an error
    raised in user code that JAX calls, in several nestings."""
    import jax
    from jax import lax

    def boom(x):
        raise ValueError("boom")

    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: boom(x), lambda _, g: (g,))

    @jax.custom_jvp
    def g(x):
        return x

    g.defjvp(lambda p, t: boom(p[0]))
    cases = {
        "custom_vjp fwd under grad": lambda: jax.grad(f)(1.0),
        "custom_vjp fwd under grad of jit": lambda: jax.grad(jax.jit(f))(1.0),
        "custom_vjp fwd under grad of scan": lambda: jax.grad(
            lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0])(1.0),
        "custom_vjp fwd under grad of checkpoint": lambda: jax.grad(jax.checkpoint(f))(1.0),
        "custom_jvp rule under grad of cond": lambda: jax.grad(
            lambda x: lax.cond(True, g, lambda y: y, x))(1.0),
        "custom_jvp rule under linearize of jit": lambda: jax.linearize(jax.jit(g), 1.0),
        "scan body": lambda: lax.scan(lambda c, _: (boom(c), None), 0.0, None, length=2),
    }
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = "no error"
        except ValueError as e:
            out[name] = [(_where(fs.filename), fs.name)
                         for fs in traceback.extract_tb(e.__traceback__)]
        except Exception as e:  # noqa: BLE001 - JAX itself cannot (jax_scan3: grad of a scan)
            out[name] = f"JAX raised {type(e).__name__}"
    return out


def _where(filename: str) -> str:
    return os.path.basename(filename) if filename == __file__ else filename


if __name__ == "__main__":
    main(*sys.argv[1:4])
