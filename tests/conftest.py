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
# JAX 0.12's `Scan3` has no reverse-mode, linearize or vmap rule: a test that
# makes JAX differentiate or batch one, in the harvested program or in the
# plain-JAX program it compares with, skips, naming what JAX lacks.

import pytest  # noqa: E402


def _jax_cannot(error: BaseException) -> str | None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, NotImplementedError) and "Scan3'> must implement" in text:
            import jax
            return f"jax {jax.__version__} itself cannot: {text.splitlines()[0]}"
        error = error.__cause__ or error.__context__
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
