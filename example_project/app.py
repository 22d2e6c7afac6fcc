"""The shop's Celery app: ``celery -A example_project.app worker`` / ``beat``.

Configured from ``EXAMPLE_*`` environment variables (see settings.py). Beat
runs two schedules: celery-lease's sweeper (added by ``install(app)``, which
``LeasedTask`` calls) and the shop's own resubmission of stalled captures.
"""

from __future__ import annotations

from celery import Celery

from .settings import Settings

settings = Settings.from_env()
settings.make_folders()

app = Celery("example_project", include=["example_project.tasks"])
app.conf.update(settings.celery_conf())
# Set before the tasks are bound: install(app) adds its sweeper entry to this dict.
app.conf.beat_schedule = {
    "resubmit-stalled-captures": {
        "task": "example_project.resubmit_stalled_captures",
        "schedule": settings.timings.resubmit_interval,
    }
}
