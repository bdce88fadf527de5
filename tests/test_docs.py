"""Every Python example of the documentation runs: the site's pages (docs/**/*.md) and the README.

The ```python blocks of one page are fragments of one example: they are concatenated in order and
run as one script, in a fresh namespace, with a temporary directory as the working directory.
A block whose first line is a comment starting with ``# not run:`` is skipped (the comment says
why: hardware or hours it needs). The site build itself (``make docs``) is tested at the end, when
Sphinx and the docs extra are installed.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SKIP_MARK = "# not run:"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def pages() -> list[pathlib.Path]:
    generated = ("_build", "api/generated", "notebooks", "jupyter_execute")
    found = [
        path
        for path in sorted(DOCS.rglob("*.md"))
        if not any(part in path.relative_to(DOCS).as_posix() for part in generated)
    ]
    return [*found, REPO / "README.md"]


def python_blocks(text: str) -> tuple[list[str], list[str]]:
    """The page's ```python blocks: (to run, skipped with a ``# not run:`` reason)."""
    run, skipped = [], []
    for block in _FENCE.findall(text):
        first = block.lstrip().splitlines()[0] if block.strip() else ""
        (skipped if first.startswith(SKIP_MARK) else run).append(block)
    return run, skipped


def page_script(text: str) -> str:
    """The blocks to run, each at its own line numbers of the page (tracebacks point at the page)."""
    lines: list[str] = []
    for match in _FENCE.finditer(text):
        block = match.group(1)
        first = block.lstrip().splitlines()[0] if block.strip() else ""
        if first.startswith(SKIP_MARK):
            continue
        start = text.count("\n", 0, match.start(1))
        lines += [""] * (start - len(lines))
        lines += block.splitlines()
    return "\n".join(lines) + "\n"


def example_pages() -> list[pathlib.Path]:
    return [path for path in pages() if python_blocks(path.read_text())[0]]


def test_fences_are_found():
    run, skipped = python_blocks(
        "x\n```python\na = 1\n```\n\n```python\n# not run: needs a TPU pod\nb = 2\n```\n"
    )
    assert run == ["a = 1\n"] and skipped == ["# not run: needs a TPU pod\nb = 2\n"]
    assert len(example_pages()) >= 20, "the docs should hold examples on most pages"


def test_skipped_blocks_say_why():
    for path in pages():
        for block in python_blocks(path.read_text())[1]:
            reason = block.lstrip().splitlines()[0][len(SKIP_MARK) :].strip()
            assert len(reason) > 10, f"{path}: a skipped block must say why it cannot run"


@pytest.mark.parametrize("path", example_pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    code = page_script(path.read_text())
    namespace = {"__name__": "__docs_example__"}
    exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - the page's own example


def test_site_builds_without_warnings(tmp_path):
    """``make docs``: the whole site, warnings as errors (cross-references, API pages, notebooks)."""
    pytest.importorskip("sphinx", reason="the docs extra is not installed (make install adds it)")
    import subprocess
    import sys

    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    command += ["-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, f"sphinx -W failed:\n{result.stderr[-4000:]}"
    for page in ("index.html", "papers/p01_saber.html", "api/generated/adapters.html"):
        assert (tmp_path / "html" / page).is_file(), f"the site has no {page}"


def test_each_paper_page_quotes_its_status_row_word_for_word():
    rows = {}
    for line in (DOCS / "papers" / "index.md").read_text().splitlines():
        match = re.match(r"\| \[P(\d+)\]\((p\d+_\w+\.md)\) \| [^|]* \| (.*) \|$", line)
        if match:
            rows[match.group(2)] = match.group(3).replace("\\|", "|").strip()
    assert len(rows) == 19, "the Status table should have one row per paper"
    for page, row in rows.items():
        verdict = (DOCS / "papers" / page).read_text().split("## Verdict", 1)[1]
        quote = " ".join(line[2:] for line in verdict.splitlines() if line.startswith("> "))
        assert quote.replace("\\|", "|").strip() == row, f"{page}: its Verdict differs from its row"
