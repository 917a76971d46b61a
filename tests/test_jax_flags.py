"""JAX's opt-in next implementations (`jax_scan3`, `jax_remat3`,
`jax_custom_vjp3`, `jax_custom_jvp3`: all four from jax 0.11, three in 0.10)
stage their constructs as high-level primitives. Sites inside a `Scan3` are
harvested as those of the `scan` it stands for, inside a `RematTraced` as
those of the `jax.checkpoint` (`remat2`) it stands for; inside a
`CustomJVPTraced` or `CustomVJPTraced` (also staged with every flag off, for
`defvjp(..., generic_batching=True)`) through its expansion, the user's rule
kept (on jax < 0.12, where the object holds the function's closure, they are
refused: the harvest raises a `HarvestError` naming the flag instead of
leaving them unreaped). Sites outside the construct are reaped under every
flag (docs/compat.md)."""

import contextlib
import inspect
import io

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

import lazyharvest as lh
from helpers import close, jax_flag
from lazyharvest import _jax
from lazyharvest._interpreter import sub_jaxprs

FLAGS = ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")

# each flag where this JAX has it and stages a high-level primitive for it
FLAG_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(
    f not in _jax.HI_PRIM_FLAGS.values(), reason=f"jax {jax.__version__} has no {f}"))
    for f in FLAGS]
# (custom functions' sites are harvested on jax >= 0.12, refused before)
CUSTOM_FLAGS = [p for p in FLAG_PARAMS if p.values[0] in ("jax_custom_vjp3", "jax_custom_jvp3")
                and _jax.CUSTOM_HI_PRIMS]
HARVESTED_FLAGS = [p for p in FLAG_PARAMS if p.values[0] == "jax_remat3"] + CUSTOM_FLAGS


@pytest.fixture
def flag(request):
    with jax_flag(request.param):
        yield request.param


def _sow(x, name):
    return lh.sow(x, tag="t", name=name)


def _construct(flag_name):
    """The construct `flag_name` changes, around a site. Made after the flag is
    set: some JAX versions choose the implementation when it is made."""
    if flag_name == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(_sow(c, "inside")), None), x, None,
                                  length=2)[0]
    if flag_name == "jax_remat3":
        return jax.checkpoint(lambda x: jnp.sin(_sow(x, "inside")))
    if flag_name == "jax_custom_jvp3":
        cjvp = jax.custom_jvp(lambda x: jnp.sin(_sow(x, "inside")))
        cjvp.defjvp(lambda p, t: (cjvp(p[0]), jnp.cos(p[0]) * t[0]))
        return cjvp
    cvjp = jax.custom_vjp(lambda x: jnp.sin(_sow(x, "inside")))
    cvjp.defvjp(lambda x: (cvjp(x), x), lambda r, g: (jnp.cos(r) * g,))
    return cvjp


def _program(flag_name):
    inner = _construct(flag_name)
    return lambda x: inner(_sow(x * 2, "outside")) + 1


# the flags whose construct's sites are still refused on this JAX
REFUSED = [p for p in FLAG_PARAMS if p.values[0] in ("jax_custom_vjp3", "jax_custom_jvp3")
           and not _jax.CUSTOM_HI_PRIMS]


@pytest.mark.parametrize("flag", REFUSED, indirect=True)
def test_a_site_inside_the_construct_raises_naming_the_flag(flag):
    f = _program(flag)
    eqns = jax.make_jaxpr(f)(0.3).eqns
    assert _jax.call_hi_primitive_p in [e.primitive for e in eqns], eqns
    for g in (f, jax.jit(f), jax.grad(f)):
        if _stages_hi_prim(jax.make_jaxpr(g)(0.3).jaxpr):
            with pytest.raises(lh.HarvestError, match=flag):
                lh.reap(g, tag="t")(0.3)["outside"]
        else:  # JAX lowered the construct (jax 0.10's grad of remat3): plain sites
            d = lh.reap(g, tag="t")(0.3)
            close(d["outside"], 0.6)
            close(d["inside"], 0.6)
            close(d["vjp", "inside"], jnp.cos(0.6))
    with pytest.raises(lh.HarvestError, match=flag):
        lh.plant(f, tag="t")({"inside": 1.0}, 0.3)


