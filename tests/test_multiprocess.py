"""examples/multiprocess.py: two local processes, one 4-device mesh, gloo collectives."""

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "multiprocess.py"

# Two processes joining JAX's distributed runtime on 127.0.0.1 and summing over
# the global mesh, without lazyharvest: run only when the example fails, to tell
# "this machine cannot run multi-process JAX" (skip) from a bug (fail).
PROBE = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[1],
                               num_processes=2, process_id=int(sys.argv[2]),
                               initialization_timeout=60)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones(2))
    assert float(jax.jit(jnp.sum)(x)) == 4.
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_runtime_error():
    """None when two processes can run a collective here, else their output."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, port, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    except subprocess.TimeoutExpired:
        return "timed out"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if all(p.returncode == 0 for p in procs):
        return None
    return (outs[0] + outs[1])[-400:]


def test_two_processes_reap_a_data_parallel_model(tmp_path):
    cmd = [sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--timeout", "100"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        run = None
    if run is None or run.returncode != 0:
        why = _distributed_runtime_error()
        if why is not None:
            pytest.skip(f"JAX's distributed runtime (gloo on 127.0.0.1) cannot start here: {why}")
    assert run is not None, "examples/multiprocess.py timed out"
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 processes agree: checksum" in run.stdout
    for i in range(2):
        # 8 rows over 4 devices: each process holds 2 shards of 2 rows
        assert f"process {i}: vjp/layer1 global (8, 3) local shards [[2, 3], [2, 3]]" \
            in run.stdout
        assert f"process {i}: eager leaf equals jitted leaf: True" in run.stdout
        assert (tmp_path / f"process{i}.json").is_file()
