"""The code blocks of docs/laws.md run as written."""


def test_docs_examples():
    """Every ```python block of docs/laws.md runs, in order, in one namespace."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parent.parent / "docs" / "laws.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 12
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/laws.md", "exec"), namespace)  # noqa: S102
