"""`lazyharvest.testing` itself: the random programs cover every construct and
their oracle never calls lazyharvest, `check_all` skips what does not apply,
every checker fails on a deliberately broken harvest, and the checkers work
without pytest or hypothesis.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, reject, settings
from hypothesis import strategies as st
from jax import lax

import lazyharvest as lh
from helpers import X, fresh_victim, jax_dce_keeping_scans, simplest_with
from lazyharvest import _jax
from lazyharvest import testing as T
from lazyharvest._jax import ad as _ad  # the one module that touches JAX internals
from lazyharvest.primitive import JVP, PRIMAL, VJP, sow_p

# (the oracles run under jax.jit: with jax_scan3 on jax 0.12.1, as JAX means a scan)
dce_keeping_scans = pytest.fixture(autouse=True, scope="module")(jax_dce_keeping_scans)

# --- the random programs ---------------------------------------------------------------

@pytest.mark.parametrize("construct", [
    pytest.param(c, marks=() if c in {"cond", "scan", "while", "jit", "checkpoint"}
                 else pytest.mark.slow)
    for c in sorted(T.CONSTRUCTS - {"custom_jvp_without_tangents"})])  # (a known bug's shape)
def test_generator_covers_construct(construct):
    assert construct in simplest_with(construct).constructs


def test_generator_respects_exclude_and_dead_code():
    found = []

    @settings(max_examples=40, database=None, derandomize=True)
    @given(T.programs(exclude={"while", "scan", "constant"}, dead_code=False))
    def collect(p):
        found.append(p)
    collect()
    for p in found:
        assert not p.constructs & {"while", "scan", "constant"}
        assert len(p.output.srcs) >= 1
    with pytest.raises(ValueError, match="unknown constructs"):
        T.programs(exclude={"nonsense"})


def test_oracle_is_independent_of_lazyharvest(monkeypatch):
    # The slices, plants and perturbations never call sow.
    p = find(T.programs(), lambda p: {"scan", "cond", "scope"} <= p.constructs,
             settings=settings(max_examples=3000, database=None, derandomize=True))
    args = p.example_args(3)

    def no_sow(*a, **k):
        raise AssertionError("the oracle called lh.sow")
    monkeypatch.setattr(lh, "sow", no_sow)
    values = {k: s(*args) for k, s in p.slices.items()}
    p.plant({}, *args)
    p.perturb({}, *args)
    assert set(values) == set(p.keys)


def test_program_repr_is_a_listing():
    p = find(T.programs(), lambda p: "scan" in p.constructs,
             settings=settings(max_examples=2000, database=None, derandomize=True))
    text = repr(p)
    assert text.startswith("def random_program(") and "scan(" in text


def test_stacks_and_inputs_agree():
    seen = []

    @settings(max_examples=30, database=None, derandomize=True)
    @given(st.data())
    def draw(data):
        p = data.draw(T.programs(max_statements=2))
        s = data.draw(T.transform_stacks(p))
        args = data.draw(T.inputs(p, s))
        assert 1 <= len(s.transforms) <= 3
        if jax.config.values.get("jax_scan3") and _jax_cannot(
                lambda: jax.eval_shape(s.apply(lambda *a: p.plant({}, *a), jax), *args)):
            reject()  # (JAX alone cannot run the program without sites: a Scan3
            # has no batching rule inside a while loop in jax 0.12.1)
        jax.eval_shape(s.apply(p.fn, jax), *args)  # the inputs fit the stack
        seen.extend(t.kind for t in s.transforms)
    draw()
    assert {"grad", "jacfwd", "jacrev", "vmap", "jit"} <= set(seen)


def _jax_cannot(run):
    try:
        run()
    except NotImplementedError:
        return True
    return False


def test_site_info_modes_and_counts():
    def f(x):
        a = lh.sow(x, tag="t", name="a")
        c = lax.scan(lambda c, xi: (lh.sow(c + xi, tag="t", name="c", mode="clobber"),
                                    lh.sow(c * xi, tag="t", name="p", mode="append")),
                     0., x)[0]
        b = lax.cond(c > 0, lambda v: lh.sow(v, tag="t", name="b"),
                     lambda v: lh.sow(-v, tag="t", name="b"), a)
        return lh.nest(lambda v: lh.sow(v, tag="t", name="n"), scope="s")(b)
    info = T.site_info(f, jnp.ones(3), tag="t")
    assert info["a",].once and info["b",].once and info["s", "n"].once
    assert info["c",].mode == "clobber" and not info["c",].once
    assert info["p",].mode == "append" and info["p",].count == np.inf


# --- check_all -------------------------------------------------------------------------

def test_check_all_skips_what_does_not_apply():
    def f(n):  # integer input: no differentiation laws
        return lh.sow(n * 2, tag="t", name="d") + 1
    report = T.check_all(f, jnp.arange(3), tag="t")
    skipped = report.skipped()
    assert {1, 2, 5, 7} <= set(skipped), str(report)
    assert {4, 6, 8, 9} <= set(report.passed()), str(report)
    assert "law 7" in str(report)


# --- every checker fails on a broken harvest -------------------------------------------

def _slices():
    a = lambda x: jnp.sin(x) * x  # noqa: E731
    return {"a": a, ("s", "b"): lambda x: jnp.tanh(a(x)) + 1.}


def _perturb(eps, x):
    a = jnp.sin(x) * x + eps.get(("a",), 0.)
    b = jnp.tanh(a) + 1. + eps.get(("s", "b"), 0.)
    return jnp.sum(a * b)


@pytest.fixture
def tangents_doubled(monkeypatch):
    """sow's JVP rule reaps twice the tangent (the program's output is right)."""
    def broken(primals, tangents, *, path, **params):
        outs = sow_p.bind(*primals, path=path + (PRIMAL,), **params)
        ts = [_ad.instantiate_zeros(t) for t in tangents]
        reaped = sow_p.bind(*[2 * t for t in ts], path=path + (JVP,), **params)
        return outs, [r / 2 for r in reaped]
    monkeypatch.setitem(_ad.primitive_jvps, sow_p, broken)
    # jax.linearize / jax.vjp use sow's linearization rule, where installed
    monkeypatch.delitem(_jax.linearization_rules, sow_p, raising=False)


@pytest.fixture
def cotangents_doubled(monkeypatch):
    """sow's transpose reaps twice the cotangent (the gradient is right)."""
    def broken(cts, *args, path, **params):
        cts = [_ad.instantiate_zeros(c) for c in cts]
        path = (path[:-1] if path and path[-1] == JVP else path) + (VJP,)
        reaped = sow_p.bind(*[2 * c for c in cts], path=path, **params)
        return [r / 2 for r in reaped]
    monkeypatch.setitem(_ad.primitive_transposes, sow_p, broken)


