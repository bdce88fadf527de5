"""Times the test suite tier by tier and writes the table into the contributor guide.

    python tools/test_durations.py            # every tier, 2 workers (about 40 minutes on 2 cores)
    python tools/test_durations.py --tiers unit --workers 2 --check   # time one tier, print only

Each tier (the markers that ``tests/conftest.py`` applies by path) runs as its own pytest command,
as a contributor would run it, and the wall time of that command is what the table reports; the
per-test times are pytest's ``--durations=0`` (setup + call + teardown). The table replaces the
text between the ``durations`` markers of ``docs/guides/contributing.md``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guides" / "contributing.md"
START, END = "<!-- durations:start -->", "<!-- durations:end -->"
_LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$")
sys.path.insert(0, str(REPO))
from tests.tiers import TIERS  # noqa: E402  (the tier names, in the order of the guide)


def run_tier(
    tier: str, workers: int, logs: pathlib.Path | None
) -> tuple[float, int, dict[str, float], int]:
    """``(wall seconds, tests run, seconds per test id, pytest's exit code)`` of one tier."""
    cmd = [sys.executable, "-m", "pytest", "-m", tier, "-q", "--durations=0", "-vv", "tests"]
    if workers > 1:
        cmd[3:3] = ["-n", str(workers), "--dist", "worksteal"]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{tier}.log").write_text(done.stdout + done.stderr)
    per_test: dict[str, float] = collections.defaultdict(float)
    for line in done.stdout.splitlines():
        if match := _LINE.match(line):
            per_test[match.group(2)] += float(match.group(1))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    count = sum(int(n) for n, word in re.findall(r"(\d+) (passed|failed|error)", summary))
    print(f"  {summary} ({wall:.0f} s)", flush=True)
    if done.returncode not in (0, 5):  # 5: the tier has no test
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return wall, count, per_test, done.returncode


def table(results: dict[str, tuple[float, int, dict[str, float], int]], workers: int) -> str:
    lines = [
        f"Measured {datetime.date.today()} on {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), {workers} pytest workers, by "
        "`python tools/test_durations.py`.",
        "",
        "| tier | tests | wall time | summed test time |",
        "| --- | ---: | ---: | ---: |",
    ]
    for tier, (wall, count, per_test, _) in results.items():
        lines.append(
            f"| `{tier}` | {count} | {wall / 60:.1f} min | {sum(per_test.values()) / 60:.1f} min |"
        )
    total = sum(r[0] for r in results.values())
    lines += [f"| all | {sum(r[1] for r in results.values())} | {total / 60:.1f} min | |", ""]
    slowest = sorted(
        ((sec, tier, test) for tier, r in results.items() for test, sec in r[2].items()),
        reverse=True,
    )[:30]
    lines += ["The 30 slowest tests:", "", "| seconds | tier | test |", "| ---: | --- | --- |"]
    lines += [f"| {sec:.1f} | `{tier}` | `{test}` |" for sec, tier, test in slowest]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma-separated tiers to run")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--check", action="store_true", help="print the table, write nothing")
    parser.add_argument("--logs", type=pathlib.Path, help="keep each tier's pytest output here")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        parser.error(f"unknown tiers {unknown}: choose from {', '.join(TIERS)}")
    results = {tier: run_tier(tier, args.workers, args.logs) for tier in tiers}
    text = table(results, args.workers)
    print(text)
    failed = [tier for tier, r in results.items() if r[3] not in (0, 5)]
    if not args.check:
        guide = GUIDE.read_text()
        head, _, rest = guide.partition(START)
        _, _, tail = rest.partition(END)
        if not rest:
            sys.exit(f"{GUIDE} has no {START} ... {END} markers to write between")
        GUIDE.write_text(f"{head}{START}\n{text}\n{END}{tail}")
        print(f"wrote {GUIDE.relative_to(REPO)}")
    if failed:
        sys.exit(f"tests failed in tiers {failed}: the table's times include the failures")


if __name__ == "__main__":
    main()
