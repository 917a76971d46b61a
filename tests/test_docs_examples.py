"""The code blocks of docs/laws.md run as written."""

import pytest


@pytest.mark.slow
def test_docs_examples():
    """Every ```python block of docs/laws.md runs, in order, in one namespace."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parent.parent / "docs" / "laws.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 12
    namespace: dict = {}
    for i, block in enumerate(blocks):
        # (not the file's own name: Python 3.12's tokenizer, reading source
        # for a traceback or a debug name, would read markdown at the
        # block's line numbers)
        exec(compile(block, f"<docs/laws.md, block {i}>", "exec"), namespace)  # noqa: S102
