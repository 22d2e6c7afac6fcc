"""The wheel holds the ``celery_lease`` package alone (no example project, no tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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
