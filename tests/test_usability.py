"""Small usability promises: progress lines, compile notices, helpful errors,
the demo."""

import logging
import subprocess
import sys

import jax.numpy as jnp
import pytest

import lazyharvest as lh
from lazyharvest import program
from lazyharvest import testing as T


def f(x):
    return jnp.sum(lh.sow(jnp.sin(x), tag="t", name="a") ** 2)


def test_check_all_verbose_prints_one_line_per_law(capsys):
    T.check_all(f, jnp.ones(3), tag="t", verbose=True, laws=(1, 4, 7))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("law 1 (linearize): passed (")
    assert lines[1].startswith("law 4 (jit): passed (")
    assert lines[2].startswith("law 7 (lazy): skipped")


def test_slow_compile_logs_a_notice_when_asked(monkeypatch, caplog):
    monkeypatch.setattr(program, "COMPILE_NOTICE_SECONDS", 0.0)
    g = lambda x: lh.sow(x * 3, tag="t", name="slow")  # a fresh function: compiles
    with caplog.at_level(logging.INFO, logger="lazyharvest"):
        lh.reap(g, tag="t")(jnp.ones(2))["slow"]
    assert any("compiling slow took" in r.getMessage() for r in caplog.records)


def test_compile_notice_is_silent_by_default(monkeypatch, caplog):
    monkeypatch.setattr(program, "COMPILE_NOTICE_SECONDS", 0.0)
    g = lambda x: lh.sow(x * 3, tag="t", name="quiet")
    with caplog.at_level(logging.WARNING):
        lh.reap(g, tag="t")(jnp.ones(2))["quiet"]
    assert not caplog.records


def test_strict_duplicate_error_suggests_nest():
    block = lambda x: lh.sow(jnp.tanh(x), tag="t", name="h")
    g = lambda x: block(block(x))
    with pytest.raises(lh.HarvestError, match=r"lh\.nest"):
        lh.reap(g, tag="t")(1.)
    nested = lambda x: lh.nest(block, scope="b1")(lh.nest(block, scope="b0")(x))
    assert sorted(lh.reap(nested, tag="t")(1.).keys()) == [("b0", "h"), ("b1", "h")]


def test_demo_prints_the_summary_table_and_writes_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lazyharvest"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "l2 norm" in out.stdout and "('vjp', 'layer2')" in out.stdout
    assert list(tmp_path.iterdir()) == []
