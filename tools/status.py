"""Render the papers' Status words from the status registry, or check that they match it.

``docs/papers/status.toml`` lists, for each paper P1..P19, each trend check of ``specs.md`` with
its outcome, evidence and command. This script writes three things from it:

- the third column of the Status table in ``docs/papers/index.md``;
- the ``## Verdict`` quote of each paper page (the same text as its Status row);
- the third column of the README's paper table (a shorter line: the checks grouped by outcome).

Usage::

    python tools/status.py           # rewrite the three from the registry
    python tools/status.py --check   # exit 1, saying what differs, if any of them drifted

Everything outside the generated cells and quotes (the method column, the pages' prose, the
sentence that introduces each quote) is hand-written and left alone.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PAPERS = REPO / "docs" / "papers"
REGISTRY = PAPERS / "status.toml"
INDEX = PAPERS / "index.md"
README = REPO / "README.md"

OUTCOMES = ("reproduced", "not_reproduced", "inconclusive", "by_construction", "not_run")
REQUIRED = ("claim", "outcome", "evidence", "command")
OPTIONAL = ("setting", "note")
# How an outcome reads in a sentence (the counts, then each check).
COUNT_WORDS = {
    "reproduced": "reproduced",
    "not_reproduced": "not reproduced",
    "inconclusive": "inconclusive",
    "by_construction": "by construction (not counted)",
    "not_run": "not run",
}
CHECK_WORDS = {
    "reproduced": "reproduced",
    "not_reproduced": "**not** reproduced",
    "inconclusive": "inconclusive",
    "by_construction": "holds by construction, not counted",
    "not_run": "not run",
}
PAPER_IDS = tuple(f"P{i}" for i in range(1, 20))
# A Status-table row: | [P7](p07_x.md) | method | state |   (README: docs/papers/p07_x.md)
_ROW = re.compile(
    r"^(\| \[(P\d+)\]\(((?:docs/papers/)?p\d+_\w+\.md)\) \| (?:[^|\\]|\\.)* \| )(.*)( \|)$"
)


def load(path: pathlib.Path = REGISTRY) -> dict[str, list[dict[str, str]]]:
    """The registry as {paper: [check, ...]}, in file order."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    return {paper: list(entry.get("checks", [])) for paper, entry in data.items()}


def problems(registry: dict[str, list[dict[str, str]]]) -> list[str]:
    """What is wrong with the registry itself: papers, fields, outcomes, evidence targets."""
    found = []
    if sorted(registry, key=lambda p: int(p[1:])) != list(PAPER_IDS):
        found.append(f"papers {sorted(registry)} are not exactly P1..P19")
    for paper, checks in registry.items():
        if not checks:
            found.append(f"{paper}: no checks")
        for i, check in enumerate(checks):
            where = f"{paper} check {i + 1} ({check.get('claim', '?')[:40]})"
            for key in REQUIRED:
                if not str(check.get(key, "")).strip():
                    found.append(f"{where}: no {key}")
            for key in check:
                if key not in REQUIRED + OPTIONAL:
                    found.append(f"{where}: unknown field {key!r}")
            if check.get("outcome") not in OUTCOMES:
                found.append(f"{where}: outcome {check.get('outcome')!r} is not one of {OUTCOMES}")
            for key in ("claim", "setting", "note", "command"):
                if "\n" in str(check.get(key, "")):
                    found.append(f"{where}: {key} spans lines")
            error = evidence_problem(str(check.get("evidence", "")))
            if error:
                found.append(f"{where}: {error}")
    return found


def slug(heading: str) -> str:
    """MyST's heading anchor (``myst_heading_anchors``): lower case, punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors a page defines: its headings (levels 1-3) and ``(label)=`` targets."""
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        heading = re.match(r"^#{1,3} (.+)$", line)
        if heading:
            found.add(slug(heading.group(1)))
        label = re.match(r"^\(([\w\-]+)\)=\s*$", line)
        if label:
            found.add(label.group(1))
    return found


def evidence_problem(evidence: str) -> str | None:
    """``page.md#anchor: what`` must name a page under docs/ and, if given, one of its anchors."""
    target = evidence.split(": ", 1)[0].strip()
    page, _, anchor = target.partition("#")
    path = (PAPERS / page).resolve()
    if not page.endswith(".md") or not path.is_file():
        return f"evidence names no page: {evidence!r}"
    if anchor and anchor not in anchors(path):
        return f"evidence anchor #{anchor} is not in {page}"
    return None


