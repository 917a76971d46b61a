"""The laws of docs/laws.md, run with `lazyharvest.testing` over random programs
and hand-written models.

Where the contract's statement of a law is narrowed, a `test_narrowed_*` test
shows the counterexample. Bugs the laws found (since fixed) stay as
`test_regression_*` tests, with a minimal reproducer checked against plain JAX.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import lazyharvest as lh
from helpers import (
    X,
    close,
    fresh_victim,
    jax_cannot_reverse_scan3,
    jax_dce_keeping_scans,
    jax_ignores_scan3_reverse,
    jax_jacfwd_fails_through_ref_writing_scans,
    simplest_with,
    skip_where_jax_checkpoints_scan3_wrongly,
)
from lazyharvest import _jax
from lazyharvest import testing as T
from lazyharvest.testing.random_programs import (
    Bin,
    Cond,
    Custom,
    Jit,
    Lin,
    Op,
    Output,
    Program,
    Red,
    Remat,
    Repeat,
    Scan,
    Scope,
    Sow,
    While,
)

# (the oracles run under jax.jit: with jax_scan3 on jax 0.12.1, as JAX means a scan)
dce_keeping_scans = pytest.fixture(autouse=True, scope="module")(jax_dce_keeping_scans)

# The property suites take most of this file's time; the fast subset
# (`-m "not slow"`) keeps every law on the simplest program of a few constructs.
slow = pytest.mark.slow
# Dead and constant sites under JAX's own differentiation need jax >= 0.9.
needs_derivative_sites = pytest.mark.skipif(
    not _jax.DERIVATIVE_SITES, reason="dead and constant sites need jax >= 0.9")
# The fast subset keeps these constructs (one per higher-order primitive).
FAST_CONSTRUCTS = {"cond", "scan", "while", "jit", "checkpoint"}


# Open bugs the generator's constructs find (docs/laws.md, "Bugs the laws
# found"; reproducers there): the per-construct test leaves out these laws,
# the property tests of these laws leave out the construct.
KNOWN_BUGS: dict[str, set[int]] = {}
# the constructs whose bugs are in reverse mode (laws 5 and 7)
REVERSE_BUGS: set[str] = set()
# JAX has no forward mode through custom_vjp: laws 1 and 2 do not apply there
NO_FORWARD = {"custom_vjp", "custom_vjp_closure", "custom_vjp_recompute"}
# a site in a custom rule's primal function has no key in a linear/backward
# function built outside the harvest (docs/laws.md, narrowed): the strict-key
# tests leave these out
CUSTOM = {"custom_jvp"} | NO_FORWARD
CONSTANT_IN_CHECKPOINT = {"constant_checkpoint", "constant_scan", "constant_scan_in_checkpoint",
                          "checkpointed_scan_body", "live_and_constant_clobber"}


def constructs(names):
    def marks(c):
        return [] if c in FAST_CONSTRUCTS else [slow]
    return [pytest.param(c, marks=marks(c)) for c in sorted(names)]



# Few, small examples: every example compiles a handful of XLA programs.
# (LH_LAW_EXAMPLES widens a search: HYPOTHESIS_PROFILE=wide LH_LAW_EXAMPLES=500)
_WIDE = int(os.environ.get("LH_LAW_EXAMPLES", 0))
FEW = settings(max_examples=_WIDE or 10, suppress_health_check=list(HealthCheck))
FEWER = settings(max_examples=_WIDE or 6, suppress_health_check=list(HealthCheck))


# jax 0.12.1 with jax_scan3 on, by itself: runs lax.scan(reverse=True)
# forward, has no reverse mode through a scan, and its `Scan3.jvp` fails on
# some zero tangents. The laws' plain-JAX sides then cannot run: reverse
# scans are left out, and law 6 differentiates no planted program with a
# scan (docs/compat.md).
SCAN3_RUNS_REVERSE_FORWARD = jax_ignores_scan3_reverse()
SCAN3_UNDIFFERENTIATED = jax_cannot_reverse_scan3()
# With jax_scan3 on a scan writes its carry Ref, and JAX's jacfwd fails
# through such a scan (with or without sites, lazyharvest or the flag): law 7
# draws no jacfwd for a program with a scan there.
SCAN3_NO_JACFWD = bool(jax.config.values.get("jax_scan3")) and (
    jax_jacfwd_fails_through_ref_writing_scans())


@st.composite
def program_and_args(draw, **kw):
    if SCAN3_RUNS_REVERSE_FORWARD:
        kw["exclude"] = set(kw.get("exclude", ())) | {"reverse_scan"}
    p = draw(T.programs(**kw))
    return p, draw(T.inputs(p))


# --- the laws over random programs ---------------------------------------------------

@FEW
@slow
@given(program_and_args(exclude=NO_FORWARD))
def test_law1_linearize(pa):
    p, args = pa
    T.check_linearize(p.fn, *args, tag=p.tag)


@FEW
@slow
@given(program_and_args(exclude=NO_FORWARD))
def test_law2_jvp(pa):
    p, args = pa
    T.check_jvp(p.fn, *args, tag=p.tag)


@FEW
@slow
@given(st.data())
def test_law3_vmap(data):
    p = data.draw(T.programs())
    s = data.draw(T.transform_stacks(p, kinds=("vmap",), max_depth=1))
    args = data.draw(T.inputs(p, s))
    (t,) = s.transforms
    T.check_vmap(p.fn, *args, tag=p.tag, in_axes=t.in_axes, out_axes=t.out_axes)


@FEW
@slow
@given(program_and_args())
def test_law4_jit(pa):
    p, args = pa
    T.check_jit(p.fn, *args, tag=p.tag)


@FEWER
@slow
@given(program_and_args())
def test_law4_recorded_jit(pa):
    p, args = pa
    T.check_jit(p.fn, *args, tag=p.tag, jit=lh.jit)


@FEW
@slow
# no reverse mode through while_loop; REVERSE_BUGS: KNOWN_BUGS. Cotangents
# planted at a random subset of sites.
@given(program_and_args(exclude={"while"} | REVERSE_BUGS),
       st.integers(0, 2 ** 16))
def test_law5_vjp(pa, seed):
    p, args = pa
    T.check_vjp(p.fn, *args, tag=p.tag, subset=seed)


@needs_derivative_sites
# Every derivative key, dead and constant sites included (SPEC 9), except
# where docs/laws.md narrows the law: the linear function of a while_loop,
# custom rules (CUSTOM).
@FEW
@given(program_and_args(exclude={"while"} | CUSTOM))
def test_law1_linearize_strict_keys(pa):
    p, args = pa
    T.check_linearize(p.fn, *args, tag=p.tag, strict_keys=True)


@needs_derivative_sites
@FEW
# (open: a custom_jvp site in a construct none of whose inputs has a tangent
# has no ("jvp", name) key, docs/laws.md)
@given(program_and_args(exclude=NO_FORWARD | {"custom_jvp_without_tangents"}))
def test_law2_jvp_strict_keys(pa):
    p, args = pa
    T.check_jvp(p.fn, *args, tag=p.tag, strict_keys=True)


@needs_derivative_sites
@FEW
@given(program_and_args(exclude={"while"} | CUSTOM | REVERSE_BUGS))
def test_law5_vjp_strict_keys(pa):
    p, args = pa
    T.check_vjp(p.fn, *args, tag=p.tag, strict_keys=True)


@FEW
@slow
@given(program_and_args(), st.integers(0, 2 ** 16))
def test_law6_roundtrip(pa, seed):
    # a random subset of the sites is planted; the others pass through; new
    # values planted there: the program written with them in place (p.plant),
    # also differentiated
    p, args = pa
    jax_differentiates = not (SCAN3_UNDIFFERENTIATED and "scan" in p.constructs)
    T.check_roundtrip(p.fn, *args, tag=p.tag, subset=seed, planted=p.plant,
                      forward=p.forward_differentiable and jax_differentiates,
                      reverse=p.reverse_differentiable and jax_differentiates)


@FEW
@slow
@given(program_and_args())
def test_law7_lazy_equals_direct_definition(pa):
    p, args = pa
    T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, forward=p.forward_differentiable)


@FEW
@slow
@given(program_and_args(exclude={"while"} | REVERSE_BUGS))  # KNOWN_BUGS
def test_law7_reverse_mode_keys(pa):
    p, args = pa
    T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, perturb=p.perturb,
                 forward=p.forward_differentiable)


@needs_derivative_sites
@FEW
# (the constant constructs of checkpoints: test_laws_on_constant_sites_in_checkpoints)
@given(program_and_args(exclude={"while"} | CUSTOM | REVERSE_BUGS))
def test_law7_strict_keys(pa):
    # every derivative key, dead and constant sites included (SPEC 9)
    p, args = pa
    T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, perturb=p.perturb,
                 strict_keys=True)


@FEWER
@slow
@given(st.data())
def test_law7_recorded_transforms(data):
    p = data.draw(T.programs(max_statements=4))
    kinds = ("grad", "jacfwd", "jacrev", "vmap", "jit")
    if SCAN3_NO_JACFWD and "scan" in p.constructs:
        kinds = tuple(k for k in kinds if k != "jacfwd")
    s = data.draw(T.transform_stacks(p, kinds=kinds))
    args = data.draw(T.inputs(p, s))
    T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, stack=s)


@FEW
@slow
@given(program_and_args())
def test_law8_compute_equals_one_by_one(pa):
    p, args = pa
    T.check_compute(p.fn, *args, tag=p.tag)


@FEW
@slow
@given(program_and_args())
def test_law9_nest(pa):
    p, args = pa
    T.check_nest(p.fn, *args, tag=p.tag)


# --- constant sites inside jax.checkpoint ---------------------------------------------
# Checkpoints and scans none of whose inputs has a tangent, constant scans in
# checkpoints, checkpointed scan bodies calling checkpointed layers, clobber
# names sown by a live and a constant occurrence (LH_LAW_EXAMPLES widens it).



def _check_law(law, p, args, seed):
    if law == 1:
        T.check_linearize(p.fn, *args, tag=p.tag, strict_keys=True)
    elif law == 2:
        T.check_jvp(p.fn, *args, tag=p.tag, strict_keys=True)
    elif law == 5:
        T.check_vjp(p.fn, *args, tag=p.tag, strict_keys=True, subset=seed)
    elif law == 6:
        T.check_roundtrip(p.fn, *args, tag=p.tag, subset=seed, planted=p.plant)
    else:
        T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, perturb=p.perturb,
                     strict_keys=True)


@needs_derivative_sites
@slow
@pytest.mark.parametrize("law", [1, 2, 5, 6, 7])
@FEW
@given(st.data())
def test_laws_on_constant_sites_in_checkpoints(law, data):
    p = data.draw(program_and_args(exclude={"while"} | CUSTOM).filter(
        lambda pa: pa[0].constructs & CONSTANT_IN_CHECKPOINT))
    _check_law(law, *p, data.draw(st.integers(0, 2 ** 16)))


# --- several differentiation passes in one program (opt-in constructs) ----------------
# A Python loop of jax.grad steps, a jax.grad before a lax.scan / lax.while_loop
# of them (`T.Passes`): their keys carry labels, ("vjp", name) for the
# cotangent each pass gives the site.

PASSES = set(T.OPT_IN)


@FEWER
@slow
@given(program_and_args(include=PASSES, exclude=NO_FORWARD))
def test_law1_linearize_with_several_passes(pa):
    p, args = pa
    T.check_linearize(p.fn, *args, tag=p.tag)


@FEWER
@slow
@given(program_and_args(include=PASSES - {"grad_while"}, exclude={"while"}),
       st.integers(0, 2 ** 16))
def test_law5_vjp_with_several_passes(pa, seed):
    # cotangents planted at value sites and at the inner passes' cotangents
    p, args = pa
    out = jax.eval_shape(p.fn, *args)
    bwd = jax.vjp(p.fn, *args)[1]
    d = lh.reap(bwd, tag=p.tag)(jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape), out))
    keys = list(map(lh.keys.normalize, d.keys()))
    chosen = np.random.RandomState(seed).rand(len(keys)) < 0.5
    T.check_vjp(p.fn, *args, tag=p.tag, plant_keys=[k for k, c in zip(keys, chosen) if c])


@FEWER
@slow
@given(program_and_args(include=PASSES), st.integers(0, 2 ** 16))
def test_law6_roundtrip_with_several_passes(pa, seed):
    # new values planted: the steps still differentiate through a planted site
    p, args = pa
    T.check_roundtrip(p.fn, *args, tag=p.tag, subset=seed, planted=p.plant,
                      forward=p.forward_differentiable, reverse=p.reverse_differentiable)


@FEWER
@slow
@given(program_and_args(include=PASSES))
def test_law7_lazy_with_several_passes(pa):
    # values, inner cotangents, their tangents (outer jax.jvp) and, without
    # a while_loop, their cotangents (outer jax.vjp), against the oracle
    p, args = pa
    T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, split=p.split,
                 perturb=p.perturb if p.reverse_differentiable else None,
                 forward=p.forward_differentiable)


def _grad_steps(kind, mode, sow=True, ct_eps=None, times=3):
    """sum(h ** 2) after `times` steps h -= 0.25 grad(loss)(h), loss(h) =
    sum(tanh(sin(h) * 1.5)) (a site there); `ct_eps[i]` is added to the
    cotangent at the site in step i (plain JAX: a term sum(e * v))."""
    def loss(h, e):
        v = jnp.sin(h) * 1.5
        if sow:
            v = lh.sow(v, tag="t", name="s", mode=mode)
        return jnp.sum(jnp.tanh(v)) + jnp.sum(e * v)

    def step(h, e):
        return h - 0.25 * jax.grad(loss)(h, e)

    def f(x):
        e = jnp.zeros((times,) + x.shape) if ct_eps is None else ct_eps
        if kind == "steps":
            h = x
            for i in range(times):
                h = step(h, e[i])
        else:
            h = lax.scan(lambda c, ei: (step(c, ei), None), step(x, e[0]), e[1:])[0]
        return jnp.sum(h ** 2)
    return f


def _inner_cotangents(x, mode, times=3):
    """The cotangent each step gives the site, in program order (plain JAX)."""
    h, out = x, []
    for _ in range(times):
        v = jnp.sin(h) * 1.5
        out.append(jax.grad(lambda u: jnp.sum(jnp.tanh(u)))(v))
        h = h - 0.25 * jax.grad(lambda h: jnp.sum(jnp.tanh(jnp.sin(h) * 1.5)))(h)
    return jnp.stack(out) if mode == "append" else out[-1]


@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("kind", ["steps", "scan"])
def test_regression_inner_cotangents_under_an_outer_jvp_keep_program_order(kind, mode):
    # (found by the generator's several-pass programs, law 7) under an outer
    # jax.jvp the passes' cotangents came in the reverse order (a clobber
    # site: the first pass's), their tangents too: an occurrence began a
    # new pass only at the outermost level
    x, t = jnp.array([0.3, -0.5, 0.7]), jnp.array([1.0, 0.5, -0.25])
    f = _grad_steps(kind, mode)
    d = lh.reap(lambda x: jax.jvp(f, (x,), (t,)), tag="t")(x)
    close(d["vjp", "s"], _inner_cotangents(x, mode))
    close(d["vjp", "jvp", "s"], jax.jvp(lambda x: _inner_cotangents(x, mode), (x,), (t,))[1])


@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("kind", ["steps", "scan"])
def test_regression_outer_cotangents_of_inner_cotangents_keep_program_order(kind, mode):
    # (same search, law 7 under jax.vjp) the outer backward pass visits the
    # inner passes last first: ("vjp", "vjp", name) came pass by pass reversed
    x = jnp.array([0.3, -0.5, 0.7])
    d = lh.reap(lambda x: jax.vjp(_grad_steps(kind, mode), x)[1](1.0), tag="t")(x)
    e0 = jnp.zeros((3, 3))
    want = jax.grad(lambda e: _grad_steps(kind, mode, sow=False, ct_eps=e)(x))(e0)
    close(d["vjp", "vjp", "s"], want if mode == "append" else want[-1])


@pytest.mark.parametrize("times", [2, 3])
@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("kind", ["steps", "scan"])
def test_regression_planting_an_inner_cotangent_into_the_outer_backward_function(
        kind, mode, times):
    # (law 5 (a) on several-pass programs) the outer backward pass visits the
    # inner passes last first: a cotangent planted at ("vjp", "s") took its
    # rows (a clobber plant: its occurrence) in that order, not the program's
    x = jnp.array([0.3, -0.5, 0.7])
    c = (jnp.arange(times * 3.0).reshape(times, 3) * 0.3 - 1 if mode == "append"
         else jnp.array([1.0, -2.0, 0.5]))
    f = _grad_steps(kind, mode, times=times)
    plain = _grad_steps(kind, mode, sow=False, times=times)
    _, vjp = jax.vjp(lambda x: (plain(x), _inner_cotangents(x, mode, times=times)), x)
    got = lh.plant(jax.vjp(f, x)[1], tag="t")({("vjp", "s"): c}, 1.0)
    close(got[0], vjp((jnp.float32(1.0), c))[0])


def _steps_in_a_scan(reverse, mode, sow=True, length=3, steps=2):
    """A scan whose body runs `steps` of `_grad_steps`' step; returns the
    output and (plain JAX) the cotangent each step gives the site, by
    iteration index then step."""
    def loss(h):
        v = jnp.sin(h) * 1.5
        return jnp.sum(jnp.tanh(lh.sow(v, tag="t", name="s", mode=mode) if sow else v))

    def body(h, _):
        cts = []
        for _ in range(steps):
            cts.append(jax.grad(lambda u: jnp.sum(jnp.tanh(u)))(jnp.sin(h) * 1.5))
            h = h - 0.25 * jax.grad(loss)(h)
        return h, jnp.stack(cts)

    def f(x):
        h, cts = lax.scan(body, x, None, length=length, reverse=reverse)
        return jnp.sum(h ** 2), cts.reshape(length * steps, *x.shape)
    return f


@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("reverse", [False, True])
def test_regression_planting_an_inner_cotangent_in_a_reverse_scan_of_grad_steps(reverse, mode):
    # (the wide law-5 run on several-pass programs) a scan with reverse=True
    # whose body runs two jax.grad steps: the inner cotangents' rows are by
    # iteration index (as the values'), and a plant at ("vjp", "s") in the
    # outer backward function took them iteration by iteration in the order
    # the scan runs (its transpose runs forward)
    x = jnp.array([0.3, -0.6, 0.9])
    f = lambda x: _steps_in_a_scan(reverse, mode)(x)[0]  # noqa: E731
    _, vjp = jax.vjp(_steps_in_a_scan(reverse, mode, sow=False), x)
    rows = jnp.asarray(np.random.RandomState(1).randn(6, 3), jnp.float32)
    c = rows if mode == "append" else rows[-1]
    if mode == "clobber":  # added at the reaped occurrence: the highest index's last step
        rows = jnp.zeros_like(rows).at[-1].set(c)
    got = lh.plant(jax.vjp(f, x)[1], tag="t")({("vjp", "s"): c}, 1.0)
    close(got[0], vjp((jnp.float32(1.0), rows))[0])


def _grad_step_in_a_cond(after_another):
    def loss(h, sow):  # (plain JAX: sow=False)
        v = jnp.sin(h) * 1.5
        return jnp.sum(jnp.tanh(lh.sow(v, tag="t", name="s", mode="clobber") if sow else v))

    def f(x, sow=True):
        step = lambda h: h - 0.25 * jax.grad(loss)(h, sow)  # noqa: E731
        h = step(x) if after_another else x
        return jnp.sum(lax.cond(x[0] > 0, step, lambda h: h, h) ** 2)
    return f


def test_regression_a_cotangent_planted_over_passes_one_of_them_in_a_cond():
    # a pass in a cond some of whose branches run none: with another pass
    # before it, which row (clobber: which occurrence) each takes depends on
    # the predicate, so the plant is refused; alone, it is planted as evaluated
    x, c = jnp.array([0.3, -0.5, 0.7]), jnp.array([1.0, -2.0, 0.5])
    bwd = jax.vjp(_grad_step_in_a_cond(True), x)[1]
    with pytest.raises(lh.HarvestError, match="'vjp/vjp/s'.*lax.cond whose branches differ"):
        lh.plant(bwd, tag="t")({("vjp", "s"): c}, 1.0)
    f = _grad_step_in_a_cond(False)

    def plain(x):  # the program with the site's cotangent as an output
        ct = jax.grad(lambda u: jnp.sum(jnp.tanh(u)))(jnp.sin(x) * 1.5)
        return f(x, False), ct
    got = lh.plant(jax.vjp(f, x)[1], tag="t")({("vjp", "s"): c}, 1.0)
    close(got[0], jax.vjp(plain, x)[1]((jnp.float32(1.0), c))[0])


# --- every law on the simplest program with each construct ----------------------------

# (the several-pass constructs: `test_law*_with_several_passes`, laws 1, 5, 6, 7)
@pytest.mark.parametrize("construct", constructs(T.CONSTRUCTS - {"site", "elementwise"}
                                                 - T.OPT_IN - {"custom_jvp_without_tangents"}))
def test_every_law_on_construct(construct):
    p = simplest_with(construct)
    if SCAN3_RUNS_REVERSE_FORWARD and "reverse_scan" in p.constructs:
        pytest.skip(f"jax {jax.__version__} itself runs lax.scan(reverse=True) forward with "
                    f"jax_scan3 on (the simplest program with {construct} has a reverse scan)")
    args = p.example_args(7)
    laws = set(T.LAWS) - KNOWN_BUGS.get(construct, set())
    reverse = p.reverse_differentiable
    report = T.check_all(p.fn, *args, tag=p.tag, slices=p.slices, laws=laws,
                         perturb=p.perturb if reverse else None)
    expected = set(laws)
    if not p.reverse_differentiable:
        expected -= {5}  # no reverse mode through while_loop
    if not p.forward_differentiable:
        expected -= {1, 2}  # no forward mode through custom_vjp
    assert set(report.passed()) == expected, str(report)


# --- hand-written models -------------------------------------------------------------

def _sow_lh(tag):
    def site(v, scope, name, mode="strict"):
        return lh.nest(lambda u: lh.sow(u, tag=tag, name=name, mode=mode), scope=scope)(v)
    return site


def _sow_oracle(record, eps):
    """A site in JAX alone: records the value, with `eps` added."""
    def site(v, scope, name, mode="strict"):
        v = v + eps.get((scope, name), 0.)
        record[(scope, name)] = v
        return v
    return site


def mlp(params, x, site):
    h = x
    for i, (w, b) in enumerate(params):
        h = site(jnp.tanh(h @ w + b), f"layer{i}", "h")
    return jnp.sum(h ** 2)


def attention(params, x, site):
    wq, wk, wv, wo = params
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = site(q @ k.T / np.sqrt(q.shape[-1]), "attn", "scores")
    weights = site(jax.nn.softmax(scores, axis=-1), "attn", "weights")
    out = site(weights @ v, "attn", "out")
    return jnp.mean(jnp.tanh(out @ wo))


def rnn(params, xs, site):
    w, u, e = params
    emb = site(xs @ e, "rnn", "embed")

    def step(h, x):
        h = site(jnp.tanh(w @ h + u @ x), "rnn", "h", "append")
        return h, h
    h, hs = lax.scan(step, jnp.zeros(w.shape[0]), emb)
    return jnp.sum(h) + 0.1 * jnp.sum(hs ** 2)


def rnn_oracle(eps, params, xs):
    """The RNN in JAX alone: output and site values, `eps` added (a row per step)."""
    w, u, e = params
    emb = xs @ e + eps.get(("rnn", "embed"), 0.)
    dh = eps.get(("rnn", "h"), jnp.zeros((xs.shape[0], w.shape[0])))

    def step(h, inp):
        x, d = inp
        h = jnp.tanh(w @ h + u @ x) + d
        return h, h
    h, hs = lax.scan(step, jnp.zeros(w.shape[0]), (emb, dh))
    return jnp.sum(h) + 0.1 * jnp.sum(hs ** 2), {("rnn", "embed"): emb, ("rnn", "h"): hs}


def _model_case(name):
    r = np.random.RandomState(0)
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.5, jnp.float32)  # noqa: E731
    if name == "mlp":
        return mlp, [(n(4, 5), n(5)), (n(5, 3), n(3))], n(2, 4)
    if name == "attention":
        return attention, (n(4, 4), n(4, 4), n(4, 4), n(4, 2)), n(3, 4)
    return rnn, (n(3, 3), n(3, 2), n(4, 2)), n(5, 4)


@slow
@pytest.mark.parametrize("name", ["mlp", "attention", "rnn"])
def test_check_all_on_model(name):
    model, params, x = _model_case(name)
    f = lambda params, x: model(params, x, _sow_lh("act"))  # noqa: E731

    def oracle(eps, params, x):
        if model is rnn:
            return rnn_oracle(eps, params, x)
        record = {}
        return model(params, x, _sow_oracle(record, eps)), record

    keys = list(oracle({}, params, x)[1])
    slices = {k: (lambda k: lambda *a: oracle({}, *a)[1][k])(k) for k in keys}
    report = T.check_all(f, params, x, tag="act", slices=slices,
                         perturb=lambda eps, *a: oracle(eps, *a)[0])
    ran = set(report.passed())
    assert {1, 2, 4, 5, 6, 7, 8, 9} <= ran, str(report)
    assert 3 in ran, str(report)


# --- where SPEC's statement is narrowed (docs/laws.md) ---------------------------------

@needs_derivative_sites
def test_constant_sites_have_derivative_keys():
    # a zero tangent, and the cotangent d out / d site (SPEC 9)
    def f(x):
        k = lh.sow(jnp.array([1., 2.]), tag="t", name="k")
        return jnp.sum(k * x)
    T.check_jvp(f, 1., tag="t", strict_keys=True)
    T.check_linearize(f, 1., tag="t", strict_keys=True)
    T.check_vjp(f, 1., tag="t", strict_keys=True)
    assert not lh.reap(lambda x: jax.jvp(f, (x,), (1.,)), tag="t")(1.)["jvp", "k"].any()
    np.testing.assert_allclose(lh.reap(jax.grad(f), tag="t")(3.)["vjp", "k"], [3., 3.])


@needs_derivative_sites
def test_dead_sites_stay_in_linear_and_backward_functions():
    def f(x):
        lh.sow(x * 2., tag="t", name="dead")
        return lh.sow(jnp.sin(x), tag="t", name="live") * 3.
    T.check_linearize(f, 1., tag="t", strict_keys=True)
    T.check_vjp(f, 1., tag="t", strict_keys=True)
    assert float(lh.reap(jax.linearize(f, 1.)[1], tag="t")(1.)["dead"]) == 2.
    assert float(lh.reap(jax.vjp(f, 1.)[1], tag="t")(1.)["dead"]) == 0.
    # inside the harvest too, with a zero cotangent
    d = lh.reap(jax.grad(f), tag="t")(1.)
    assert float(d["vjp", "dead"]) == 0.


@needs_derivative_sites
def test_regression_constant_sites_in_checkpoint_have_reverse_mode_keys():
    # (narrowed before: the zero tangent landed in the checkpoint's forward part)
    def f(x):
        k = lh.sow(jnp.array([1., 2.]), tag="t", name="k")
        return jnp.sum(k * x)
    cf = jax.checkpoint(f)
    T.check_jvp(cf, 1., tag="t", strict_keys=True)
    T.check_linearize(cf, 1., tag="t", strict_keys=True)
    T.check_vjp(cf, 1., tag="t", strict_keys=True)
    ct = lh.reap(jax.vjp(cf, 1.)[1], tag="t")(3.)["k"]
    close(ct, jax.grad(lambda e: 3. * jnp.sum((jnp.array([1., 2.]) + e) * 1.))(jnp.zeros(2)))


def test_narrowed_plant_gradient_is_partial_for_repeated_sites():
    # law 5(b) for an append site whose occurrences feed each other
    def f(x):
        def body(c, xi):
            c = lh.sow(jnp.sin(c) + xi, tag="t", name="h", mode="append")
            return c, None
        return lax.scan(body, 0.5, x)[0]
    T.check_vjp(f, X, tag="t")  # default keys: sites sown once
    with pytest.raises(AssertionError, match=r"law 5 .*\(b\).*key 'h'"):
        T.check_vjp(f, X, tag="t", keys=["h"])
    # the cotangent itself is right: the gradient w.r.t. a perturbation
    def perturb(eps, x):
        def body(c, inp):
            xi, e = inp
            c = jnp.sin(c) + xi + e
            return c, None
        return lax.scan(body, 0.5, (x, eps[("h",)]))[0]
    def slice_h(x):
        return lax.scan(lambda c, xi: (jnp.sin(c) + xi,) * 2, 0.5, x)[1]
    T.check_lazy(f, X, tag="t", slices={"h": slice_h}, perturb=perturb)


def test_narrowed_roundtrip_of_clobber_site_in_a_loop():
    def f(x):
        def body(c, xi):
            t = lh.sow(jnp.sin(c) * xi, tag="t", name="t", mode="clobber")
            return c + t, None
        return lax.scan(body, 1., x)[0]
    T.check_roundtrip(f, X, tag="t")  # default keys leave it out
    with pytest.raises(AssertionError, match=r"law 6 .*\(output\)"):
        T.check_roundtrip(f, X, tag="t", keys=["t"])


def test_narrowed_linearize_of_while_loop_has_jvp_keys():
    # JAX cannot split a while loop: the linear function runs it whole, so its
    # sites are reaped as under jax.jvp (docs/semantics.md section 2).
    def w(x):
        return lax.while_loop(
            lambda s: s[0] < 2,
            lambda s: (s[0] + 1, lh.sow(jnp.sin(s[1]), tag="t", name="w", mode="clobber")),
            (0, x))[1]
    T.check_linearize(w, 0.5, tag="t")
    with pytest.raises(AssertionError, match=r"law 1 .*only on the left: \[\('jvp', 'w'\)\]"):
        T.check_linearize(w, 0.5, tag="t", strict_keys=True)
    d = lh.reap(jax.linearize(w, 0.5)[1], tag="t")(1.)
    np.testing.assert_allclose(d["w"], jnp.sin(jnp.sin(0.5)), rtol=1e-6)
    np.testing.assert_allclose(d["jvp", "w"], jax.jvp(w, (0.5,), (1.,))[1], rtol=1e-6)


def test_narrowed_plain_jax_vmap_is_not_a_law():
    def f(x):
        return lax.scan(lambda c, xi: (c + xi, lh.sow(c * xi, tag="t", name="p",
                                                      mode="append")), 0., x)[0]
    xb = jnp.ones((2, 3))
    with pytest.raises(AssertionError, match=r"law 3 .*key 'p'.*shapes differ"):
        T.check_vmap(f, xb, tag="t", vmap=jax.vmap)
    with pytest.raises(AssertionError, match=r"law 3 .*shapes differ"):
        T.check_vmap(fresh_victim(), jnp.stack([X, X]), tag="t", out_axes=-1, vmap=jax.vmap)


# --- regressions: partial evaluation lost or hoisted sites ------------------------------

XS = jnp.array([0.3, -0.2, 0.5])


def _dead_cond_site(u):
    return lax.cond(jnp.sum(u) > 0, lambda u: lh.sow(u + 0.3, tag="t", name="s"),
                    lambda u: lh.sow(u * u, tag="t", name="s"), u)


def test_regression_dead_cond_site_in_checkpoint_has_a_zero_cotangent():
    # JAX's partial eval of lax.cond dropped the staged branches when none of
    # their outputs was used, the tangent copy of the site with them: under
    # jax.grad the site had no ('vjp', name) key (SPEC 3.2 gives it zeros).
    def f(x):
        jax.checkpoint(_dead_cond_site)(x * 2)
        return jnp.sum(x ** 2)
    d = lh.reap(jax.grad(f), tag="t")(XS)
    assert set(d.keys()) == {"s", ("vjp", "s")}
    np.testing.assert_allclose(d["s"], XS * 2 + 0.3, rtol=1e-6)  # sum(2x) > 0
    np.testing.assert_array_equal(d["vjp", "s"], jnp.zeros(3))
    d = lh.reap(jax.grad(f), tag="t")(-XS)
    np.testing.assert_allclose(d["s"], 4 * XS * XS, rtol=1e-6)
    np.testing.assert_array_equal(d["vjp", "s"], jnp.zeros(3))


def test_regression_dead_cond_site_in_checkpoint_after_scan():
    # The same dead cond site, fed by the stacked output of a scan with an
    # append site: reaping jax.grad crashed ("Expected cotangent type float32[]
    # but got float32[3]").
    def f(x):
        ys = lax.scan(lambda c, xi: (c, lh.sow(jnp.sum(c * xi), tag="t", name="o",
                                              mode="append")), x, x)[1]
        jax.checkpoint(_dead_cond_site)(ys)
        return jnp.sum(x ** 2)
    d = lh.reap(jax.grad(f), tag="t")(XS).compute()
    ys = XS * jnp.sum(XS)
    np.testing.assert_allclose(d["o"], ys, rtol=1e-6)
    np.testing.assert_allclose(d["s"], ys + 0.3, rtol=1e-6)  # sum(ys) > 0
    np.testing.assert_array_equal(d["vjp"]["s"], jnp.zeros(3))
    np.testing.assert_array_equal(d["vjp"]["o"], jnp.zeros(3))


def _checkpointed_dead_scan(x):
    # A checkpointed block: a scan whose output nothing uses sows "s" after
    # the block sowed it; the block returns cos(x).
    v = lh.sow(x, tag="t", name="s", mode="clobber")
    v = lax.scan(lambda c, _: (lh.sow(jnp.sin(c), tag="t", name="s", mode="clobber"), None),
                 v, None, length=1)[0]
    return jnp.cos(x)


@needs_derivative_sites
def test_regression_dead_scan_in_checkpoint_takes_its_planted_cotangent():
    # The transpose of jax.checkpoint (partial evaluation of the body's jvp)
    # dropped the scan, its tangent site with it: a cotangent planted into
    # the backward function at "s" went to the occurrence before the scan
    # (the input) instead of the scan's (sin of the input).
    f = lambda x: jnp.sum(jax.checkpoint(_checkpointed_dead_scan)(x))  # noqa: E731
    ct_s = jnp.array([-1.5, 0.25, -0.6])
    bwd = jax.vjp(f, XS)[1]
    got = lh.plant(bwd, tag="t")({"s": ct_s}, 1.0)[0]
    # Oracle: the VJP of (f, the reaped occurrence sin(x)), a perturbation at it.
    want = jax.vjp(lambda x, e: (f(x), jnp.sin(x) + e), XS, jnp.zeros(3))[1]((1.0, ct_s))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(lh.reap(bwd, tag="t")(1.0)["s"], jnp.zeros(3))


def test_regression_zero_trip_scan_in_checkpoint_under_a_plant_gradient():
    # A checkpointed scan given a zero tangent so that its sites meet the
    # differentiation (the input differentiated is a plant, not x): the
    # tangent site of its carry, with no unknown input, was dropped from the
    # split body while the carry still used it ("KeyError: Var(...)").
    def f(x):
        def block(x):
            v = lax.scan(lambda c, _: (lh.sow(jnp.sin(c), tag="t", name="s0", mode="clobber"),
                                       None), x, None, length=0)[0]
            return lax.cond(jnp.sum(v) > 0, lambda o: lh.sow(jnp.cos(o), tag="t", name="s1"),
                            lambda o: lh.sow(jnp.sin(o), tag="t", name="s1"), v)
        return jnp.sum(jax.checkpoint(block)(x) ** 2)
    value = lh.reap(f, tag="t")(XS)["s1"]
    got = jax.grad(lambda p: lh.plant(f, tag="t")({"s1": p}, XS))(value)
    np.testing.assert_allclose(got, 2 * value, rtol=1e-6)  # d sum(p^2) / dp


def _checkpointed_scan_program(*, trips: int, pre: bool, then_cond: bool):
    body: tuple = (While(src=0, ops=("sin",), trips=trips, name="s0", kind="scan", pre=pre,
                         inner="", inner_trips=0), Op(fn="cos", src=0))
    if then_cond:
        body += (Cond(pred=1, operand=1, branches=(("cos",), ("cos",)), sites=(0,),
                      names=("s1",), mode="strict", sows=(), pre=False, vmap=False),
                 Op(fn="cos", src=2))
    out = Output(kind="scalar", srcs=(3 if then_cond else 2,))
    return Program(body=(Remat(body=body),), output=out, tree_input=False, tag="law")


@pytest.mark.parametrize("p", [
    _checkpointed_scan_program(trips=1, pre=True, then_cond=False),
    _checkpointed_scan_program(trips=0, pre=False, then_cond=True)], ids=["dead", "zero-trip"])
def test_regression_law5_on_a_checkpointed_scan_program(p):
    # The two programs a wider (non-derandomized) search found (docs/laws.md).
    T.check_vjp(p.fn, *p.example_args(0, ()), tag=p.tag, subset=0)


_W = np.array([1.2, 1.4, 0.9], np.float32)


def _closing_rule(name: str = "s0", mode: str = "strict"):
    def g(u):
        return jnp.tanh(lh.sow(jnp.sin(u) * _W, tag="t", name=name, mode=mode))
    rule = jax.custom_vjp(g)
    rule.defvjp(lambda u: (g(u), u),
                lambda u, ct: (ct * (1 - jnp.tanh(jnp.sin(u) * _W) ** 2) * jnp.cos(u) * _W,))
    return rule


def test_regression_plant_gradient_past_a_jitted_custom_vjp_closing_over_an_array():
    # (a wide law-5 search) A jit none of whose operands has a tangent gets
    # a zero tangent on one, so that its sites meet the level; the first
    # operand was the array a custom_vjp in the jit closes over, and JAX
    # refuses to differentiate one ("with respect to a closed-over value").
    rule = _closing_rule()

    def f(x):
        v = jax.jit(lh.nest(lambda x: rule(jnp.cos(x)), scope="b0"))(x)
        v = lax.cond(jnp.sum(v) > 0, lambda o: lh.sow(jnp.cos(o), tag="t", name="s0"),
                     lambda o: lh.sow(jnp.sin(o), tag="t", name="s0"), v)
        return jnp.sum(v ** 2)
    p = lh.reap(f, tag="t")(XS)["s0"]
    # plain JAX: the planted value is the cond's output, so d sum(p^2) / dp
    got = jax.grad(lambda p: lh.plant(f, tag="t")({"s0": p}, XS))(p)
    np.testing.assert_allclose(got, 2 * p, rtol=1e-6)
    T.check_vjp(f, XS, tag="t", subset=1)


@pytest.mark.parametrize("uses_the_site", [False, True])
def test_regression_plant_gradient_past_a_scan_of_a_rule_closing_over_an_array(uses_the_site):
    # (the wide searches, reduced) A jitted scan whose body calls a
    # custom_vjp closing over an array: traced again from the harvest's
    # program (and through JAX's DCE of the call), the closed-over array is
    # an ordinary operand of the call, so the zero tangent a jit none of
    # whose operands has one gets (for its sites to meet the level) reached
    # it: "differentiation of a custom_vjp function with respect to a
    # closed-over value".
    rule = _closing_rule("g", "append")

    def f(x, site=None):
        s = lh.sow(jnp.cos(x), tag="t", name="s") if site is None else site

        @jax.jit
        def block(x):
            def body(c, xi):
                r = rule(x)
                return 0.5 * c + jnp.tanh(jnp.sum(r) + xi), lh.sow(r, tag="t", name="r",
                                                                   mode="append")
            return lax.scan(body, 0., x, reverse=True)
        c, ys = block(x)
        return jnp.sum(ys) + c + (jnp.sum(s) if uses_the_site else 0.)
    x = jnp.array([0.3, 0.5, 0.7])
    value = lh.reap(f, tag="t")(x)["s"]
    got = jax.grad(lambda p: lh.plant(f, tag="t")({"s": p}, x))(value)
    # plain JAX: the program with the planted value in place of the site
    close(got, jax.grad(lambda p: f(x, site=p))(value))
    T.check_vjp(f, x, tag="t")


def _closing_rule_program(then: str):
    head = Jit(body=(Scope(scope="b0", body=(
        Op("cos", 0), Custom(src=1, name="s0", mode="strict", kind="vjp_closure", closure=1))),
        Op("cos", 2)))
    if then == "switch":
        rest = Remat(body=(
            Bin("add", 3, 3),
            Cond(pred=2, operand=1, branches=(("cos",) * 3,) * 3, sites=(0,), names=("s0",),
                 mode="strict"),
            Repeat(src=3, body=(Sow("s1", (4,), "append"), Lin(1, 7), Red("sqnorm", 5)),
                   times=2, jit=True)))
        return Program(body=(head, rest), output=Output("scalar", (1, 6))), 0, 1
    rest = Remat(body=(Op("square", 1), Op("sigmoid", 1),
                       Sow("s0", srcs=(), mode="strict", const=(3,), seed=6)))
    return Program(body=(head, rest), output=Output("tree", (6,))), 194, 5709


@pytest.mark.parametrize("then", ["switch", "constant"])
def test_regression_law5_on_a_closing_rule_program(then):
    # The two programs of the wide law-5 search (docs/laws.md).
    p, args_seed, subset = _closing_rule_program(then)
    T.check_vjp(p.fn, *p.example_args(args_seed), tag=p.tag, subset=subset)


def _wide_search_program(which: str):
    if which == "closure_in_scan":  # law 5
        body = (
            Jit(body=(Remat(body=(Op("cos", 2), Op("cos", 3), Op("cos", 4))),)),
            Op("cos", 5),
            Cond(pred=6, operand=6, branches=(("cos",),) * 3, sites=(0,), names=("s0",),
                 mode="strict"),
            Jit(body=(Remat(body=(Bin("add", 0, 3), Op("shift", 2),
                                  Sow("grad", (1, 4), "strict"))),
                      Scan(carry=4, xs=8, reverse=True, body=(
                          Custom(src=0, name="s2", mode="append", kind="vjp_closure",
                                 closure=12),
                          Sow("s3", (14,), "append"))))))
        return Program(body=body, output=Output("scalar", (13,)), tree_input=True), 1529
    body = (  # law 7, reverse mode: a recomputing rule under the scope "grad"
        Sow("s0", (0,), "strict"),
        Jit(body=(Repeat(src=1, body=(Op("cos", 2), Op("cos", 3), Op("cos", 4),
                                      Sow("s1", (5,), "append")), times=2),
                  Scope(scope="grad", body=(
                      Custom(src=1, name="s0", mode="strict", kind="vjp_recompute",
                             closure=2),)),
                  Custom(src=0, name="grad", mode="strict", kind="vjp_closure"))),
        Sow("s3", (2,), "strict", stop_gradient=True),
        Sow("s4", (), "strict", const=(3,), seed=2),
        Cond(pred=5, operand=2, branches=(("tanh",), ("scale",), ("tanh",)), sites=(0,),
             names=("s5",), mode="clobber", sows=((0,), (), ()), pre=True))
    return Program(body=body, output=Output("tree", (1, 7))), 2115


# A recomputing rule's sites are told apart through the custom call's hook
# (jax >= 0.9; docs/compat.md).
needs_custom_call_hooks = pytest.mark.skipif(
    not _jax.CUSTOM_CALL_HOOKS, reason="a custom call's functions are hookable on jax >= 0.9")


@pytest.mark.parametrize("which", [
    "closure_in_scan",
    pytest.param("recompute_under_a_label_scope", marks=needs_custom_call_hooks)])
def test_regression_wide_search_programs(which):
    # (a wide search; docs/laws.md lists the fixes, and the reduced programs:
    # test_regression_plant_gradient_past_a_scan_of_a_rule_closing_over_an_array,
    # tests/test_recomputation.py's ..._keeps_its_nest_scope tests)
    p, seed = _wide_search_program(which)
    _check_law(5 if which == "closure_in_scan" else 7, p, p.example_args(seed), subset=48421)


def _second_wide_search():
    return {
    "law1_while_under_a_jvp_scope": (Program(body=(Repeat(src=2, body=(Op(fn='cos', src=3), Op(fn='cos', src=4), Op(fn='cos', src=5), Sow(name='s0', srcs=(6,), mode='append', const=None, seed=0, stop_gradient=False)), times=2, jit=False, dense=False), Op(fn='cos', src=3), Scope(scope='jvp', body=(While(src=4, ops=('sin',), trips=0, name='s0', kind='while', pre=False, inner='', inner_trips=0),))), output=Output(kind='scalar', srcs=(5,)), tree_input=True, tag='law'), 0),  # noqa: E501
    "law5_closure": (Program(body=(Scan(carry=2, xs=1, body=(Jit(body=(Op(fn='cos', src=4), Sow(name='s0', srcs=(5, 3), mode='append', const=None, seed=0, stop_gradient=False), Custom(src=1, name='s1', mode='append', kind='vjp_closure', closure=7))), Repeat(src=6, body=(Op(fn='cos', src=8), Sow(name='s2', srcs=(10,), mode='clobber', const=None, seed=0, stop_gradient=False)), times=2, jit=False, dense=False)), reverse=True, dense=False), While(src=3, ops=('sin', 'sin'), trips=1, name='grad', kind='scan', pre=False, inner='scan', inner_trips=1), Remat(body=(Cond(pred=1, operand=5, branches=(('sin',), ('shift',), ('softplus',)), sites=(0,), names=('jvp',), mode='strict', sows=(), pre=False, vmap=False),)), Scope(scope='jit', body=(Scan(carry=2, xs=0, body=(Custom(src=2, name='s0', mode='append', kind='vjp_recompute', closure=5), Red(fn='sum', src=4), Sow(name='s1', srcs=(10,), mode='append', const=None, seed=0, stop_gradient=False)), reverse=True, dense=False),))), output=Output(kind='scalar', srcs=(4, 5, 8)), tree_input=True, tag='law'), 0),  # noqa: E501
    "law7_reverse_backward_function": (Program(body=(Remat(body=(Remat(body=(Sow(name='s0', srcs=(), mode='strict', const=(), seed=0, stop_gradient=False),)),)),), output=Output(kind='scalar', srcs=(1,)), tree_input=False, tag='law'), 0),  # noqa: E501
    }


def _third_wide_search(which: str) -> Program:
    if which == "top_level_name_in_the_scope":
        first, xs, ops, trips = Sow("grad", (2,), "strict"), 1, ("sin",), 0
        scan = (Sow("s0", (5,), "append"), Sow("s1", (6,), "append"), Op("cos", 7))
    else:
        first, xs, ops, trips = Bin("add", 1, 1), 0, ("shift",), 2
        scan = (Sow("s0", (5,), "clobber"), Sow("s1", (5,), "clobber"), Op("square", 5))
    body = (first,
            Scope(scope="b0", body=(Scan(carry=3, xs=xs, body=scan, reverse=True),)),
            While(src=5, ops=ops, trips=trips, name="s1" if trips == 0 else "s0",
                  kind="scan", pre=False, inner="scan", inner_trips=1),
            Scope(scope="b1", body=(
                Custom(src=1, name="s0", mode="strict", kind="vjp_recompute", closure=6),
                Sow("s1", (2, 7), "strict"))))
    return Program(body=body, output=Output("scalar", (0, 9)), tree_input=True)


@needs_custom_call_hooks
@pytest.mark.parametrize("which", ["top_level_name_in_the_scope", "clobber_in_a_scan_before"])
def test_regression_third_wide_search_programs(which):
    # (a third wide law-5 search) The backward function of a recomputing
    # rule under an lh.nest scope, built before the harvest, ran outside the
    # scope: its recomputed site came out as the top-level "s0" (an extra
    # key), or met a clobber "s0" sown elsewhere. The reduced program:
    # tests/test_recomputation.py's test_regression_backward_function_of_a_scoped_rule_...
    p = _third_wide_search(which)
    _check_law(5, p, p.example_args(33001), subset=20985)


@pytest.mark.parametrize("which", ["law1_while_under_a_jvp_scope", "law5_closure",
                                   "law7_reverse_backward_function"])
def test_regression_second_wide_search_programs(which):
    # (the second wide search) law 5: a closed-over value, as above. law 1: a
    # while loop's value under a scope spelled "jvp" shares its key with a
    # tangent, so the linear function spells it ("primal", "jvp", "s0"),
    # which the checker did not read as the value's key. law 7: the split of
    # the inner of two checkpoints left its linear half with no linear input:
    # the backward function evaluated it forward, a zero value under the
    # site's plain key.
    p, seed = _second_wide_search()[which]
    _check_law(int(which[3]), p, p.example_args(seed), subset=0)


def _check_law(law: int, p, args, subset: int) -> None:
    """Law 1, 5 or 7 (reverse-mode keys included) on a random program."""
    if law == 1:
        T.check_linearize(p.fn, *args, tag=p.tag)
    elif law == 5:
        T.check_vjp(p.fn, *args, tag=p.tag, subset=subset)
    else:
        T.check_lazy(p.fn, *args, tag=p.tag, slices=p.slices, perturb=p.perturb,
                     forward=p.forward_differentiable)


@pytest.mark.parametrize("kind", ["cond", "switch"])
def test_regression_invariant_cond_holding_an_append_site_under_grad(kind):
    # A cond in a scan body whose operands do not change over the loop and
    # whose outputs nothing uses was hoisted out of the loop by JAX's partial
    # evaluation under jax.grad: the append site read zeros (found by a
    # non-derandomized search).
    def f(x, b):
        v = jnp.cos(b)
        s = lambda o: lh.sow(jnp.cos(o), tag="t", name="s", mode="append")  # noqa: E731

        def body(c, xi):
            if kind == "cond":
                lax.cond(jnp.sum(x) > 0, s, s, v)
            else:
                lax.switch(jnp.clip(jnp.sum(x).astype(int), 0, 2), [s] * 3, v)
            return 0.5 * c + jnp.tanh(jnp.cos(xi)), None
        return lax.scan(body, v, x)[0]
    rows = jnp.full(3, jnp.cos(jnp.cos(0.7)))
    np.testing.assert_allclose(lh.reap(jax.grad(f), tag="t")(XS, 0.7)["s"], rows, rtol=1e-6)
    np.testing.assert_allclose(lh.reap(jax.grad(f, argnums=1), tag="t")(XS, 0.7)["s"], rows,
                               rtol=1e-6)


@skip_where_jax_checkpoints_scan3_wrongly()
def test_regression_invariant_append_site_in_a_checkpointed_scan_under_grad():
    # jax.checkpoint's split of a scan hoists loop invariants its own way: the
    # append site was sown once (1 row) under jax.grad.
    def f(x, e=None):
        v = jnp.cos(x)

        def block(v):
            def body(c, i):
                s = lh.sow(jnp.cos(v), tag="t", name="s", mode="append")
                if e is not None:
                    s = s + e[i]
                return c * jnp.sum(s), None
            return lax.scan(body, v, jnp.arange(3))[0]
        return jnp.sum(jax.checkpoint(block)(v))
    d = lh.reap(jax.grad(f), tag="t")(XS)
    np.testing.assert_allclose(d["s"], jnp.broadcast_to(jnp.cos(jnp.cos(XS)), (3, 3)),
                               rtol=1e-6)
    np.testing.assert_allclose(d["vjp", "s"], jax.grad(lambda e: f(XS, e))(jnp.zeros((3, 3))),
                               rtol=1e-5)


@needs_derivative_sites
def test_regression_dead_checkpoint_in_a_jitted_layer_keeps_its_tangent_sites():
    # A jitted layer called twice whose second call nothing uses: DCE of the
    # linear function dropped the checkpointed block inside that call, with
    # its tangent site (1 row instead of 2 under jax.linearize).
    @jax.jit
    def layer(h):
        h = lh.sow(h, tag="t", name="a", mode="append")
        return jnp.cos(jax.checkpoint(
            lambda u: lh.sow(jnp.cos(u), tag="t", name="s", mode="append"))(h))

    def f(x):
        h1 = layer(x)
        layer(h1)
        return jnp.sum(h1)
    _, lin = jax.linearize(f, XS)
    t = jnp.ones(3)
    # plain JAX: s_1 = cos(x), s_2 = cos(cos(cos(x))), and their tangents
    s = lambda x: jnp.stack([jnp.cos(x), jnp.cos(jnp.cos(jnp.cos(x)))])  # noqa: E731
    np.testing.assert_allclose(lh.reap(lin, tag="t")(t)["s"], jax.jvp(s, (XS,), (t,))[1],
                               rtol=1e-5)


def test_regression_invariant_append_site_under_grad():
    # An append site in a scan whose value the scan does not change was
    # hoisted out of the loop by JAX's partial evaluation under jax.grad:
    # reaped with 1 row instead of one per iteration.
    def f(x):
        def body(c, xi):
            return c + lh.sow(jnp.sin(x), tag="t", name="k", mode="append") * xi, None
        return jnp.sum(lax.scan(body, jnp.zeros(3), XS)[0] ** 2)
    rows = jnp.broadcast_to(jnp.sin(XS), (3, 3))
    assert lh.reap(f, tag="t")(XS)["k"].shape == (3, 3)
    d = lh.reap(jax.grad(f), tag="t")(XS)
    np.testing.assert_allclose(d["k"], rows, rtol=1e-6)
    eps_grad = jax.grad(lambda e: jnp.sum(jnp.sum((rows + e) * XS[:, None], 0) ** 2))(
        jnp.zeros((3, 3)))
    np.testing.assert_allclose(d["vjp", "k"], eps_grad, rtol=1e-5)
    T.check_lazy(f, XS, tag="t", slices={"k": lambda x: jnp.broadcast_to(jnp.sin(x), (3, 3))},
                 perturb=lambda eps, x: jnp.sum(
                     jnp.sum((jnp.sin(x) + eps.get(("k",), 0.)) * XS[:, None], 0) ** 2))


# --- regressions: bugs these laws found, since fixed -----------------------------------

def test_regression_clobber_in_scan_plant_into_backward():
    # A cotangent planted into the backward function at a clobber site in a
    # scan was added in every iteration, not only at the reaped (highest-index)
    # occurrence: law 5(a) failed.
    def f(x):
        def body(c, xi):
            return lh.sow(c * xi, tag="t", name="c", mode="clobber"), None
        return lax.scan(body, 1., x)[0]
    T.check_vjp(f, jnp.array([2., 3., 4.]), tag="t")


def test_regression_jit_around_transform_around_jit():
    # lh.jit(T(lh.jit(f))) dropped the recorded transform T in between (no
    # ("grad", ...) keys; the out_axes of an lh.vmap there ignored).
    f = lambda x: jnp.sum(lh.sow(x ** 3, tag="t", name="x3"))  # noqa: E731
    for middle in (T.Transform("grad"), T.Transform("vmap", 0, -1)):
        stack = T.Stack((T.Transform("jit"), middle, T.Transform("jit")))
        x = jnp.array([1., 2.]) if middle.kind == "grad" else jnp.ones((2, 3))
        T.check_lazy(f, x, tag="t", slices={"x3": lambda x: x ** 3}, stack=stack)


def _planted_rule_programs():
    scoped = Scope(scope="b0", body=(Custom(4, "s0", "append", "vjp", 4),))
    with_clobber = (Custom(2, "s0", "append", "jvp", 4), Sow("s1", (5,), "clobber"))
    return {
        "custom_vjp_in_a_scan": Program(
            body=(Scan(carry=2, xs=1, body=(scoped,)),), output=Output("scalar", (4,)),
            tree_input=True),
        "custom_jvp_in_a_scan": Program(
            body=(Scan(carry=2, xs=1, body=with_clobber),), output=Output("scalar", (4,)),
            tree_input=True),
        "recomputing_rule": Program(
            body=(Op("cos", 0), Custom(1, "s0", "strict", "vjp_recompute", 1)),
            output=Output("scalar", (2,))),
    }


@pytest.mark.parametrize("which", [
    "custom_jvp_in_a_scan", "custom_vjp_in_a_scan",
    pytest.param("recomputing_rule", marks=needs_custom_call_hooks)])
def test_law6_differentiates_plants_under_custom_rules(which):
    # Programs law 6's planted check found: a gradient through a recomputing
    # rule where the planted program's is zero (issue item "plants under
    # custom rules", before its fix), and the oracle's planted rule in a
    # scan, which must take the planted outputs as an operand.
    p = _planted_rule_programs()[which]
    T.check_roundtrip(p.fn, *p.example_args(0), tag=p.tag, subset=0, planted=p.plant,
                      forward=p.forward_differentiable, reverse=p.reverse_differentiable)
