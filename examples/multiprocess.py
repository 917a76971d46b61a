"""Reaping activations and their gradients across two processes (data parallel).

Run: python examples/multiprocess.py [--out DIR]

The parent starts two local processes, each with two CPU devices, joined by
`jax.distributed` (bound to 127.0.0.1) into one 4-device mesh; CPU collectives
go through gloo. The parameters are replicated, the batch is sharded over the
mesh, and every process runs the same jitted step, which reaps the activations
and their cotangents (`lh.reap(jax.grad(loss))`, returning `d.compute()`).
The reaped leaves are global arrays sharded like the batch: each process
prints the shapes of its addressable shards and a checksum; the parent checks
that the checksums agree with each other and with one process computing the
whole batch. With --out DIR each process writes DIR/process<i>.json.

A process can also be started by hand (set XLA_FLAGS as `parent` does):
python examples/multiprocess.py --process-id I --port PORT
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys

NUM_PROCESSES, LOCAL_DEVICES, ROWS_PER_PROCESS = 2, 2, 4
# Each process's CPU devices; must be set before JAX is imported.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lazyharvest as lh  # noqa: E402


def loss(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = lh.sow(jnp.tanh(h @ w + b), tag="act", name=f"layer{i}")
    return jnp.mean(h ** 2)


def make_params():
    keys = jax.random.split(jax.random.key(0), 2)      # the same in every process
    return [(jax.random.normal(k, (3, 3)) * 0.5, jnp.zeros(3)) for k in keys]


def local_rows(process_id: int) -> np.ndarray:
    """This process's rows of the global batch."""
    rows = np.arange(ROWS_PER_PROCESS * 3, dtype=np.float32).reshape(-1, 3)
    return (rows + 100 * process_id) / 100


def checksum_of(leaves):
    return sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(leaves))


@jax.jit
def step(params, x):
    d = lh.reap(jax.grad(loss), tag="act")(params, x)  # activations and cotangents
    leaves = d.compute()
    return leaves, checksum_of(leaves)


def child(process_id: int, port: int, out: str | None) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=NUM_PROCESSES, process_id=process_id)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = jax.device_put(make_params(), NamedSharding(mesh, P()))    # replicated
    # This process's rows, as its part of one global batch sharded over the mesh.
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                               local_rows(process_id))
    leaves, total = step(params, x)
    shards = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(leaves)[0]:
        name = "/".join(k.key for k in path)
        shards[name] = [list(s.data.shape) for s in leaf.addressable_shards]
        print(f"process {process_id}: {name} global {tuple(leaf.shape)} "
              f"local shards {shards[name]}")
    # Eagerly, reading a leaf runs its slice as one program over the global mesh:
    # every process must read the same leaves, in the same order.
    eager = lh.reap(jax.grad(loss), tag="act")(params, x)["vjp", "layer1"]
    same = all(np.allclose(a.data, b.data) for a, b in
               zip(eager.addressable_shards, leaves["vjp"]["layer1"].addressable_shards))
    print(f"process {process_id}: eager leaf equals jitted leaf: {same}")
    checksum = float(total)          # replicated: every process holds the whole value
    print(f"process {process_id}: checksum {checksum:.6f}")
    if out:
        record = {"process": process_id, "shards": shards, "checksum": checksum}
        (pathlib.Path(out) / f"process{process_id}.json").write_text(json.dumps(record))
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: str | None, timeout: float) -> tuple[list[int], list[str]]:
    """Runs the processes; their exit codes and outputs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
    cmd = [sys.executable, __file__, "--port", str(free_port())]
    cmd += ["--out", out] if out else []
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(NUM_PROCESSES)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outputs


def parent(out: str | None, timeout: float) -> int:
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    codes, outputs = launch(out, timeout)
    failed = any(codes)
    for text in outputs:            # the children's own lines (all if one failed)
        print("".join(line for line in text.splitlines(keepends=True)
                      if failed or line.startswith("process ")), end="")
    sums = {line.split()[-1] for text in outputs for line in text.splitlines()
            if line.startswith("process ") and "checksum" in line}
    if failed or len(sums) != 1:
        print("FAILED: exit codes", codes, "checksums", sums)
        return 1
    x = np.concatenate([local_rows(i) for i in range(NUM_PROCESSES)])
    want = float(step(make_params(), x)[1])     # one process, the whole batch
    checksum = float(sums.pop())
    if abs(checksum - want) > 1e-4:
        print(f"FAILED: checksum {checksum:.6f}, one process computes {want:.6f}")
        return 1
    print(f"{NUM_PROCESSES} processes agree: checksum {checksum:.6f} "
          f"(one process, whole batch: {want:.6f})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write process<i>.json files here")
    ap.add_argument("--process-id", type=int, help="run as this process (0 or 1)")
    ap.add_argument("--port", type=int, help="the coordinator's port on 127.0.0.1")
    ap.add_argument("--timeout", type=float, default=120.)
    args = ap.parse_args()
    if args.process_id is None:
        return parent(args.out, args.timeout)
    child(args.process_id, args.port, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
