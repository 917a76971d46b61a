"""CONTRIBUTING.md's walk-through (a rule for a toy higher-order primitive) runs."""

import pathlib
import re

from lazyharvest import _interpreter

DOC = pathlib.Path(__file__).parent.parent / "CONTRIBUTING.md"


def test_contributing_walkthrough_registers_a_working_rule():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 3
    scope: dict = {}
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), scope)
        assert scope["toy_call_p"] in _interpreter.EVAL_RULES
    finally:
        _interpreter.EVAL_RULES.pop(scope.get("toy_call_p"), None)
