"""README's results table, built from the `README row:` lines of docs/BENCHMARKS.md.

    python scripts/readme_results.py           # rewrite the table in README.md
    python scripts/readme_results.py --check   # exit 1 if README's table is not BENCHMARKS' rows

A row sits in BENCHMARKS.md under the measurement it summarises, as one line
`README row: what | figure`, so a figure is changed in one place, beside its command and date.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "README row: "
BEGIN = "<!-- results table: written by scripts/readme_results.py from docs/BENCHMARKS.md; edit the rows there -->"
END = "<!-- end of results table -->"


def rows(benchmarks: str) -> list[tuple[str, str]]:
    found = []
    for n, line in enumerate(benchmarks.splitlines(), 1):
        if line.startswith(PREFIX):
            what, sep, figure = line[len(PREFIX):].partition(" | ")
            if not sep or not what.strip() or not figure.strip() or "|" in figure:
                raise ValueError(f"docs/BENCHMARKS.md:{n}: a README row is `{PREFIX}what | figure`, one ' | ' in all")
            found.append((what.strip(), figure.strip()))
    if not found:
        raise ValueError(f"docs/BENCHMARKS.md has no `{PREFIX}` line")
    return found


def table(benchmarks: str) -> str:
    lines = [BEGIN, "| what | figure |", "| --- | --- |"]
    lines += [f"| {what} | {figure} |" for what, figure in rows(benchmarks)]
    return "\n".join([*lines, END])


def with_table(readme: str, benchmarks: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no results table between `{BEGIN}` and `{END}`")
    return readme[:start] + table(benchmarks) + readme[end + len(END):]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if README's table is out of date")
    p.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--benchmarks", default=os.path.join(ROOT, "docs", "BENCHMARKS.md"))
    args = p.parse_args()
    with open(args.readme, encoding="utf-8") as f:
        readme = f.read()
    with open(args.benchmarks, encoding="utf-8") as f:
        benchmarks = f.read()
    try:
        new = with_table(readme, benchmarks)
    except ValueError as e:
        print(f"readme_results.py: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != readme:
            print("readme_results.py: README's results table differs from docs/BENCHMARKS.md's rows; "
                  "run python scripts/readme_results.py", file=sys.stderr)
            return 1
        return 0
    if new != readme:
        with open(args.readme, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
