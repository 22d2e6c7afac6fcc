"""Root pytest configuration.

pytest-celery 1.x replaces the classic ``celery_worker`` fixture with a Docker
one; load Celery's own plugin to get the in-process fixtures back. Worker tests
start real ``celery worker`` subprocesses themselves (see tests/helpers.py).
"""

import pytest

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(scope="session")
def docker_client() -> None:
    """No Docker engine here: pytest-celery's container tests skip."""
    pytest.skip("no Docker engine available for pytest-celery containers")
