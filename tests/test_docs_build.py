"""The API reference (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a docstring that
griffe cannot parse, a broken link or a page left out of the nav fails the build."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a whole mkdocs build

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(the finished `mkdocs build --strict` process, the site folder), built once."""
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' to build the docs")
    site = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    command += ["--config-file", str(ROOT / "mkdocs.yml")]
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, not a build warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    process = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    return process, site


def test_mkdocs_build_strict(build):
    process, _ = build
    output = process.stdout + process.stderr
    warnings = re.findall(r"^(?:WARNING|ERROR)\s+-\s+(.*)$", output, flags=re.M)
    assert process.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{output}"


def test_every_public_object_is_documented(build):
    import funcgrad

    _, site = build
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [name for name in funcgrad.__all__ if f'id="funcgrad.{name}"' not in page]
    assert not missing, f"add to docs/api.md: {missing}"


def test_docstring_examples_render_as_code(build):
    _, site = build
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "<blockquote>\n<blockquote>" not in page  # what >>> turns into outside a code block
