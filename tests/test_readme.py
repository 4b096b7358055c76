"""README.md's and docs/*.md's Python blocks run as written (mktestdocs): each page's blocks in
order, in one namespace per page.

Commands that cannot run here (pip, torchrun) are in ```bash fences, which are not executed.
"""

import pathlib
import re

import pytest
import torch
from mktestdocs import check_md_file, grab_code_blocks

pytestmark = pytest.mark.slow  # every block in one namespace: TorchJD, training, compiling

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Every page with a Python block; a page without one has nothing to run.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PAGES_WITH_CODE = [
    page for page in PAGES if grab_code_blocks(page.read_text(encoding="utf-8"), lang="python")
]


def _python_fences(text: str) -> list[str]:
    return re.findall(r"^\s*```\s*(?:py|python|python3)\b.*$", text, flags=re.M)


def test_the_readme_and_the_moved_pages_have_python_blocks():
    names = {page.relative_to(ROOT).as_posix() for page in PAGES_WITH_CODE}
    assert {"README.md", "docs/guide.md", "docs/multitask.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_python_fence_is_collected(page):
    # mktestdocs runs only fences opened by exactly ```python: a ```py, ```python3 or
    # ```python notest block would be skipped silently, so there must be none.
    text = page.read_text(encoding="utf-8")
    python_fences = _python_fences(text)
    assert all(fence.strip() == "```python" for fence in python_fences), python_fences
    assert len(grab_code_blocks(text, lang="python")) == len(python_fences)


@pytest.mark.parametrize(
    "page", PAGES_WITH_CODE, ids=lambda page: page.relative_to(ROOT).as_posix()
)
def test_python_blocks_run_in_order(page):
    # A reader runs the pages in torch's defaults (float32), not the suite's float64.
    torch.set_default_dtype(torch.float32)
    check_md_file(page, memory=True)
