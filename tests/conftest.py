import os

# Eight simulated CPU devices for the sharding tests; must precede JAX's import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=10, deadline=None)
# a wider search (with LH_LAW_EXAMPLES=500 for the law suites of tests/test_laws.py)
settings.register_profile(
    "wide", derandomize=False, database=None, deadline=None, print_blob=True,
    suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- with a jax_*3 flag on (JAX_SCAN3=true pytest ...) ---------------------------
# JAX 0.12's `Scan3` falls short in ways of its own, with or without
# lazyharvest: a test that makes JAX do one of the things below, in the
# harvested program or in the plain-JAX program it compares with, skips,
# naming what JAX lacks (docs/compat.md, the jax_scan3 row).

import pytest  # noqa: E402

if any(os.environ.get(f"JAX_{f}3", "").lower() in ("1", "true")
       for f in ("SCAN", "REMAT", "CUSTOM_VJP", "CUSTOM_JVP")):
    # JAX's frames kept on the errors' causes, where the hook below looks
    os.environ.setdefault("JAX_TRACEBACK_FILTERING", "remove_frames")

_LOOPS = "jax/_src/lax/control_flow/loops.py"
# (error type, words of JAX's message, the function of `_LOOPS` it is raised
# under or None, what JAX lacks)
_JAX_CANNOT = [
    (NotImplementedError, "Scan3'> must implement", None,
     "Scan3 has no reverse-mode, linearize or batching rule"),
    (Exception, "", "Scan3.jvp", "Scan3.jvp fails where an output's tangent is a symbolic zero"),
    (Exception, "", "Scan3.expand", "Scan3.expand indexes the xs of a scan of length 0"),
    (NotImplementedError, "Mutating a reference with unknown/differentiated values", None,
     "jax.checkpoint (without jax_remat3) cannot split a Scan3, which writes its carry Ref"),
    (ValueError, "mutable array references cannot be returned", "_while_partial_eval",
     "the partial evaluation of a while loop cannot split a Scan3 in its body "
     "(its carry Ref would be a residual)"),
]


def _raised_under(error: BaseException, name: str) -> bool:
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        where = frame.f_code.co_name
        if "." in name:  # a method of a class: Class.method
            where = f"{type(frame.f_locals.get('self')).__name__}.{where}"
        if where == name and frame.f_code.co_filename.replace("\\", "/").endswith(_LOOPS):
            return True
        tb = tb.tb_next
    return False


def _jax_cannot(error: BaseException) -> str | None:
    import jax
    if isinstance(error, BaseExceptionGroup):  # (hypothesis: several failures)
        reasons = [_jax_cannot(e) for e in error.exceptions]
        return reasons[0] if all(reasons) else None
    chain, e = [], error
    while e is not None and all(e is not x for x in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    for kind, words, under, lacks in _JAX_CANNOT:
        # (JAX's frames are on another error of the chain: UnfilteredStackTrace)
        if (any(isinstance(x, kind) and words in str(x) for x in chain)
                and (under is None or any(_raised_under(x, under) for x in chain))):
            said = str(error).splitlines()
            return (f"jax {jax.__version__} itself: {lacks} "
                    f"({type(error).__name__}: {said[0][:200] if said else ''})")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except Exception as e:
        reason = _jax_cannot(e)
        if reason is None:
            raise
        pytest.skip(reason)


@pytest.fixture
def default_staging():
    """The `jax_*3` flags off for the test (JAX's default staging: a test of
    what `lax.scan` and friends stage by default), as they were after it."""
    import jax
    names = [n for n in ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")
             if n in jax.config.values]
    before = {n: jax.config.values[n] for n in names}
    for n in names:
        jax.config.update(n, False)
    try:
        yield
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