@pytest.mark.parametrize("flag", HARVESTED_FLAGS, indirect=True)
def test_a_site_inside_the_construct_is_reaped_with_its_cotangent(flag):
    f = _program(flag)
    eqns = jax.make_jaxpr(f)(0.3).eqns
    assert _jax.call_hi_primitive_p in [e.primitive for e in eqns], eqns
    for g in (f, jax.jit(f)):
        d = lh.reap(g, tag="t")(0.3)
        close(d["outside"], 0.6)
        close(d["inside"], 0.6)
    for g in _differentiated(f, flag):
        d = lh.reap(g, tag="t")(0.3)
        assert set(d) == {"outside", "inside", ("vjp", "outside")} | (
            # (a custom function's own sites get none: JAX runs its rule)
            set() if flag in ("jax_custom_vjp3", "jax_custom_jvp3") else {("vjp", "inside")})
        close(d["outside"], 0.6)
        close(d["vjp", "outside"], jnp.cos(0.6))
        if ("vjp", "inside") in d:
            close(d["vjp", "inside"], jnp.cos(0.6))


@pytest.mark.parametrize("flag", FLAG_PARAMS, indirect=True)
def test_sites_outside_the_construct_are_reaped_under_the_flag(flag):
    construct = _no_site(flag)
    eqns = jax.make_jaxpr(construct)(0.3).eqns
    assert _jax.call_hi_primitive_p in [e.primitive for e in eqns], eqns

    def f(x):
        return jnp.cos(_sow(construct(_sow(x * 2, "before")), "after"))
    y = _no_site_plain(flag)(0.6)
    d = lh.reap(f, tag="t")(0.3)
    close(d["before"], 0.6)
    close(d["after"], y)
    close(lh.plant(f, tag="t")({"after": 2.0}, 0.3), jnp.cos(2.0))
    for grad_f in _differentiated(f, flag):
        g = lh.reap(grad_f, tag="t")(0.3)
        close(g["vjp", "after"], -jnp.sin(y))
        close(g["vjp", "before"], jax.grad(lambda v: jnp.cos(_no_site_plain(flag)(v)))(0.6))


def _stages_hi_prim(jaxpr):
    """Whether a high-level primitive is staged in `jaxpr`, at any depth."""
    return bool(_hi_prims(jaxpr))


def _hi_prims(jaxpr):
    """The high-level primitive objects staged in `jaxpr`, at any depth."""
    return [p for e in jaxpr.eqns
            for p in ([e.params["_prim"]] if e.primitive is _jax.call_hi_primitive_p else [])
            + [q for j in sub_jaxprs(e.params) for q in _hi_prims(j)]]


def _differentiated(f, flag_name):
    """`(jax.grad(f),)`, or none where JAX 0.12 itself cannot differentiate
    the construct (Scan3 has no reverse-mode rule there)."""
    return () if flag_name == "jax_scan3" else (jax.grad(f),)


def _no_site_plain(flag_name):
    """What `_no_site(flag_name)` computes, written with plain JAX."""
    if flag_name == "jax_scan3":
        return lambda x: jnp.sin(jnp.sin(x))
    return jnp.sin


def _no_site(flag_name):
    """The construct of `flag_name` around `sin`, without sites."""
    if flag_name == "jax_scan3":
        return lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
    if flag_name == "jax_remat3":
        return jax.checkpoint(jnp.sin)
    custom = jax.custom_jvp(jnp.sin) if flag_name == "jax_custom_jvp3" else jax.custom_vjp(jnp.sin)
    if flag_name == "jax_custom_jvp3":
        custom.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    else:
        custom.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (jnp.cos(r) * g,))
    return custom


