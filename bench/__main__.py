"""Rebuild the tables of bench/README.md from the newest full result of each benchmark.

    python -m bench [--results-dir bench/results] [--readme bench/README.md]

Quick (``--quick``) results are never shown, and files below the results directory (such as
``bench/results/tmp/``) are not read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import common, tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=common.README)
    args = parser.parse_args(argv)
    results = tables.newest_results(args.results_dir)
    tables.update_readme(tables.render_tables(results, common.BENCHMARKS), args.readme)
    shown = ", ".join(f"{name} ({data['_file']})" for name, data in sorted(results.items()))
    print(f"[bench] {args.readme}: tables from {shown or 'no results yet'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