def _sentence(text: str) -> str:
    return text.strip().rstrip(".")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _counts(checks: list[dict[str, str]]) -> str:
    parts = []
    for outcome in OUTCOMES:
        n = sum(check["outcome"] == outcome for check in checks)
        if n:
            parts.append(f"{n} {COUNT_WORDS[outcome]}")
    total = len(checks)
    return f"{total} check{'s' if total != 1 else ''}: " + ", ".join(parts)


def _claim(check: dict[str, str]) -> str:
    setting = check.get("setting", "").strip()
    return _sentence(check["claim"]) + (f" ({setting})" if setting else "")


def status_line(checks: list[dict[str, str]]) -> str:
    """The Status row and the page's Verdict: counts, then every check with its outcome and note."""
    items = []
    for check in checks:
        item = f"{_claim(check)}: {CHECK_WORDS[check['outcome']]}"
        note = check.get("note", "").strip()
        if note:
            item += f" — {_sentence(note)}"
        items.append(item)
    return _escape(f"{_counts(checks)}. " + _capital("; ".join(items)))


def readme_line(checks: list[dict[str, str]]) -> str:
    """The README's line: counts, then the claims grouped by outcome (no numbers)."""
    groups = []
    for outcome in OUTCOMES:
        settings: dict[str, list[str]] = {}  # claim -> its settings with this outcome, in order
        for check in checks:
            if check["outcome"] == outcome:
                setting = check.get("setting", "").strip()
                settings.setdefault(_sentence(check["claim"]), []).extend(
                    [setting] if setting else []
                )
        claims = [c + (f" ({'; '.join(s)})" if s else "") for c, s in settings.items()]
        if claims:
            groups.append(_capital(f"{COUNT_WORDS[outcome]}: " + "; ".join(claims)))
    return _escape(f"{_counts(checks)}. " + ". ".join(groups))


def _escape(text: str) -> str:
    """A table cell: ``|`` escaped (the page's quote carries the same text)."""
    return text.replace("\\|", "|").replace("|", "\\|")


def _rewrite_rows(text: str, lines_for: dict[str, str]) -> tuple[str, set[str]]:
    out, seen = [], set()
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        match = _ROW.match(body)
        if match and match.group(2) in lines_for:
            seen.add(match.group(2))
            body = match.group(1) + lines_for[match.group(2)] + match.group(5)
            line = body + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out), seen


def page_files(index_text: str) -> dict[str, str]:
    """{paper: page file name} from the Status table."""
    return {m.group(2): m.group(3) for m in map(_ROW.match, index_text.splitlines()) if m}


def rewrite_verdict(text: str, quote: str) -> str:
    """Replace the ``> `` block of the page's ``## Verdict`` section by one quoted line."""
    head, marker, verdict = text.partition("## Verdict")
    if not marker:
        raise ValueError("the page has no '## Verdict' section")
    lines = verdict.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("> ")), None)
    if start is None:
        raise ValueError("the page's Verdict has no '> ' quote")
    end = start
    while end < len(lines) and lines[end].startswith("> "):
        end += 1
    lines[start:end] = [f"> {quote}\n"]
    return head + marker + "".join(lines)


def render(registry: dict[str, list[dict[str, str]]]) -> dict[pathlib.Path, str]:
    """{file: its text with every generated part rendered from the registry}."""
    index_text = INDEX.read_text()
    rows = {paper: status_line(checks) for paper, checks in registry.items()}
    new_index, seen = _rewrite_rows(index_text, rows)
    missing = set(registry) - seen
    if missing:
        raise ValueError(f"docs/papers/index.md has no Status row for {sorted(missing)}")
    files = {INDEX: new_index}
    for paper, page in page_files(index_text).items():
        path = PAPERS / page
        files[path] = rewrite_verdict(path.read_text(), rows[paper])
    readme, seen = _rewrite_rows(
        README.read_text(), {p: readme_line(c) for p, c in registry.items()}
    )
    missing = set(registry) - seen
    if missing:
        raise ValueError(f"README.md has no paper-table row for {sorted(missing)}")
    files[README] = readme
    return files


def drift(registry: dict[str, list[dict[str, str]]]) -> list[str]:
    """The files whose generated parts differ from what the registry renders."""
    return [_name(path) for path, text in render(registry).items() if path.read_text() != text]


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if anything drifted")
    args = parser.parse_args(argv)
    registry = load()
    found = problems(registry)
    if found:
        print("docs/papers/status.toml:\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    if args.check:
        stale = drift(registry)
        if stale:
            print(
                "these differ from what docs/papers/status.toml renders "
                "(run `python tools/status.py`):\n  " + "\n  ".join(stale),
                file=sys.stderr,
            )
            return 1
        print("status: index, pages and README match docs/papers/status.toml")
        return 0
    for path, text in render(registry).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {_name(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
