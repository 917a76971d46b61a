"""Programs that use mutable array references (`jax.new_ref`, `ref[...] = v`),
as Flax NNX does: values, cotangents and plants against plain JAX.

Each expected value is computed with JAX alone: the same program with a zero
perturbation argument added at the site (or the site's downstream function
differentiated directly) for cotangents, and written with the planted value in
place of the site for plants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

pytestmark = pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="no jax.new_ref")

X = 0.7


def counter(x, eps=0.0, planted=None):
    """A state ref written, read through a site, and written again."""
    r = jax.new_ref(jnp.zeros(()))
    r[...] = x * 2
    y = r[...] ** 2
    y = lh.sow(y, tag="t", name="y") if planted is None else planted
    r[...] = y + eps + 1
    return jnp.sin(r[...]) * x


def test_value_tangent_cotangent_and_plant_through_a_ref():
    close(lh.reap(counter, tag="t")(X)["y"], (2 * X) ** 2)
    close(lh.reap(jax.jit(counter), tag="t")(X)["y"], (2 * X) ** 2)
    # cotangent: d out / d y for out = sin(y + 1) * x, with plain JAX (no ref:
    # jax 0.10 cannot differentiate a perturbation written into a local ref)
    expected = jax.grad(lambda y: jnp.sin(y + 1) * X)((2 * X) ** 2)
    close(lh.reap(jax.grad(counter), tag="t")(X)["vjp", "y"], expected)
    close(lh.reap(jax.jit(jax.grad(counter)), tag="t")(X)["vjp", "y"], expected)
    # tangent: the site's own
    d = lh.reap(lambda x: jax.jvp(counter, (x,), (1.0,)), tag="t")(X)
    close(d["jvp", "y"], jax.jvp(lambda x: (2 * x) ** 2, (X,), (1.0,))[1])
    # plant: the program with 3.0 in place of the site, and its gradient
    close(lh.plant(counter, tag="t")({"y": 3.0}, X), counter(X, planted=3.0))


def _jax_differentiates_constant_ref_writes() -> bool:
    try:
        jax.grad(lambda x: counter(x, planted=3.0))(X)
    except AttributeError:  # (jax 0.10: "DynamicJaxprTracer has no attribute accum")
        return False
    except NotImplementedError:  # (jax_scan3 on: jax 0.12 cannot differentiate a Scan3)
        return False
    return True


@pytest.mark.skipif(not _jax_differentiates_constant_ref_writes(),
                    reason=f"jax {jax.__version__} itself cannot differentiate a program "
                           f"writing a constant into a local ref")
def test_gradient_of_a_planted_ref_program():
    close(jax.grad(lambda x: lh.plant(counter, tag="t")({"y": 3.0}, x))(X),
          jax.grad(lambda x: counter(x, planted=3.0))(X))


def accumulate(xs, eps=None, planted=None):
    """A ref carried through a scan as its accumulator; one site per step."""
    acc = jax.new_ref(jnp.zeros(()))

    def body(_, i):
        h = jnp.tanh(xs[i] + acc[...])
        if planted is not None:
            h = planted[i]
        else:
            h = lh.sow(h, tag="t", name="h", mode="append")
        if eps is not None:
            h = h + eps[i]
        acc[...] = acc[...] + h
        return None, None

    lax.scan(body, None, jnp.arange(xs.shape[0]))
    return acc[...] ** 2


XS = jnp.array([0.3, -0.5, 0.8])


def _rows_by_hand(xs):
    acc, rows = 0.0, []
    for x in np.asarray(xs):
        h = np.tanh(x + acc)
        rows.append(h)
        acc += h
    return np.array(rows)


def test_append_site_in_a_scan_over_a_ref():
    close(lh.reap(accumulate, tag="t")(XS)["h"], _rows_by_hand(XS))
    expected = jax.grad(lambda e: accumulate(XS, eps=e))(jnp.zeros(3))
    d = lh.reap(jax.grad(accumulate), tag="t")(XS)
    close(d["h"], _rows_by_hand(XS))
    close(d["vjp", "h"], expected)
    planted = jnp.array([1.0, 2.0, -1.0])
    close(lh.plant(accumulate, tag="t")({"h": planted}, XS), accumulate(XS, planted=planted))
    close(jax.grad(lambda xs: lh.plant(accumulate, tag="t")({"h": planted}, xs))(XS),
          jax.grad(lambda xs: accumulate(xs, planted=planted))(XS))


def test_cotangent_planted_into_the_backward_pass_of_a_ref_program():
    """A cotangent planted at a site adds to the cotangent flowing there: the
    gradient of the program plus `ct` times the site's value."""
    ct = 0.25
    expected = jax.grad(lambda x: counter(x) + ct * (2 * x) ** 2)(X)
    close(lh.plant(jax.grad(counter), tag="t")({("vjp", "y"): ct}, X), expected)


