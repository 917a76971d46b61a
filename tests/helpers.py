"""Small shared helpers for the tests."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import find, settings

import lazyharvest as lh
from lazyharvest import testing as T


def load_module(tmp_path, name, source):
    """A module written to `tmp_path/name.py` and imported: (module, its path)."""
    import importlib.util
    import sys

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, str(path)


@contextlib.contextmanager
def jax_flag(name: str, value: bool = True):
    """JAX's config option `name` set to `value` inside, as it was after (a
    run with JAX_SCAN3=true and the like keeps its flag on for later tests)."""
    before = jax.config.values[name]
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _scan_of_a_carry(x):
    """The probes' scan: its carry (c -> c * p + 1 over 0, 1, 2) its only
    output; 5.0 from 1.0."""
    return jax.lax.scan(lambda c, p: (c * p + 1.0, None), x, jnp.arange(3.0))[0]


def jax_jits_scan3_wrongly() -> bool:
    """Whether this JAX, with `jax_scan3` on, computes a scan wrongly where
    its DCE meets it (jax 0.12.1: `jax.jit` of a scan whose carry is its only
    output returns the initial carry, and the eager paths that jit, e.g. a
    `lax.cond` or `lax.custom_root` run eagerly, with it; lazyharvest keeps
    such a scan in the programs it compiles only, docs/compat.md)."""
    if not jax.config.values.get("jax_scan3"):
        return False
    return float(jax.jit(_scan_of_a_carry)(1.0)) != 5.0


def jax_dce_keeping_scans():
    """For a test module whose plain-JAX references (the laws' oracles, run
    under `jax.jit`) meet scans: where JAX's DCE drops a scan that only
    writes its carry (`jax_jits_scan3_wrongly`), they run with the rule the
    harvest keeps for its own programs (`_jax.ref_writing_hi_prims_kept`),
    i.e. the scan JAX means; elsewhere it changes nothing. A module-scoped
    autouse fixture: `pytest.fixture(autouse=True, scope="module")(...)`."""
    from lazyharvest import _jax
    with _jax.ref_writing_hi_prims_kept():
        yield


def skip_where_jax_jits_scan3_wrongly():
    """A mark skipping a test whose plain-JAX side meets a scan where JAX
    itself computes it wrongly (`jax_jits_scan3_wrongly`)."""
    import pytest
    return pytest.mark.skipif(
        jax_jits_scan3_wrongly(),
        reason=f"jax {jax.__version__} itself computes a scan wrongly with jax_scan3 on "
               f"where its DCE meets it (jax.jit of a scan returns the initial carry)")


def jax_checkpoints_scan3_wrongly() -> bool:
    """Whether this JAX, with `jax_scan3` on, differentiates a scan inside
    `jax.checkpoint` wrongly by itself (jax 0.12.1: `jax.linearize` and
    `jax.grad` of a checkpointed `Scan3` lose the writes to its carry Ref,
    with or without lazyharvest imported: the carry keeps its first value)."""
    if not jax.config.values.get("jax_scan3"):
        return False
    return float(jax.linearize(jax.checkpoint(_scan_of_a_carry), 1.0)[0]) != 5.0


def skip_where_jax_checkpoints_scan3_wrongly():
    """A mark skipping a test that differentiates a scan inside
    `jax.checkpoint` where JAX itself does so wrongly
    (`jax_checkpoints_scan3_wrongly`)."""
    import pytest
    return pytest.mark.skipif(
        jax_checkpoints_scan3_wrongly(),
        reason=f"jax {jax.__version__} itself differentiates a scan inside jax.checkpoint "
               f"wrongly with jax_scan3 on (the writes to its Scan3's carry Ref are lost)")


@functools.cache
def _diffrax_error_under_custom_jvp3(adjoint: str) -> str | None:
    try:
        import diffrax
    except ImportError:
        return None

    def solve(a):
        term = diffrax.ODETerm(lambda t, y, args: -args * y)
        return jnp.sum(diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.ones(2),
                                           args=a, adjoint=getattr(diffrax, adjoint)()).ys)
    try:
        jax.grad(solve)(0.5)
    except Exception as e:  # noqa: BLE001  (whatever JAX and diffrax raise)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return None


def skip_where_jax_cannot_differentiate_diffrax(adjoint: str = "RecursiveCheckpointAdjoint"):
    """Skips the calling test where this JAX, with `jax_custom_jvp3` on,
    cannot take `jax.grad` of a small diffrax solve under `adjoint` by itself,
    no harvest involved (jax 0.12.1 with diffrax 0.7.2 / equinox 0.13.8:
    Equinox's closure conversion raises under the default adjoint, a
    TypeError under `BacksolveAdjoint`)."""
    import pytest
    if not jax.config.values.get("jax_custom_jvp3"):
        return
    error = _diffrax_error_under_custom_jvp3(adjoint)
    if error is not None:
        pytest.skip(f"jax {jax.__version__} with jax_custom_jvp3 on cannot differentiate a "
                    f"diffrax solve under {adjoint} without lazyharvest: {error}")


def jax_cannot_reverse_scan3() -> bool:
    """Whether this JAX, with `jax_scan3` on, has no reverse mode through a
    scan by itself (jax 0.12.1: `Scan3` implements neither `vjp_fwd` nor a
    rule to derive it)."""
    if not jax.config.values.get("jax_scan3"):
        return False
    try:
        jax.grad(_scan_of_a_carry)(1.0)
    except NotImplementedError:
        return True
    return False


def jax_ignores_scan3_reverse() -> bool:
    """Whether this JAX, with `jax_scan3` on, runs `lax.scan(..., reverse=True)`
    forward (jax 0.12.1: `Scan3` ignores `reverse`, with or without
    lazyharvest imported), where nothing transforms the scan."""
    if not jax.config.values.get("jax_scan3"):
        return False
    ys = jax.lax.scan(lambda c, x: (c + x, c), 0.0, jnp.arange(1.0, 4.0), reverse=True)[1]
    return float(ys[0]) != 5.0


def _plain_scans():
    """`lax.scan` staged as `scan`, not `Scan3`, inside (where JAX has the
    flag)."""
    if "jax_scan3" not in jax.config.values:
        return contextlib.nullcontext()
    return jax_flag("jax_scan3", False)


def _ref_writing_scan(x):
    """A scan writing a Ref it closes over; its output depends on `x`."""
    r = jax.new_ref(x)

    def body(_, p):
        r[...] = jnp.sin(r[...] * p) + 1.0
        return None, r[...]
    _, ys = jax.lax.scan(body, None, jnp.arange(1.0, 4.0))
    return r[...] + ys.sum()


def jax_reports_ref_writing_scans_as_leaks() -> bool:
    """Whether JAX's leak checker (`jax_check_tracer_leaks`) reports a
    leaked `JaxprTrace` when it differentiates a scan whose body writes a
    Ref it closes over (jax 0.12.1, every flag off: a cycle through the
    partial-eval trace's effect handles that the checker's own reference
    keeps alive; the gradient is right with the checker off). False where
    JAX has no Refs."""
    if getattr(jax, "new_ref", None) is None:
        return False
    with _plain_scans(), jax_flag("jax_check_tracer_leaks"):
        try:
            jax.grad(_ref_writing_scan)(1.0)
        except Exception as e:  # noqa: BLE001  (JAX's leak report)
            return "Leaked trace JaxprTrace" in str(e)
    return False


def jax_jacfwd_fails_through_ref_writing_scans() -> bool:
    """Whether `jax.jacfwd` (a vmap of jvp) fails through a scan that writes
    a Ref it closes over (jax 0.12.1, every flag off: "ValueError: at vmap
    out_axes[0], got axis spec None but output was batched", the primal
    output found batched; `jax.jacrev` and `jax.vmap` run). With `jax_scan3`
    on, every scan writes its carry Ref this way. False where JAX has no Refs."""
    if getattr(jax, "new_ref", None) is None:
        return False
    try:
        with _plain_scans():
            jax.jacfwd(jax.vmap(_ref_writing_scan))(jnp.array([0.3, 0.5]))
    except ValueError as e:
        return "out_axes" in str(e)
    return False


def skip_where_jax_ignores_scan3_reverse():
    """A mark skipping a test whose plain-JAX side runs a reverse scan where
    JAX itself runs it forward (`jax_ignores_scan3_reverse`)."""
    import pytest
    return pytest.mark.skipif(
        jax_ignores_scan3_reverse(),
        reason=f"jax {jax.__version__} itself runs lax.scan(reverse=True) forward "
               f"with jax_scan3 on (Scan3 ignores reverse)")


def close(a, b, rtol=1e-5, atol=1e-5):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                rtol=rtol, atol=atol), a, b)


class CompileCounter:
    """Counts XLA compilations through jax.monitoring."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1


