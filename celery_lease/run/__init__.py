"""The run path: :class:`~celery_lease.run.task.LeasedTask` and one ``Attempt`` per delivery.

``task`` keeps Celery's hooks and the public lease API; ``attempt`` runs one
delivery (claim -> body -> outcome); ``republish``, ``duplicates`` and
``runids`` are functions over that attempt.
"""