# --- a jitted cell taking a float Ref and an integer Ref (issue 33) --------------------
# Outside a harvest `sow` is the identity: jax.grad of the program with a sow
# in the cell is jax.grad of the program without it (the integer Ref's float0
# tangent Ref once reached JAX's transpose, which cannot make its
# accumulator: "'TypedNdArray' object has no attribute 'committed'").

CELL_KINDS = ["scan", "unrolled", "gated", "checkpointed", "nested"]


def _append(h):
    return lh.sow(h, tag="t", name="h", mode="append")


def _count(c):
    return lh.sow(c, tag="t", name="steps", mode="append")


def cell_program(kind, site=lambda h: h, count=lambda c: c):
    """`program(xs, eps) -> (loss, values at the site)`: a jitted cell reading
    and writing a float sum Ref and counting its calls in an int32 Ref,
    called in a `lax.scan` (or a Python loop: "unrolled"); `site` marks the
    value, `eps` perturbs it (one column per occurrence in a call), `count`
    marks the count read from the Ref (an integer site)."""
    @jax.jit
    def cell(x, w, e, total, steps):
        if kind == "nested":  # two occurrences per call, in a scan of its own
            def inner(_, ej):
                v = jnp.tanh(x + total[...])
                h = site(v) + ej
                total[...] = total[...] + h
                steps[...] = count(steps[...]) + 1
                return None, (h, v)
            _, (hs, vs) = lax.scan(inner, None, e)
            return jnp.sum(hs), vs
        v = jnp.tanh(x + total[...])
        if kind == "checkpointed":
            h = jax.checkpoint(lambda x, t: site(jnp.tanh(x + t)))(x, total[...])
        else:
            h = site(v)
        h = h + e[0]
        if kind == "gated":  # `w` reaches the output without a tangent
            h = h * (w > 0)
        total[...] = total[...] + h
        steps[...] = count(steps[...]) + 1
        return h, v[None]

    def program(xs, eps):
        total = jax.new_ref(jnp.zeros(()))
        steps = jax.new_ref(jnp.zeros((), jnp.int32))
        if kind == "unrolled":
            outs = [cell(xs[i], xs[i] - 0.15, eps[i], total, steps) for i in range(len(xs))]
            hs, vs = jnp.stack([h for h, _ in outs]), jnp.stack([v for _, v in outs])
        else:
            _, (hs, vs) = lax.scan(lambda c, a: (c, cell(a[0], a[0] - 0.15, a[1], total, steps)),
                                   None, (xs, eps))
        return total[...] ** 2 + jnp.sum(hs) + steps[...].astype(jnp.float32) / 10, vs.reshape(-1)
    return program


CELL_XS = jnp.array([0.1, 0.2, 0.3])


def _per_call(kind):
    return 2 if kind == "nested" else 1


def _zeros(kind):
    return jnp.zeros((3, _per_call(kind)))


def _loss(program, kind):
    return lambda xs: program(xs, _zeros(kind))[0]


