"""The run path's hooks: what a feature may do to a delivery, said once.

A feature (the rate limit, a pause, tracing, and whatever comes next) is one
:class:`RunHook` object. The run path (:class:`~celery_lease.run.attempt.Attempt`)
names no feature: it calls the hooks of its task at five points, in the order
the features were given, and a feature is called only at the points its class
overrides. A task whose features have nothing to do at a point pays nothing
there: :meth:`Hooks.of` keeps, per point, only the hooks that act at it, and
the run path tests one tuple.

The points, and what each may change:

- :meth:`RunHook.before_claim`: a worker delivery, before its claim. The only
  point that may take the delivery away (it has sent it again or kept it
  first) by returning what happened to it; it may also add keyword values to
  the claim (``delivery.claim_values``).
- :meth:`RunHook.claimed`: the claim took the run; the body runs next. Observe only.
- :meth:`RunHook.refused`: the claim did not take the run (``busy``, ``paused``,
  ``finished``). A hook that owns the refusal's outcome ends the delivery
  (raises, as Celery's ``Ignore``); the others observe.
- :meth:`RunHook.claim_failed`: the claim raised; the body does not run. Observe only.
- :meth:`RunHook.around`: around an operation of the lease (``complete``,
  ``fence``, ``checkpoint``) in the body's thread: a context manager, or None.
- :meth:`RunHook.finished`: the delivery is over, whatever happened to it,
  once for every delivery whose hooks began (so a hook can release what it
  holds for it).

What a hook keeps for one delivery it keeps in ``delivery.feature_state[hook]``.
A hook raising anything but the delivery's own end (``Ignore``, ``Reject``,
``Retry``) is a bug in that hook: the run path logs it and goes on without it,
so one feature can fail only itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from .config import LeaseConfig
    from .store import ClaimResult

#: The delivery a hook is handed (``celery_lease.run.delivery.Delivery``).
D = TypeVar("D")

#: The points of :class:`RunHook`, in the order a delivery meets them.
POINTS = ("before_claim", "claimed", "refused", "claim_failed", "around", "finished")


class RunHook(Generic[D]):
    """A feature on the run path; override the points it acts at (the others are never called).

    One object per app (or per task, from :meth:`for_task`); it holds no state of a
    single delivery on itself.
    """

    def for_task(self, task_name: str, config: LeaseConfig) -> RunHook[D] | None:
        """This feature's hook for the task ``task_name`` with settings ``config``, or None
        when the task does not use it (it then costs that task nothing). Asked once per
        task and settings."""
        return self

    def before_claim(self, delivery: D) -> str | None:
        """Before the claim of a worker delivery. Return None to go on, or what became of
        the delivery (e.g. ``"rate_limited"``) once this hook has sent it again or kept it:
        the delivery then ends there (Celery's ``Ignore``)."""
        return None

    def claimed(self, delivery: D, claim: ClaimResult) -> None:
        """The claim took the run; the body runs next."""

    def refused(self, delivery: D, claim: ClaimResult) -> None:
        """The claim did not take the run; the hook that owns ``claim.outcome`` ends the
        delivery by raising."""

    def claim_failed(self, delivery: D, error: BaseException) -> None:
        """The claim raised ``error``; the body does not run."""

    def around(
        self, delivery: D, operation: str, outcome: str
    ) -> AbstractContextManager[None] | None:
        """A context manager around the lease's ``operation`` (``complete``, ``fence``,
        ``checkpoint``), which ends in ``outcome`` (``completed``, ``fenced``, ``saved``)
        unless it raises; or None."""
        return None

    def finished(self, delivery: D, outcome: str) -> None:
        """The delivery is over: ``outcome`` says how (``succeeded``, ``failed``,
        ``retrying``, ``lost``, ``cancelled``, ``busy``, ``paused``, ``duplicate``,
        ``error``, ``ended``, or what :meth:`before_claim` returned)."""


def _acts_at(hook: RunHook[D], point: str) -> bool:
    """True when ``hook``'s class overrides ``point``."""
    return getattr(type(hook), point) is not getattr(RunHook, point)


@dataclasses.dataclass(frozen=True)
class Hooks(Generic[D]):
    """One task's hooks, per point: only those that act there, in the features' order."""

    before_claim: tuple[RunHook[D], ...] = ()
    claimed: tuple[RunHook[D], ...] = ()
    refused: tuple[RunHook[D], ...] = ()
    claim_failed: tuple[RunHook[D], ...] = ()
    around: tuple[RunHook[D], ...] = ()
    finished: tuple[RunHook[D], ...] = ()

    @classmethod
    def of(cls, hooks: Iterable[RunHook[D]]) -> Hooks[D]:
        """Sort ``hooks`` by the points each one acts at."""
        found = list(hooks)
        return cls(**{point: tuple(h for h in found if _acts_at(h, point)) for point in POINTS})

    @property
    def begin(self) -> bool:
        """True when a hook acts before or at the claim of a delivery that gets claimed
        (the run path's one test on its fast path)."""
        return bool(self.before_claim or self.claimed or self.finished)

    @classmethod
    def for_task(
        cls, features: Iterable[RunHook[D]], task_name: str, config: LeaseConfig
    ) -> Hooks[D]:
        """The hooks of the task ``task_name``: each feature's :meth:`RunHook.for_task`."""
        return cls.of(
            hook
            for hook in (feature.for_task(task_name, config) for feature in features)
            if hook is not None
        )
