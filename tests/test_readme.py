"""README.md's Python blocks run as written, in order, in one shared namespace (mktestdocs).

Commands that cannot run here (pip, torchrun) are in ```bash fences, which are not executed.
"""

import pathlib
import re

import pytest
import torch
from mktestdocs import check_md_file, grab_code_blocks

pytestmark = pytest.mark.slow  # every block in one namespace: TorchJD, training, compiling

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_every_python_fence_is_collected():
    # mktestdocs runs only fences opened by exactly ```python: a ```py, ```python3 or
    # ```python notest block would be skipped silently, so there must be none.
    text = README.read_text(encoding="utf-8")
    python_fences = re.findall(r"^\s*```\s*(?:py|python|python3)\b.*$", text, flags=re.M)
    assert python_fences, "README.md has no Python block"
    assert all(fence.strip() == "```python" for fence in python_fences), python_fences
    assert len(grab_code_blocks(text, lang="python")) == len(python_fences)


def test_readme_python_blocks_run_in_order():
    # A reader runs the README in torch's defaults (float32), not the suite's float64.
    torch.set_default_dtype(torch.float32)
    check_md_file(README, memory=True)
