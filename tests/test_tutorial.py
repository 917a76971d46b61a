"""The code blocks of docs/tutorial.md run, in order, in one namespace.

A block preceded by `<!-- needs: MODULE -->` is skipped when MODULE (an
optional extra) cannot be imported; every other block must run.
"""

import importlib.util
import pathlib
import re

import pytest

TUTORIAL = pathlib.Path(__file__).parent.parent / "docs" / "tutorial.md"
BLOCK = re.compile(r"(?:^<!-- needs: (?P<needs>[\w.]+) -->\n)?^```python\n(?P<code>.*?)^```",
                   flags=re.S | re.M)


def blocks():
    return [(m["needs"], m["code"]) for m in BLOCK.finditer(TUTORIAL.read_text())]


def test_tutorial_blocks_run_in_order(capsys):
    found = blocks()
    assert len(found) >= 15
    namespace: dict = {"__name__": "tutorial"}
    skipped = []
    for needs, code in found:
        if needs and importlib.util.find_spec(needs) is None:
            skipped.append(needs)
            continue
        exec(compile(code, str(TUTORIAL), "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    assert "per-example gradient norms:" in printed
    assert "jitted step:" in printed
    if skipped:
        pytest.skip(f"tutorial ran without the blocks needing {sorted(set(skipped))}")


def test_only_optional_extras_may_be_skipped():
    optional = {"equinox", "flax", "matplotlib", "hypothesis", "treescope"}
    assert {needs for needs, _ in blocks() if needs} <= optional