def test_checkers_pass_on_the_victim():
    f = fresh_victim()
    T.check_linearize(f, X, tag="t")
    T.check_jvp(f, X, tag="t")
    T.check_jit(f, X, tag="t")
    T.check_vjp(f, X, tag="t")
    T.check_roundtrip(f, X, tag="t")
    T.check_lazy(f, X, tag="t", slices=_slices(), perturb=_perturb)
    T.check_compute(f, X, tag="t")
    T.check_nest(f, X, tag="t")


def test_law1_checker_catches_wrong_tangents(tangents_doubled):
    with pytest.raises(AssertionError, match=r"law 1 .*key 'a'.*max abs error"):
        T.check_linearize(fresh_victim(), X, tag="t")


def test_law2_checker_catches_wrong_tangents(tangents_doubled):
    with pytest.raises(AssertionError, match=r"law 2 .*key \('jvp', 'a'\).*max abs error"):
        T.check_jvp(fresh_victim(), X, tag="t")


def test_law3_checker_catches_ignored_out_axes(monkeypatch):
    # plain jax.vmap as "lh.vmap": the output follows out_axes, the sites do not.
    monkeypatch.setattr(lh, "vmap", jax.vmap, raising=False)
    xb = jnp.stack([X, X * 2.])
    T.check_vmap(fresh_victim(), xb, tag="t", in_axes=0, out_axes=0)
    with pytest.raises(AssertionError, match=r"law 3 .*key 'a'.*shapes differ"):
        T.check_vmap(fresh_victim(), xb, tag="t", in_axes=0, out_axes=-1)


def test_law4_checker_catches_a_jit_that_loses_sites():
    # harvest consumes every site of its tag (plant now passes unplanted ones through)
    hiding_jit = lambda g: jax.jit(lambda *a: lh.harvest(g, tag="t")({}, *a)[0])  # noqa: E731
    with pytest.raises(AssertionError, match=r"law 4 .*keys differ"):
        T.check_jit(fresh_victim(), X, tag="t", jit=hiding_jit)


def test_law5_checker_catches_wrong_cotangents(cotangents_doubled):
    with pytest.raises(AssertionError, match=r"law 5 .*\(b\).*key 'a'.*max abs error"):
        T.check_vjp(fresh_victim(), X, tag="t")


def test_law6_checker_catches_a_plant_that_shifts_values(monkeypatch):
    plant = lh.plant

    def shifted(f, **kw):
        return lambda plants, *a: plant(f, **kw)(
            {k: v + 1. for k, v in plants.items()}, *a)
    monkeypatch.setattr(lh, "plant", shifted)
    with pytest.raises(AssertionError, match=r"law 6 .*\(output\).*max abs error"):
        T.check_roundtrip(fresh_victim(), X, tag="t")


def test_law7_checker_catches_wrong_lazy_leaves(monkeypatch):
    getitem = lh.DelayedDict.__getitem__

    def shifted(self, key):
        v = getitem(self, key)
        return v if isinstance(v, lh.DelayedDict) else v + 1e-2
    monkeypatch.setattr(lh.DelayedDict, "__getitem__", shifted)
    with pytest.raises(AssertionError, match=r"law 7 .*plain keys.*key 'a'.*max abs error"):
        T.check_lazy(fresh_victim(), X, tag="t", slices=_slices())


