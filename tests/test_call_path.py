"""The short call path of a reaped function (issue #10 item 3): a call with
the shapes of an earlier one traces nothing and skips the general lookup; a
leaf of an already compiled slice builds nothing. Counted, never timed."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import CompileCounter, close
from lazyharvest import api, program

COMPILES = CompileCounter()


def f(*xs):
    s = xs[0]
    for v in xs[1:]:
        s = s + v
    a = lh.sow(jnp.sin(s), tag="t", name="a")
    b = lh.sow(a * 2. + 1., tag="t", name="b")
    return jnp.sum(lh.sow(jnp.tanh(b), tag="t", name="c"))


def want(*xs):
    a = jnp.sin(sum(xs[1:], xs[0]))
    return {"a": a, "b": a * 2. + 1., "c": jnp.tanh(a * 2. + 1.)}


@pytest.fixture
def counts(monkeypatch):
    """Counts traces, general-path lookups and slice builds."""
    n = {"trace": 0, "lookup": 0, "build": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            n[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(program, "trace", counting("trace", program.trace))
    monkeypatch.setattr(api, "cached_trace", counting("lookup", api.cached_trace))
    monkeypatch.setattr(program.Traced, "_build", counting("build", program.Traced._build))
    return n


def test_repeated_calls_trace_once_and_skip_the_general_lookup(counts):
    g = lambda *xs: f(*xs)
    reaped = lh.reap(g, tag="t")
    xs = [jnp.full((4,), 0.1 * (i + 1)) for i in range(3)]
    close(reaped(*xs)["b"], want(*xs)["b"])
    assert counts == {"trace": 1, "lookup": 1, "build": 1}
    inputs = [[x + i for x in xs] for i in range(5)]
    wants = [jax.device_get(want(*ys)) for ys in inputs]
    before = COMPILES.count
    got = [(reaped(*ys)["b"], reaped(*ys).compute("a", "c")) for ys in inputs]
    assert counts == {"trace": 1, "lookup": 1, "build": 2}
    assert COMPILES.count - before == 1  # the compute slice, once
    for (b, ac), w in zip(got, wants):
        close(b, w["b"])
        close(ac, {"a": w["a"], "c": w["c"]})


def test_new_shapes_dtypes_and_trees_take_the_general_path(counts):
    reaped = lh.reap(lambda *xs: f(*xs), tag="t")
    calls = [(jnp.ones(3),), (jnp.ones(4),), (jnp.ones(4, jnp.int32),),
             (jnp.ones(3), jnp.ones(3)), (jnp.ones(3),)]
    for xs in calls:
        close(reaped(*xs)["a"], want(*xs)["a"])
    assert counts["trace"] == 4 and counts["lookup"] == 4


def test_python_scalars_and_keywords_take_the_general_path(counts):
    reaped = lh.reap(lambda x, y=1.: f(x, y), tag="t")
    for _ in range(2):
        close(reaped(2., 3.)["a"], np.sin(5.))
        close(reaped(jnp.float32(2.), y=jnp.float32(3.))["a"], np.sin(5.))
    assert counts["trace"] == 2 and counts["lookup"] == 4


def test_a_call_in_another_context_is_not_served_the_first_trace():
    reaped = lh.reap(lambda x: f(x), tag="t")
    x = jnp.ones(3)
    outside = list(reaped(x).keys())
    inside = lh.nest(lambda v: list(reaped(v).keys()), scope="s")(x)
    assert outside == ["a", "b", "c"]
    assert inside == [("s", "a"), ("s", "b"), ("s", "c")]
    assert list(reaped(x).keys()) == outside
    with jax.enable_x64():
        y = jnp.ones(3, jnp.float64)
        assert reaped(y)["a"].dtype == jnp.float64


def test_inside_jit_the_short_path_memoizes_no_tracer():
    reaped = lh.reap(lambda x: f(x), tag="t")
    x = jnp.ones(3)
    reaped(x)["b"]  # the concrete call first: its trace is then in the table
    kept = []

    @jax.jit
    def g(x):
        d = reaped(x)
        kept.append(d)
        return d["b"] + d["b"]
    close(g(x), 2 * want(x)["b"])
    with pytest.raises(lh.HarvestError, match="trace has ended"):
        kept[0]["a"]


def test_threads_share_the_short_path():
    reaped = lh.reap(lambda *xs: f(*xs), tag="t")
    xs = [jnp.full((4,), 0.1 * (i + 1)) for i in range(2)]
    reaped(*xs)["b"]
    out = [None] * 8
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        ys = [x + i for x in xs]
        out[i] = [reaped(*ys)["b"] for _ in range(20)][-1], want(*ys)["b"]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, expected in out:
        close(got, expected)


def test_a_hot_leaf_survives_program_eviction(monkeypatch, counts):
    monkeypatch.setattr(program, "PROGRAM_CACHE_SIZE", 2)
    reaped = lh.reap(lambda x: f(x), tag="t")
    x = jnp.ones(3)
    reaped(x)["b"]
    for keys in [("a",), ("c",), ("a", "c"), ("a", "b"), ("b", "c")]:
        reaped(x)["b"]  # read between each new program: not rebuilt
        reaped(x).compute(*keys)
    traced = reaped(x)._store.traced
    assert counts["build"] == 6
    assert len(traced.programs) <= 2
    assert set(traced.plain_programs) <= {k[0] for k in traced.programs}


def test_pytree_arguments_take_the_short_path_too(counts):
    reaped = lh.reap(lambda xs, y: f(*xs, y), tag="t")
    xs, y = [jnp.ones(3), 2 * jnp.ones(3)], 3 * jnp.ones(3)
    for _ in range(3):
        close(reaped(xs, y)["a"], want(*xs, y)["a"])
        close(reaped([x + 1 for x in xs], y)["a"], want(*[x + 1 for x in xs], y)["a"])
    close(reaped(tuple(xs), y)["a"], want(*xs, y)["a"])  # another tree: traced anew
    assert counts["trace"] == 2 and counts["lookup"] == 2


# --- the short path of a planted function (a patching sweep) -----------------------

def _planted_by_hand(xs, pa=None, pb=None):
    a = jnp.sin(sum(xs[1:], xs[0])) if pa is None else pa
    b = a * 2. + 1. if pb is None else pb
    return jnp.sum(jnp.tanh(b))


def test_repeated_plant_calls_skip_the_general_lookup(counts):
    planted = lh.plant(lambda p, xs: f(p, *xs), tag="t")
    x0 = jnp.full((4,), 0.2)
    xs = [jnp.full((4,), 0.1), jnp.full((4,), 0.3)]
    # keys given out of JAX's sorted order: the program takes them in its own
    calls = [({"b": jnp.full((4,), 0.5 * i, jnp.float32),
               "a": jnp.full((4,), -0.2 * i, jnp.float32)}, x0 + i) for i in range(6)]
    before = COMPILES.count
    got = [planted(p, x, xs) for p, x in calls]
    assert COMPILES.count - before == 1
    assert counts["trace"] == 1 and counts["lookup"] == 1  # then the short path
    for (p, x), g in zip(calls, got):
        close(g, _planted_by_hand([x, *xs], pa=p["a"], pb=p["b"]))


@pytest.mark.parametrize("plants", [
    lambda i: {"a": jnp.full((4,), 0.1 * i, jnp.float32),
               "b": jnp.full((4,), 0.2 * i, jnp.float32)},  # new arrays each call
    lambda i: {"a": jnp.full((4,), float(i))},  # a weakly typed plant (cast each call)
    lambda i: {"a": np.full(4, 0.1 * i, np.float32)},  # a numpy array
    lambda i: {"a": lambda v: v * i},  # a function
])
def test_plant_calls_the_short_path_cannot_serve_stay_right(plants):
    planted = lh.plant(lambda x: f(x), tag="t")
    x = jnp.full((4,), 0.3)
    for i in range(3):
        p = plants(i)
        pa = p["a"](jnp.sin(x)) if callable(p["a"]) else jnp.broadcast_to(p["a"], (4,))
        close(planted(p, x), _planted_by_hand([x], pa=pa, pb=p.get("b")))


def test_the_same_array_planted_at_two_keys_then_two_arrays():
    planted = lh.plant(lambda x: f(x), tag="t")
    x, same = jnp.full((4,), 0.3), jnp.full((4,), 0.7, jnp.float32)
    for _ in range(2):
        close(planted({"a": same, "b": same}, x), _planted_by_hand([x], same, same))
    pa, pb = jnp.full((4,), 0.1, jnp.float32), jnp.full((4,), 0.9, jnp.float32)
    close(planted({"a": pa, "b": pb}, x), _planted_by_hand([x], pa, pb))
    close(planted({"b": pb, "a": pa}, x), _planted_by_hand([x], pa, pb))


def test_a_plant_call_in_another_context_is_not_served_the_first_program():
    planted = lh.plant(lambda x: f(x), tag="t")
    x, p = jnp.full((4,), 0.3), {"a": jnp.full((4,), 0.5, jnp.float32)}
    for _ in range(2):
        close(planted(p, x), _planted_by_hand([x], pa=p["a"]))
    # inside another harvest of the tag, the plant's program is traced anew
    d = lh.reap(lambda x: planted(p, x) + lh.sow(x, tag="t", name="z"), tag="t")(x)
    close(d["z"], x)
    close(jax.jit(lambda x: planted(p, x))(x), _planted_by_hand([x], pa=p["a"]))
