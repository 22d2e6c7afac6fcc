"""Reading a docs page's code blocks and running its commands, for the tests that run
the pages as written (tests/test_quickstart.py, tests/test_docs.py).

A Python block whose first line is ``# <path>`` is (part of) that file; blocks naming
the same file are joined in page order, as a reader would paste them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

DOCS = REPO / "docs"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FILE_HEADER = re.compile(r"# ([\w./-]+\.py)\n")


class Page:
    """One page of docs/, from the heading ``after`` on (the whole page without it)."""

    def __init__(self, name: str, after: str | None = None) -> None:
        self.path = DOCS / name
        self.text = self.path.read_text()
        self.body = self.text.split(after, 1)[1] if after else self.text

    def blocks(self, lang: str) -> list[str]:
        """The ``lang`` code blocks, in order."""
        return [code for kind, code in FENCE.findall(self.body) if kind == lang]

    def files(self) -> dict[str, str]:
        """The Python blocks that name their file, joined per file; every Python block
        must name one."""
        files: dict[str, str] = {}
        for code in self.blocks("python"):
            header = FILE_HEADER.match(code)
            assert header, f"{self.path.name}: a Python block names no file:\n{code}"
            files[header[1]] = files.get(header[1], "") + code
        return files

    def commands(self) -> list[list[str]]:
        """Every shell command of the ``bash`` blocks, as argv."""
        return [
            shlex.split(line, comments=True)
            for code in self.blocks("bash")
            for line in code.splitlines()
            if line.strip()
        ]

    def quoted(self, prefix: str) -> list[str]:
        """The inline-code phrases of the prose that start with ``prefix``."""
        prose = FENCE.sub("", self.text).replace("\n", " ")
        return [m for m in re.findall(r"`([^`]+)`", prose) if m.startswith(prefix)]


def write_files(files: dict[str, str], folder: Path) -> None:
    """Write ``{path: source}`` under ``folder``, creating packages' directories."""
    for name, code in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)


def argv(command: list[str]) -> list[str]:
    """``command`` with ``celery``/``python`` run by this interpreter."""
    if command[0] == "celery":
        return [sys.executable, "-m", "celery", *command[1:]]
    assert command[0] == "python", command
    return [sys.executable, *command[1:]]


def reader_env(**extra: str) -> dict[str, str]:
    """This environment without the test suite's ``CELERY_*`` variables: a reader's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.pop("PYTHONPATH", None)
    # A test of the Django pages may have set it in this process: a reader's shell has none.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return {**env, **extra}


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> str:
    """Run ``command`` in ``cwd``; its stdout, or fail with both outputs."""
    proc = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{command}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
