"""Small usability promises: progress lines, compile notices, helpful errors,
the demo."""

import logging
import subprocess
import sys
import warnings

import jax
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


# --- rough edges a newcomer met -------------------------------------------------------

def _acts(x):
    return jnp.sum(lh.sow(jnp.sin(x), tag="acts", name="h1"))


def test_a_harvest_of_a_tag_no_site_sows_warns_at_once_naming_the_sown_tags():
    with pytest.warns(UserWarning, match=r"no site of this tag is sown.*'acts'"):
        d = lh.reap(_acts, tag="act")(jnp.ones(3))
    assert len(d) == 0
    with pytest.warns(UserWarning, match="'acts'"):
        lh.call_and_reap(_acts, tag="act")(jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tag that is sown: no warning
        lh.reap(_acts, tag="acts")(jnp.ones(3))


def test_a_plant_of_a_misspelt_tag_lists_the_tags_sown():
    with pytest.raises(lh.HarvestError, match=r"No site of tag 'act' is sown.*'acts'"):
        lh.plant(_acts, tag="act")({"h1": jnp.zeros(3)}, jnp.ones(3))


def test_plants_in_the_wrong_position_are_refused_before_the_model_runs():
    called = []

    def loss(params, x, y):
        called.append(1)
        w, b = params  # would fail on the plants mapping
        return jnp.sum((lh.sow(w * x + b, tag="acts", name="h1") - y) ** 2)
    params = (jnp.ones(3), jnp.zeros(3))
    with pytest.raises(lh.HarvestError, match=r"plants must be a mapping.*\(plants, \*args\)"):
        lh.plant(loss, tag="acts")(params, jnp.ones(3), jnp.ones(3), {"h1": jnp.zeros(3)})
    assert not called
    got = lh.plant(loss, tag="acts")({"h1": jnp.zeros(3)}, params, jnp.ones(3), jnp.ones(3))
    assert float(got) == 3.0  # sum((0 - 1) ** 2): the plant in place


def test_a_key_holding_a_tuple_says_how_to_write_it():
    d = lh.reap(jax.grad(_acts), tag="acts")(jnp.ones(3))
    with pytest.raises(KeyError, match=r"write d\['vjp', 'h1'\]"):
        d[(("vjp", "h1"),)]
    with pytest.raises(KeyError) as e:
        d["vjp", "h2"]
    assert "Closest keys: [('vjp', 'h1')" in str(e.value)  # keys, not their quoted text


def test_law_checkers_give_perturbations_under_either_spelling():
    def perturb(eps, x):  # a user's oracle reads eps["h1"], as slices are keyed
        return jnp.sum(jnp.sin(x) + eps["h1"]) + jnp.sum(eps[("h1",)] * 0)
    x = jnp.array([0.3, -1.0, 2.0])
    T.check_lazy(_acts, x, tag="acts", slices={"h1": jnp.sin}, perturb=perturb)