# --- for the law tests -----------------------------------------------------------------

def victim(x):
    a = lh.sow(jnp.sin(x) * x, tag="t", name="a")
    b = lh.nest(lambda v: lh.sow(jnp.tanh(v) + 1., tag="t", name="b"), scope="s")(a)
    return jnp.sum(a * b)


X = jnp.array([0.3, -1.2, 0.8])


def fresh_victim():
    """`victim` as a fresh function object: no trace cached under a patched rule."""
    return lambda x: victim(x)


_CORPUS: dict = {}

# Constructs the generator draws only when allowed (not derived from the data
# flow): the search for one construct leaves the others out, which keeps it
# short and the simplest program of every other construct what it was.
OPTIONAL = frozenset({
    "python_loop", "jit_layer", "stop_gradient_site", "cond_different_sites", "vmap_cond",
    "zero_trip_scan", "zero_trip_keeps_earlier", "dead_while_sown_before", "nested_while",
    "scan_in_while", "custom_jvp", "custom_vjp", "custom_vjp_closure", "custom_vjp_recompute",
    "label_names",
    "label_scopes", "constant_checkpoint", "constant_scan", "constant_scan_in_checkpoint",
    "checkpointed_scan_body", "live_and_constant_clobber"})


def simplest_with(construct):
    """The simplest generated program using `construct` (deterministic)."""
    if construct not in _CORPUS:
        _CORPUS[construct] = find(
            T.programs(exclude=OPTIONAL - {construct}, include={construct} & T.OPT_IN),
            lambda p: construct in p.constructs,
            settings=settings(max_examples=2000, database=None, derandomize=True))
    return _CORPUS[construct]
