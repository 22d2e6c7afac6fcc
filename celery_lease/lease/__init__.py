"""One claim's lease, and the per-process threads that keep it honest.

- :mod:`.lease`: :class:`~celery_lease.lease.lease.Lease`, the state machine of
  one claim (one lock, every state change), and the current-lease context.
- :mod:`.interrupt`: the interrupter a lease holds, which raises
  :class:`~celery_lease.lease.interrupt.LeaseInterrupt` in the body thread
  when the lease says one is owed.
- :mod:`.watchdog`: the per-process thread acting on local deadlines, over a
  two-member interface (no lease import).
- :mod:`.heartbeat`: the per-database thread renewing leases; it reports what
  it learns to each lease, which decides.

Nothing here imports Celery.
"""