# --- sites inside a Scan3 (jax_scan3) -----------------------------------------------
# Each expected value comes from plain JAX: the same loop written without
# sites, returning the sown values as outputs (the flag on, where JAX computes
# it right; `reverse` with the flag off, where it does).

SCAN3 = [p for p in FLAG_PARAMS if p.values[0] == "jax_scan3"]
XS = jnp.array([0.5, -1.0, 2.0])


def _cell(c, a, sow=True):
    h = jnp.tanh(c * a + 0.3)
    y = jnp.sin(h) * a
    if sow:
        h = lh.sow(h, tag="t", name="h", mode="clobber")
        y = lh.sow(y, tag="t", name="y", mode="append")
    return h, y


def _scanned(x, xs=XS, reverse=False):
    return lax.scan(_cell, x, xs, reverse=reverse)


def _plain(x, xs=XS, reverse=False):
    """(carry, ys, the h of each step) without sites."""
    def cell(c, a):
        h, y = _cell(c, a, sow=False)
        return h, (y, h)
    carry, (ys, hs) = lax.scan(cell, x, xs, reverse=reverse)
    return carry, ys, hs


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_sites_inside_a_scan3_are_reaped_with_their_tangents(flag):
    assert any(isinstance(e.params.get("_prim"), _jax.SCAN3)
               for e in jax.make_jaxpr(_scanned)(0.2).eqns)
    carry, ys, hs = _plain(0.2)
    for f in (_scanned, jax.jit(_scanned)):
        out, d = lh.call_and_reap(f, tag="t")(0.2)
        close(out, (carry, ys))
        assert set(d) == {"h", "y"}
        close(d["y"], ys)
        close(d["h"], hs[-1])  # the last iteration's
    t = lh.reap(lambda x: jax.jvp(_scanned, (x,), (1.0,)), tag="t")(0.2)
    _, (dys, dhs) = jax.jvp(lambda x: _plain(x)[1:], (0.2,), (1.0,))
    close(t["jvp", "y"], dys)
    close(t["jvp", "h"], dhs[-1])


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_plants_inside_a_scan3(flag):
    rows = jnp.array([1.0, 2.0, 3.0])
    planted = lh.plant(_scanned, tag="t")({"y": rows}, 0.2)
    close(planted, (_plain(0.2)[0], rows))
    # a clobber plant replaces h at every step: each step after the first
    # starts from the plant (y is computed before h is sown)
    out = lh.plant(_scanned, tag="t")({"h": 0.7}, 0.2)
    c = jnp.array([0.2, 0.7, 0.7])
    close(out, (0.7, jnp.sin(jnp.tanh(c * XS + 0.3)) * XS))


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_a_reverse_scan3_is_harvested_as_lax_scan_defines_it(flag):
    # JAX 0.12's Scan3 ignores `reverse` (docs/compat.md); the harvested
    # program runs the scan it stands for, which does not
    jax.config.update(flag, False)
    carry, ys, hs = _plain(0.2, reverse=True)
    jax.config.update(flag, True)
    out, d = lh.call_and_reap(lambda x: _scanned(x, reverse=True), tag="t")(0.2)
    close(out, (carry, ys))
    close(d["y"], ys)
    close(d["h"], hs[-1])  # (a scan's program order is by index, reverse or not: SPEC 3)


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_append_sites_of_nested_scan3s_come_in_program_order(flag):
    def f(x):
        def outer(c, a):
            c, _ = lax.scan(lambda c, b: _cell(c, a * b), c, XS)
            return c, None
        return lax.scan(outer, x, XS)[0]

    def plain(x):
        def outer(c, a):
            c, (ys, _) = lax.scan(lambda c, b: (lambda h, y: (h, (y, h)))(
                *_cell(c, a * b, sow=False)), c, XS)
            return c, ys
        return lax.scan(outer, x, XS)
    carry, ys = plain(0.2)
    out, d = lh.call_and_reap(f, tag="t")(0.2)
    close(out, carry)
    close(d["y"], ys.reshape(-1))
    close(d["h"], carry)


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_a_scan3_whose_sites_the_harvest_leaves_out_is_bound_as_it_is(flag):
    g = lambda x: _scanned(lh.sow(x, tag="t", name="x0"))  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda x: lh.call_and_reap(g, tag="t", allowlist=["x0"])(x)[0])
    assert any(isinstance(p, _jax.SCAN3) for p in _hi_prims(jaxpr(0.2).jaxpr))
    jaxpr = jax.make_jaxpr(lambda x: lh.call_and_reap(_scanned, tag="t")(x)[0])
    assert not _stages_hi_prim(jaxpr(0.2).jaxpr)  # (the scan it stands for instead)


