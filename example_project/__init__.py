"""A small shop that captures order payments with celery-lease.

``python -m example_project demo`` runs it end to end: two real workers, beat,
a worker paused past its lease and one killed with SIGKILL, and a summary that
checks every order was captured exactly once. See ``example_project/README.md``.
"""
