"""The README's Python blocks run as written, from the project root (../shared beside it, as CI has it)."""

import contextlib
import io
import os
import re

import pytest
from conftest import REPO, SHARED

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{k}" for k in range(len(BLOCKS))])
def test_readme_python_block_runs(code, monkeypatch):
    if "../shared" in code and not SHARED.is_dir():
        pytest.skip(f"the block reads ../shared, which is not here: {SHARED}")
    monkeypatch.chdir(REPO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    if "print(" in code:
        assert out.getvalue().strip(), "the block printed nothing"


def test_readme_has_the_data_block():
    assert any("read_records" in b for b in BLOCKS)
    assert os.path.isfile(REPO / "README.md")