def _computed(out_and_d):
    out, d = out_and_d
    return out, d.compute()


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
def test_a_custom_function_holding_a_scan3_with_sites_runs_reaped_and_planted(flag, rule):
    # JAX lowers the function (whose carry Refs JAX makes around its Scan3)
    # by inlining the call while the Scan3 is there; harvested as the scan it
    # stands for, the Refs stayed in the custom call, and lowering failed
    # ("No state discharge rule implemented for primitive: custom_jvp_call")
    def make():
        def fn(x):
            return _scanned(x)[0]
        f = getattr(jax, rule)(fn)
        if rule == "custom_jvp":
            f.defjvp(lambda p, t: (f(p[0]), 2.0 * t[0]))
        else:
            f.defvjp(lambda x: (f(x), None), lambda _, g: (2.0 * g,))
        return f

    f = make()
    # (the reference is the scan run eagerly, not a custom function without
    # sites: with jax_custom_jvp3 on, JAX's own custom_jvp of a carry-only
    # scan drops it, returning the initial carry; jax_jits_scan3_wrongly)
    carry, ys, hs = _plain(0.2)
    for run in (lambda g: g, jax.jit):
        out, d = run(lambda x: _computed(lh.call_and_reap(f, tag="t")(x)))(0.2)
        close(out, carry)
        close(d["y"], ys)
        close(d["h"], hs[-1])
        rows = jnp.array([1.0, 2.0, 3.0])
        close(run(lh.plant(f, tag="t"))({"y": rows}, 0.2), carry)  # (y is no carry)
        close(run(lh.plant(f, tag="t"))({"h": 0.7}, 0.2), 0.7)  # (the last step's h)
        # (the user's rule, in force for the inputs; the plant a constant)
        close(run(jax.grad(lh.plant(f, tag="t"), argnums=1))({"h": 0.7}, 0.2), 2.0)


WS = jnp.array([0.5, 1.1, -0.8, 1.3])


def _layer(w, c):
    return lh.sow(jnp.sin(w * c), tag="t", name="h", mode="append")


def _rule_recomputing_a_scan():
    """A scan over layers whose backward rule recomputes each layer under
    `jax.vjp`, in a reverse scan of its own (which a harvest runs in
    reverse, as lax.scan defines it, though JAX 0.12's Scan3 ignores it)."""
    @jax.custom_vjp
    def run(ws, c0):
        return lax.scan(lambda c, w: (_layer(w, c), None), c0, ws)[0]

    def fwd(ws, c0):
        last, cs = lax.scan(lambda c, w: (_layer(w, c), c), c0, ws)
        return last, (ws, cs)

    def bwd(res, g):
        ws, cs = res

        def step(gc, wc):
            gw, gc = jax.vjp(_layer, *wc)[1](gc)
            return gc, gw
        gc, gws = lax.scan(step, g, (ws, cs), reverse=True)
        return gws, gc
    run.defvjp(fwd, bwd)
    return lambda ws: jnp.sum(run(ws, 0.7) ** 2)


