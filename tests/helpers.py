"""Small shared helpers for the tests."""

import jax
import numpy as np


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