def test_law7_checker_catches_wrong_tangents(tangents_doubled):
    with pytest.raises(AssertionError, match=r"law 7 .*jvp keys.*max abs error"):
        T.check_lazy(fresh_victim(), X, tag="t", slices=_slices())


def test_law7_checker_catches_wrong_cotangents(cotangents_doubled):
    with pytest.raises(AssertionError, match=r"law 7 .*vjp keys.*max abs error"):
        T.check_lazy(fresh_victim(), X, tag="t", slices=_slices(), perturb=_perturb,
                     forward=False)


def test_law7_checker_catches_a_wrong_recorded_transform(monkeypatch):
    # a "grad" that records nothing: its derivative keys are missing
    stack = T.Stack((T.Transform("grad"),))
    monkeypatch.setattr(lh, "grad", lambda f: jax.grad(f), raising=False)
    with pytest.raises(AssertionError, match=r"law 7 .*recorded transforms grad.*key"):
        T.check_lazy(fresh_victim(), X, tag="t", slices=_slices(), stack=stack)


def test_law8_checker_catches_a_wrong_compute(monkeypatch):
    compute = lh.DelayedDict.compute

    def scaled(self, *keys):
        return jax.tree_util.tree_map(lambda v: v * 1.01, compute(self, *keys))
    monkeypatch.setattr(lh.DelayedDict, "compute", scaled)
    with pytest.raises(AssertionError, match=r"law 8 .*key .*max abs error"):
        T.check_compute(fresh_victim(), X, tag="t")


def test_law9_checker_catches_a_nest_that_drops_the_scope(monkeypatch):
    monkeypatch.setattr(lh, "nest", lambda f, *, scope: f)
    with pytest.raises(AssertionError, match=r"law 9 .*keys differ"):
        T.check_nest(fresh_victim(), X, tag="t")


def test_check_all_reports_every_failing_law(tangents_doubled):
    with pytest.raises(AssertionError) as info:
        T.check_all(fresh_victim(), X, tag="t", slices=_slices())
    text = str(info.value)
    assert "law 1 " in text and "law 2 " in text and "law 7 " in text


# --- the module without pytest or hypothesis ------------------------------------------

def test_module_imports_without_pytest_and_hypothesis():
    code = textwrap.dedent("""
        import sys
        sys.modules["pytest"] = None
        sys.modules["hypothesis"] = None
        sys.modules["hypothesis.strategies"] = None
        import jax.numpy as jnp
        import lazyharvest as lh
        from lazyharvest.testing import check_all, programs
        f = lambda x: jnp.sum(lh.sow(jnp.sin(x), tag="t", name="s") ** 2)
        print(check_all(f, jnp.arange(3.), tag="t", laws=(4, 6, 8, 9)))
        try:
            programs()
        except ImportError as e:
            print("ImportError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "law 4 (reap∘jit = reap): passed" in out.stdout
    assert "ImportError: lazyharvest.testing: the random-program strategies need " \
           "hypothesis" in out.stdout


@pytest.mark.parametrize("scope", ["vjp", "jvp", "primal", "grad"])
def test_every_law_holds_with_scopes_spelled_like_labels(scope):
    # The value of `x` under scope "vjp" and the cotangent of `x` would share
    # the key ("vjp", "x"): the library spells one out, and the checkers read
    # a key's labels off the site it names, not off its spelling.
    def f(x):
        a = lh.sow(jnp.sin(x), tag="t", name="x")
        b = lh.nest(lambda y: lh.sow(jnp.cos(y), tag="t", name="x"), scope=scope)(a)
        return jnp.sum(a * b)

    def slice_a(x):
        return jnp.sin(x)

    def slice_b(x):
        return jnp.cos(jnp.sin(x))

    def perturb(eps, x):
        a = jnp.sin(x) + eps[("x",)]
        b = jnp.cos(a) + eps[(scope, "x")]
        return jnp.sum(a * b)
    report = T.check_all(f, X, tag="t", slices={"x": slice_a, (scope, "x"): slice_b},
                         perturb=perturb)
    assert set(report.passed()) == set(T.LAWS), str(report)


@pytest.mark.parametrize("name", ["vjp", "jvp", "grad"])
def test_every_law_holds_with_a_name_spelled_like_a_label(name):
    # Under jax.jvp a site named "jvp" is a leaf and a prefix (its tangent is
    # ("jvp", "jvp")): compute() keeps it under "" there, and the checkers
    # read it back (law 2 once compared the whole dict at "jvp").
    def f(x):
        a = lh.sow(jnp.cos(jnp.cos(x)), tag="t", name=name)
        return jnp.sum(lh.sow(jnp.sin(a), tag="t", name="other") * x)

    def perturb(eps, x):
        a = jnp.cos(jnp.cos(x)) + eps[(name,)]
        return jnp.sum((jnp.sin(a) + eps[("other",)]) * x)
    report = T.check_all(f, X, tag="t", perturb=perturb,
                         slices={name: lambda x: jnp.cos(jnp.cos(x)),
                                 "other": lambda x: jnp.sin(jnp.cos(jnp.cos(x)))})
    assert set(report.passed()) == set(T.LAWS), str(report)
    T.check_jvp(f, X, tag="t", strict_keys=True)