@pytest.mark.parametrize("flag", SCAN3, indirect=True)
def test_a_rule_recomputing_inside_a_scan3_adds_no_occurrence(flag):
    # The backward rule's sows are marked as recomputations in every body it
    # runs, a Scan3's too (rebuilt with its body rewritten). Was: the Scan3's
    # were not, and its values came back as a key ("primal", "h").
    def plain(ws, eps):  # the loop written out, eps added at each occurrence
        c, out = 0.7, []
        for i in range(len(ws)):
            c = jnp.sin(ws[i] * c) + eps[i]
            out.append(c)
        return jnp.sum(c ** 2), jnp.stack(out)
    d = lh.reap(jax.grad(_rule_recomputing_a_scan()), tag="t")(WS)
    assert set(d.keys()) == {"h", ("vjp", "h")}
    close(d["h"], plain(WS, jnp.zeros(4))[1])
    close(d["vjp", "h"], jax.grad(lambda e: plain(WS, e)[0])(jnp.zeros(4)))


# --- sites inside a custom function staged as a high-level primitive -----------------
# The rule below (3 g) is not the function's derivative, so a gradient that
# used the function instead of the rule would show. Expected values: the same
# custom function without sites, or written with the plant in place.

def _custom_program(flag_name, generic_batching=False, inner=None, remat=False):
    """cos(f(x)) for a custom function f (sin(2 x) with the rule 3 g), with a
    site on x (`out`) and one inside f (`in`); `inner` replaces the inside.
    `remat`: the custom_vjp's rule given as remat rules (`defremat`)."""
    body = inner or (lambda x: jnp.sin(_sow(x * 2, "in")))
    if flag_name == "jax_custom_jvp3":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda p, t: (fn(p[0]), 3.0 * t[0]))
    elif remat:
        fn = jax.custom_vjp(body)
        # (`rem` recomputes f: with a copy of f without its site, or, with
        # remat="calls", by calling f, whose site it then sows again, a
        # recomputation)
        plain = fn if remat == "calls" else inner or (lambda x: jnp.sin(x * 2))
        fn.defremat(lambda x: (fn(x), x), lambda x, x_again: (plain(x_again), x_again),
                    lambda x, g: (3.0 * g,), generic_batching=True)
    else:
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (fn(x), x), lambda x, g: (3.0 * g,),
                  **({"generic_batching": True} if generic_batching else {}))
    return lambda x: jnp.cos(fn(_sow(x, "out")))


def _check_rule_gradient(prog, x):
    """`jax.grad` of `_custom_program`'s program inside a harvest: the rule's
    gradient, the function's site reaped, no cotangent key for it."""
    grad, d = lh.call_and_reap(jax.grad(prog), tag="t")(x)
    close(grad, -jnp.sin(jnp.sin(2 * x)) * 3.0)  # the rule's, not the function's
    assert set(d) == {"out", "in", ("vjp", "out")}
    close(d["in"], 2 * x)
    close(d["vjp", "out"], -jnp.sin(jnp.sin(2 * x)) * 3.0)


def _check_custom_program(flag_name, generic_batching=False, remat=False):
    prog = _custom_program(flag_name, generic_batching, remat=remat)
    assert _stages_hi_prim(jax.make_jaxpr(prog)(0.3).jaxpr)
    x = 0.3
    _check_rule_gradient(prog, x)
    t = lh.reap(lambda x: jax.jvp(prog, (x,), (1.0,)), tag="t")(x)
    close(t["jvp", "out"], 1.0)
    close(t["in"], 2 * x)
    # planted: the rule still differentiates the planted function (SPEC 9)
    planted = lambda x: lh.plant(prog, tag="t")({"in": 1.0}, x)  # noqa: E731
    by_hand = _custom_program(flag_name, generic_batching, inner=lambda x: jnp.sin(1.0 + 0 * x),
                              remat=remat)
    close(planted(x), by_hand(x))
    close(jax.grad(planted)(x), jax.grad(by_hand)(x))
    close(jax.grad(planted)(x), -jnp.sin(jnp.sin(1.0)) * 3.0)
    v = lh.reap(jax.vmap(prog), tag="t")(jnp.array([0.1, 0.2]))
    close(v["in"], jnp.array([0.2, 0.4]))


