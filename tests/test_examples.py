"""Every script in examples/ runs and prints what it promises.

examples/multiprocess.py has its own test (test_multiprocess.py).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def run(script, *args, timeout=180):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")   # one CPU device
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def needs(module):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}")


def test_attention_gradients(tmp_path):
    out = run("attention_gradients.py", "--out", tmp_path)
    assert "attention maps: (2, 2, 2, 5, 5) (layers, batch, heads, T, T)" in out
    assert "rows sum to 1: True" in out
    assert "layer 1: |d loss / d attention| by head" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plots" in out
        return
    for name in ("attention.png", "attention_grads.png", "site_norms.png"):
        png = tmp_path / name
        assert png.is_file() and png.stat().st_size > 0, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_activation_patching(tmp_path):
    out = run("activation_patching.py", "--out", tmp_path)
    assert "patched (rows: layers, columns: positions):" in out
    assert "largest effect below the last layer: layer" in out
    table = (tmp_path / "patching.csv").read_text().splitlines()
    assert table[0].startswith("pos0,") and len(table) == 1 + 3


def test_per_example_grads(tmp_path):
    out = run("per_example_grads.py", "--out", tmp_path)
    assert "equal to jax.vmap(jax.grad(loss)): True" in out
    assert "per-example gradient norms:" in out
    assert len((tmp_path / "per_example.csv").read_text().splitlines()) == 1 + 6


def test_examples_write_nothing_unless_asked(tmp_path):
    before = set(os.listdir(tmp_path))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "per_example_grads.py")],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" not in proc.stdout and set(os.listdir(tmp_path)) == before


@needs("equinox")
def test_equinox_mlp():
    assert "activation gradient norm, layers/1:" in run("equinox_mlp.py")


@needs("flax")
def test_flax_nnx():
    assert "activation gradient norm, blocks/1/norm:" in run("flax_nnx.py")
