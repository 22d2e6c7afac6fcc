"""The hot path of this checkout against another revision's, side by side in one run.

For a refactor that must not slow anything down: ``per_task`` of
``benchmarks/sql.py`` (SQL statements and pool checkouts per task, and the
added wall and CPU milliseconds of an in-process ``LeasedTask`` run over a plain
task) is measured in a fresh interpreter in each tree, alternating between
the two trees round by round, so that the machine's other load falls on both
alike. Each tree imports its own ``celery_lease`` (the tree is the working
directory, first on ``sys.path``).

    git worktree add --detach /tmp/baseline <revision>
    python -m benchmarks.compare --baseline /tmp/baseline --rounds 5

PostgreSQL is measured too when ``CELERY_LEASE_BENCH_PG_URL`` is set.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import REPO, median, pg_admin_url, table

_MEASURE = (
    "import json, sys; from benchmarks.sql import per_task; "
    "print(json.dumps(per_task(sys.argv[1], int(sys.argv[2]))))"
)


def measure(tree: Path, url: str, n: int) -> dict[str, float]:
    """``per_task`` of ``tree``'s own code, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, url, str(n)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"measuring {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare")
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=1000)
    args = parser.parse_args(argv)
    if not (args.baseline / "celery_lease" / "__init__.py").is_file():
        parser.error(f"{args.baseline} is not a celery-lease checkout")
    work = Path(tempfile.mkdtemp(prefix="compare"))
    databases = [("SQLite", "sqlite")]
    pg_url = pg_admin_url()
    if pg_url:
        databases.append(("PostgreSQL", pg_url))
    trees = [("baseline", args.baseline.resolve()), ("this checkout", REPO)]
    rows: list[list[Any]] = []
    for label, kind in databases:
        got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for name, tree in order:
                url = kind
                if kind == "sqlite":
                    slug = name.replace(" ", "_")
                    url = f"sqlite:///{work / f'{slug}-{round_}.sqlite3'}"
                got[name].append(measure(tree, url, args.tasks))
                print(f"  {label} round {round_ + 1} {name}: {got[name][-1]}", flush=True)
        cpu = {name: median([r["added_cpu_ms"] for r in got[name]]) for name, _ in trees}
        wall = {name: median([r["added_ms"] for r in got[name]]) for name, _ in trees}
        for name, _ in trees:
            rows.append(
                [
                    label,
                    name,
                    got[name][-1]["statements"],
                    got[name][-1]["checkouts"],
                    f"{wall[name]:.3f}",
                    f"{cpu[name]:.3f}",
                ]
            )
        ratio = cpu["this checkout"] / cpu["baseline"] if cpu["baseline"] else float("nan")
        rows.append([label, "ratio (this / baseline)", "", "", "", f"{ratio:.2f}"])
    print()
    print(
        table(
            [
                "lease database",
                "code",
                "SQL statements / task",
                "pool checkouts / task",
                "added ms / task (median)",
                "added CPU ms / task (median)",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