@pytest.mark.skipif(
    not _jax.CUSTOM_HI_PRIMS
    or "generic_batching" not in inspect.signature(jax.custom_vjp.defvjp).parameters,
    reason=f"jax {jax.__version__} has no generic_batching, or its sites are refused")
@pytest.mark.usefixtures("default_staging")
def test_a_custom_vjp_with_generic_batching_harvests_with_every_flag_off():
    # (jax >= 0.10 stages it as a CustomVJPTraced with every flag off)
    _check_custom_program("jax_custom_vjp3", generic_batching=True)


@pytest.mark.parametrize("flag", CUSTOM_FLAGS, indirect=True)
def test_sites_inside_a_custom_function_under_its_flag(flag):
    _check_custom_program(flag)


# --- sites inside a RematTraced (jax_remat3) ----------------------------------------
# Harvested as the jax.checkpoint (remat2) each stands for. Values against
# plain JAX: the same function written without sites, or the derivative of
# the sown value's own expression.

REMAT3 = [p for p in FLAG_PARAMS if p.values[0] == "jax_remat3"]


def _checkpointed_layers(policy, sow=True):
    def layer(c, w):
        h = jnp.sin(c @ w)
        if sow:
            h = lh.sow(h, tag="t", name="h", mode="append")
        return jnp.tanh(h) * 2, h

    def f(ws, x):
        y, hs = jax.checkpoint(lambda x: lax.scan(layer, x, ws), policy=policy)(x)
        return jnp.sum(y ** 2)
    return f


@pytest.mark.parametrize("flag", REMAT3, indirect=True)
@pytest.mark.parametrize("policy", [jax.checkpoint_policies.everything_saveable,
                                    jax.checkpoint_policies.nothing_saveable],
                         ids=["everything", "nothing"])
def test_sites_inside_a_remat_traced_are_reaped_differentiated_and_planted(flag, policy):
    ws, x = jnp.full((4, 3, 3), 0.3), jnp.linspace(0.1, 0.5, 3)
    f = _checkpointed_layers(policy)
    assert any(isinstance(p, _jax.REMAT_TRACED) for p in _hi_prims(jax.make_jaxpr(f)(ws, x).jaxpr))

    def plain(ws, x, e):  # the sown rows perturbed by e, without sites
        def layer(c, we):
            w, ei = we
            h = jnp.sin(c @ w) + ei
            return jnp.tanh(h) * 2, h
        y, hs = lax.scan(layer, x, (ws, e))
        return jnp.sum(y ** 2), hs
    e0 = jnp.zeros((4, 3))
    d = lh.reap(jax.grad(f), tag="t")(ws, x)
    close(d["h"], plain(ws, x, e0)[1])
    close(d["vjp", "h"], jax.grad(lambda e: plain(ws, x, e)[0])(e0))
    t = lh.reap(lambda ws, x: jax.jvp(lambda x: f(ws, x), (x,), (jnp.ones(3),)), tag="t")(ws, x)
    close(t["jvp", "h"], jax.jvp(lambda x: plain(ws, x, e0)[1], (x,), (jnp.ones(3),))[1])
    patch = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)  # each row replaces that layer's h
    close(lh.plant(f, tag="t")({"h": patch}, ws, x), jnp.sum((jnp.tanh(patch[-1]) * 2) ** 2))
    # the rematerialized copy JAX's differentiation runs adds no occurrence
    assert set(d) == {"h", ("vjp", "h")}


@pytest.mark.parametrize("flag", REMAT3, indirect=True)
@pytest.mark.parametrize("policy", [jax.checkpoint_policies.everything_saveable,
                                    jax.checkpoint_policies.save_anything_except_these_names()],
                         ids=["everything", "except_names"])
