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
