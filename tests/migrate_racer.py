"""``celery -A tests.cli_app lease migrate`` started in lock-step with a sibling process.

Used by ``tests/test_migrations.py``: ``python -m tests.migrate_racer BARRIER_DIR NAME
[celery args...]``. Each racer announces itself in ``BARRIER_DIR`` and waits until
every expected racer is there, so they start migrating together. The migration
itself is slowed by ``CL_MIGRATE_DELAY`` seconds after the schema's revision is
read and before anything is created: the window in which two unlocked runs both
decide to create the table.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from alembic import command
from celery.bin.celery import main as celery_main


def _slow_upgrade(original: Any, delay: float) -> Any:
    def upgrade(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay)
        return original(*args, **kwargs)

    return upgrade


def main() -> None:
    barrier, name, *args = sys.argv[1:]
    folder = Path(barrier)
    expected = int(os.environ.get("CL_RACERS", "2"))
    (folder / name).touch()
    deadline = time.monotonic() + 30
    while len(list(folder.iterdir())) < expected:
        if time.monotonic() > deadline:
            sys.exit("racer: the other racers never arrived")
        time.sleep(0.005)
    delay = float(os.environ.get("CL_MIGRATE_DELAY", "0"))
    if delay:
        command.upgrade = _slow_upgrade(command.upgrade, delay)
    sys.argv = ["celery", "-A", "tests.cli_app", *args]
    celery_main()


if __name__ == "__main__":
    main()