def test_a_remat_traced_holding_sites_saves_what_jax_checkpoint_saves_with_the_flag_off(
        flag, policy):
    # Harvested or not, differentiated, it is the remat2 it stands for
    # (docs/semantics.md, 10d): what the flag-off program saves, which on jax
    # 0.12.1 is more than a RematTraced without sites saves for these policies
    # (JAX's two implementations differ there; not on 0.11.2 for the first).
    ws, x = jnp.full((8, 3, 3), 0.3), jnp.ones(3)
    f = _checkpointed_layers(policy)

    def harvested(ws, x):
        return lh.call_and_reap(f, tag="t")(ws, x)[0]

    def saved(fn):  # the residuals' avals ("f32[8,3] from ..." -> "f32[8,3]")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(fn, ws, x)
        return sorted(line.split()[0] for line in buf.getvalue().splitlines() if line.strip())
    try:
        saved(jax.jit(_checkpointed_layers(policy, sow=False)))
    except NotImplementedError as e:  # (with jax_scan3 on too)
        pytest.skip(f"jax {jax.__version__} cannot differentiate this program without "
                    f"sites with these flags on: {e}")
    with jax_flag(flag, False):
        want = saved(jax.jit(_checkpointed_layers(policy, sow=False)))
    assert saved(jax.jit(harvested)) == want
    assert saved(jax.jit(f)) == want


@pytest.mark.parametrize("flag", REMAT3, indirect=True)
def test_the_results_jax_remat3_left_wrong_are_right(flag):
    # Before: a linear function of a checkpointed zero-trip while read zeros
    # for the value sown before the loop, and a dead site in a checkpoint
    # linearized outside the harvest had no key (docs/compat.md).
    def zero_trip(x):
        a = lh.sow(jnp.sin(x), tag="t", name="k", mode="clobber")
        body = lambda c: (c[0] + 1, lh.sow(jnp.cos(c[1]), tag="t", name="k",  # noqa: E731
                                            mode="clobber"))
        return a + lax.while_loop(lambda c: c[0] < 0, body, (0, x))[1]
    _, lin = jax.linearize(jax.checkpoint(zero_trip), 0.7)
    d = lh.reap(lin, tag="t")(1.5)
    close(d["k"], jnp.sin(0.7))
    close(d["jvp", "k"], jnp.cos(0.7) * 1.5)

    def dead(x):
        lh.sow(x ** 2, tag="t", name="y")
        return x + 1
    h = jax.checkpoint(dead)
    close(lh.reap(jax.linearize(h, 3.)[1], tag="t")(0.5)["y"], 3.)
    close(lh.reap(jax.vjp(h, 3.)[1], tag="t")(1.)["y"], 0.)


@pytest.mark.skipif(
    not _jax.CUSTOM_HI_PRIMS or not hasattr(jax.custom_vjp, "defremat"),
    reason=f"jax {jax.__version__} has no custom_vjp.defremat, or its sites are refused")
@pytest.mark.usefixtures("default_staging")
@pytest.mark.parametrize("rem", ["copy", "calls"])
def test_a_custom_vjp_with_remat_rules_harvests_with_every_flag_off(rem):
    # (defremat with generic_batching stages a CustomVJPTraced with every flag
    # off). Was, for a `rem` that calls the function: "site 'in': sown twice"
    _check_custom_program("jax_custom_vjp3", remat=rem)


@pytest.mark.skipif(
    not _jax.CUSTOM_HI_PRIMS or not hasattr(jax.custom_vjp, "defremat"),
    reason=f"jax {jax.__version__} has no custom_vjp.defremat, or its sites are refused")
@pytest.mark.parametrize("flag", REMAT3, indirect=True)
@pytest.mark.parametrize("rem", ["copy", "calls"])
def test_a_custom_vjp_with_remat_rules_in_a_checkpoint_under_jax_remat3(flag, rem):
    # Reverse mode under jax.checkpoint is where JAX runs the remat rules.
    prog = jax.checkpoint(_custom_program("jax_custom_vjp3", remat=rem))
    x = 0.3
    _check_rule_gradient(prog, x)
    planted = jax.grad(lambda x: lh.plant(prog, tag="t")({"in": 1.0}, x))(x)
    close(planted, -jnp.sin(jnp.sin(1.0)) * 3.0)