def _jax_differentiates_the_cell_program() -> bool:
    try:
        jax.grad(_loss(cell_program("scan"), "scan"))(CELL_XS)
    except AttributeError:  # (jax 0.10: "DynamicJaxprTracer has no attribute accum")
        return False
    except NotImplementedError:  # (jax_scan3 on: jax 0.12 cannot differentiate a Scan3)
        return False
    return True


needs_jax_ref_grads = pytest.mark.skipif(
    not _jax_differentiates_the_cell_program(),
    reason=f"jax {jax.__version__} itself cannot differentiate a Ref passed to a jitted "
           f"function in a scan")


@needs_jax_ref_grads
@pytest.mark.parametrize("kind", CELL_KINDS)
def test_a_sow_in_a_cell_with_an_integer_ref_changes_no_plain_gradient(kind):
    for site, count in ((_append, lambda c: c), (lambda h: h, _count), (_append, _count)):
        sown = _loss(cell_program(kind, site, count), kind)
        plain = _loss(cell_program(kind), kind)
        expected = jax.grad(plain)(CELL_XS)
        close(jax.grad(sown)(CELL_XS), expected)
        close(jax.jit(jax.grad(sown))(CELL_XS), expected)
        close(jax.value_and_grad(sown)(CELL_XS), jax.value_and_grad(plain)(CELL_XS))


@needs_jax_ref_grads
@pytest.mark.parametrize("kind", CELL_KINDS)
def test_a_cell_with_an_integer_ref_reaps_values_and_cotangents_under_grad(kind):
    plain, sown = cell_program(kind), _loss(cell_program(kind, _append, _count), kind)
    d = lh.reap(jax.grad(sown), tag="t")(CELL_XS)
    close(d["h"], plain(CELL_XS, _zeros(kind))[1])
    # the count, an integer site, has no derivative key (docs/semantics.md, 2b)
    close(d["steps"], jnp.arange(3 * _per_call(kind)))
    assert set(d) == {"h", "steps", ("vjp", "h")}, d
    # zero-perturbation: d loss / d eps at eps = 0, occurrence by occurrence
    close(d["vjp", "h"], jax.grad(lambda e: plain(CELL_XS, e)[0])(_zeros(kind)).reshape(-1))
    # forward mode (jitted: jax 0.12 cannot jvp these Refs eagerly, sow or not)
    t = jnp.ones(3)
    d = lh.reap(jax.jit(lambda x: jax.jvp(sown, (x,), (t,))[1]), tag="t")(CELL_XS)
    assert set(d) == {"h", "steps", ("jvp", "h")}, d
    close(d["jvp", "h"], jax.jit(lambda x: jax.jvp(
        lambda x: plain(x, _zeros(kind))[1], (x,), (t,))[1])(CELL_XS))


def test_a_cotangent_plant_owed_in_a_scan_writing_a_ref_writes_it_once():
    # A cotangent planted at a clobber site that a forward scan may not sow
    # (the backward pass of a reverse scan, here one accumulating into a
    # Ref): a first pass finds the highest iteration that sows it. Was: that
    # pass wrote the program's Refs too, so the real pass started from the
    # cotangent the first left there (every gradient scaled by 0.5 ** 3).
    def f(xs):
        r = jax.new_ref(jnp.float32(0.1))

        def body(_, xi):
            v = lax.cond(xi > 0.5, lambda o: lh.sow(jnp.cos(o), tag="t", name="s",
                                                    mode="clobber"), jnp.sin, xi)
            r[...] = 0.5 * r[...] + v
            return None, None
        lax.scan(body, None, xs, reverse=True)
        return r[...]

    xs = jnp.array([0.9, 0.7, 0.2])
    got = lh.plant(jax.vjp(f, xs)[1], tag="t")({"s": 2.}, jnp.float32(1.))[0]
    # plain JAX: 2. added to the cotangent of the reaped occurrence of "s"
    # (iteration 1, the highest that sows it)
    want = jax.vjp(lambda xs: (f(xs), jnp.cos(xs[1])), xs)[1](
        (jnp.float32(1.), jnp.float32(2.)))[0]
    close(got, want)
