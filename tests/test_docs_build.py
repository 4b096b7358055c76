"""The API reference (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a docstring that
griffe cannot parse, a broken link or a page left out of the nav fails the build."""

import html
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


def _api_page(site: pathlib.Path) -> str:
    return (site / "api" / "index.html").read_text(encoding="utf-8")


def test_no_rest_markup_is_rendered_raw(build):
    # Google style in Markdown: a reST role renders as ":func:<code>x</code>", and a reST
    # literal block's "::" stays in the text.
    _, site = build
    page = _api_page(site)
    role = r":(?:func|class|meth|attr|mod|exc|data|obj|py:\w+):(?:<code>|`)[^<`]*"
    roles = re.findall(role, page)
    assert not roles, f"reST roles in the API page (write `name` instead): {roles}"
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    literal_blocks = re.findall(r"\S*::(?=\s)", text)  # "as::" ends a line; "torch::nms" does not
    assert not literal_blocks, f"reST '::' in the API page (use a fenced block): {literal_blocks}"


def _returns_rows(page: str) -> dict[str, int]:
    """Each documented object's heading id -> the rows of its Returns table."""
    rows: dict[str, int] = {}
    name = None
    pattern = r'<h[2-6] id="(funcgrad\.[^"]+)"|Returns:</span></p>\s*<table>(.*?)</table>'
    for match in re.finditer(pattern, page, flags=re.S):
        if match.group(1):
            name = match.group(1)
        elif name is not None:
            rows[name] = match.group(2).count('<tr class="doc-section-item">')
    return rows


def test_each_returns_table_has_one_row_per_output(build):
    # Every public function returns one object (a tuple such as (values, grads) is one), so
    # its Returns section is one row: a row per line of a multi-line description (typed Any,
    # cut mid-sentence) is what griffe makes of continuation lines it reads as new items.
    _, site = build
    rows = _returns_rows(_api_page(site))
    assert {"funcgrad.compose_heads", "funcgrad.backward", "funcgrad.pullback"} <= set(rows)
    too_many = {name: count for name, count in rows.items() if count > 1}
    assert not too_many, f"Returns tables with more rows than outputs: {too_many}"


def test_typed_arguments_render_with_their_types(build):
    # backward's and combine_heads' weighting, process_group (and backward's inputs) are typed
    # by the aliases of funcgrad._types, shown by name in the signatures (were Any), and each
    # alias is documented on the page.
    _, site = build
    page = _api_page(site)
    for function in ("backward", "combine_heads"):
        start = page.index(f'id="funcgrad.{function}"')
        heading = html.unescape(re.sub(r"<[^>]+>", "", page[start:])).split("¶")[0]
        assert "weighting: Weighting | None" in heading, heading
        assert "process_group: ProcessGroupLike | None" in heading, heading
    assert "inputs: InputsLike | None" in html.unescape(re.sub(r"<[^>]+>", "", page))
    for alias in ("Weighting", "ProcessGroupLike", "InputsLike", "ChunkSize", "CheckMode"):
        assert f'id="funcgrad.{alias}"' in page, alias


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _any_not_in_signature(page: str) -> tuple[int, list[str]]:
    """(the table rows read, those typed Any where the signature does not say Any)."""
    checked, wrong = 0, []
    for section in re.split(r'(?=<h[2-6] id="funcgrad\.)', page)[1:]:
        name = re.match(r'<h[2-6] id="([^"]+)"', section).group(1)
        signature = _text(section).split("¶")[0].strip()
        tables = re.findall(
            r"(Parameters|Returns):</span></p>\s*<table>(.*?)</table>", section, re.S
        )
        for kind, body in tables:
            for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', body, flags=re.S):
                cells = [_text(cell).strip() for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
                checked += 1
                if kind == "Parameters" and cells[1] == "Any":
                    said = rf"(?<![\w.]){re.escape(cells[0])}: Any\b"
                    what = f"{name}({cells[0]})"
                elif kind == "Returns" and cells[0] == "Any":
                    said, what = r"-> Any$", f"{name} -> Any"
                else:
                    continue
                if not re.search(said, signature):
                    wrong.append(what)
    return checked, wrong


def test_no_any_where_the_signature_is_typed(build):
    # A table cell typed Any must come from an Any in the signature: griffe types as Any what
    # it cannot match to an annotation (a Returns line read as an item of its own, a
    # parameter documented under a name the signature does not have).
    _, site = build
    checked, wrong = _any_not_in_signature(_api_page(site))
    assert checked > 50, checked  # the tables were found
    assert not wrong, f"typed as Any on the page, not in the signature: {wrong}"
