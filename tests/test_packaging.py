"""The wheel holds the ``celery_lease`` package alone (no example project, no tests), and
each extra brings what the library it drives needs."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")


@pytest.mark.timeout(120)
def test_wheel_holds_celery_lease_alone(tmp_path: Path) -> None:
    """``pip wheel`` (offline, this venv's setuptools) makes a wheel of celery_lease only."""
    pytest.importorskip("setuptools", minversion="77")  # in the test extra; PEP 639 license
    source = tmp_path / "src"  # a copy: the build leaves build/ and egg-info/ behind
    shutil.copytree(ROOT / "celery_lease", source / "celery_lease", ignore=_CACHES)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=110,
    )
    (wheel,) = (tmp_path / "dist").glob("celery_lease-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"celery_lease"}, top
    assert "celery_lease/cli/__init__.py" in names
    assert "celery_lease/migrations/versions/0001_create_runs.py" in names
    assert "celery_lease/py.typed" in names
    # The web view serves its own templates and assets (no CDN).
    for asset in ("templates/base.html", "templates/runs.html", "static/app.js", "static/app.css"):
        assert f"celery_lease/web/{asset}" in names


#: Each extra of ours and the upstream extras it stands for: what the library it drives
#: needs to work, as that library declares it (kombu's Redis transport imports
#: ``packaging``, which only ``kombu[redis]`` brings).
UPSTREAM_EXTRAS = {
    "redis": [("kombu", "redis")],
    "postgres": [("sqlalchemy", "postgresql-psycopg")],
    "mysql": [("sqlalchemy", "pymysql")],
}


def _requirements(dist: str, extras: frozenset[str]) -> list[Any]:
    """``dist``'s installed requirements that apply with ``extras`` (base ones included)."""
    from packaging.requirements import Requirement

    found = []
    for line in importlib.metadata.requires(dist) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in {"", *extras}):
            found.append(requirement)
    return found


def _closure(requirements: list[Any]) -> set[str]:
    """The normalized names of every distribution ``requirements`` pull in, extras followed
    (through the installed metadata: the test venv holds every extra)."""
    from packaging.utils import canonicalize_name

    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(name)
        try:
            todo += _requirements(name, key[1])
        except importlib.metadata.PackageNotFoundError:
            continue  # not for this Python or platform: nothing of it is imported here
    return names


@pytest.mark.parametrize("extra", sorted(UPSTREAM_EXTRAS))
def test_each_extra_brings_what_its_library_needs(extra: str) -> None:
    """``celery-lease[<extra>]`` alone pulls in every requirement of the upstream extra it
    stands for (``redis`` -> ``kombu[redis]``, so kombu's Redis transport imports)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; CI's main run has it
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = [Requirement(line) for line in declared["optional-dependencies"][extra]]
    ours += [Requirement(line) for line in declared["dependencies"]]
    pulled = _closure(ours)
    for dist, upstream in UPSTREAM_EXTRAS[extra]:
        needed = {
            canonicalize_name(requirement.name)
            for requirement in _requirements(dist, frozenset({upstream}))
            if requirement.marker is not None and "extra" in str(requirement.marker)
        }
        assert needed, f"{dist} declares no extra {upstream!r}"
        assert needed <= pulled, f"celery-lease[{extra}] lacks {sorted(needed - pulled)}"
