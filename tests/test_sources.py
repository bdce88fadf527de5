"""The repository's text files hold no control characters: a literal vertical tab or form feed in a
docstring (a ``\\v`` written in a non-raw string) renders as garbage in the docs and reads as a
line break to some tools. Tabs, newlines and carriage returns are allowed."""

from __future__ import annotations

import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TEXT = (".py", ".md", ".ipynb", ".cfg", ".toml", ".txt", ".json", ".yaml", ".yml", ".rst")


def _tracked_text_files() -> list[pathlib.Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return [REPO / name for name in listed.split("\0") if name.endswith(_TEXT)]


def test_no_control_characters_in_sources():
    found = []
    for path in _tracked_text_files():
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        for number, line in enumerate(path.read_text(errors="replace").split("\n"), 1):
            if match := _CONTROL.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group()!r}")
    assert not found, "control characters (write them as escapes, or use a raw string):\n" + (
        "\n".join(found)
    )


def test_the_check_finds_a_vertical_tab():
    assert _CONTROL.search('"""the rate \x0barepsilon"""')
    assert not _CONTROL.search("tabs\tare fine\r\n")
