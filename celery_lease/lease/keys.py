"""Names derived from a run: its idempotency keys and its follow-ups' task ids.

Both are pure functions of values the row keeps, so every attempt of a run
derives the same ones, whichever worker runs it. Their format is part of the
contract: a key that changed between two versions would charge twice across an
upgrade.

- :func:`idempotency_key`: ``<run id>:<step>:<generation>``, e.g.
  ``capture:900:charge:0``. A run id with a character outside
  ``[A-Za-z0-9._:-]``, or too long for the key to fit 255 characters, is replaced
  by its SHA-256 (64 hex digits) and the generation is written ``h<generation>``.
  ``step`` and the generation never hold ``:``, so a key is read back from its
  right end and two different (run, step, generation) never share a key.
- :func:`followup_task_id`: ``<run id>:followup:<attempt>.<position>``, the same
  way (SHA-256 and ``h`` when it would not fit 255 characters). ``attempt`` (the
  fencing token) never goes back and ``position`` counts the attempt's follow-ups,
  so no two follow-ups of any run share a task id.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import LeaseInputError

#: Longest idempotency key (and follow-up task id).
MAX_KEY_LENGTH = 255
#: Longest ``step`` of an idempotency key.
MAX_STEP_LENGTH = 64
#: The characters of an idempotency key.
KEY_CHARACTERS = "A-Za-z0-9._:-"
#: The characters of a ``step`` (no ``:``: the key's fields are read from its right end).
STEP_CHARACTERS = "A-Za-z0-9._-"

_KEY = re.compile(f"[{KEY_CHARACTERS}]+")
_STEP = re.compile(f"[{STEP_CHARACTERS}]*")
_STEP_CHARACTER = re.compile(f"[{STEP_CHARACTERS}]")


def check_step(step: object) -> str:
    """``step`` if an idempotency key can carry it, else :class:`LeaseInputError` (field
    ``step``) saying what is wrong: its type, its characters or its length."""
    if not isinstance(step, str):
        raise LeaseInputError("step", f"must be a str, got {type(step).__name__}")
    if len(step) > MAX_STEP_LENGTH:
        raise LeaseInputError(
            "step", f"is {len(step)} characters long; at most {MAX_STEP_LENGTH} are allowed"
        )
    if not _STEP.fullmatch(step):
        bad = "".join(sorted({c for c in step if not _STEP_CHARACTER.fullmatch(c)}))
        raise LeaseInputError(
            "step", f"{step!r} holds {bad!r}: only [{STEP_CHARACTERS}] are allowed"
        )
    return step


def _digest(run_id: str) -> str:
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()


def idempotency_key(run_id: str, generation: int, step: str = "") -> str:
    """The idempotency key of ``step`` of the run ``run_id`` in its ``generation``.

    At most 255 characters of ``[A-Za-z0-9._:-]``, whatever the run id holds.

    Raises:
        LeaseInputError: ``step`` is not a str of at most 64 characters of
            ``[A-Za-z0-9._-]``.
    """
    step = check_step(step)
    tail = f"{step}:{int(generation)}"
    if _KEY.fullmatch(run_id) and len(run_id) + 1 + len(tail) <= MAX_KEY_LENGTH:
        return f"{run_id}:{tail}"
    return f"{_digest(run_id)}:{step}:h{int(generation)}"


def followup_task_id(run_id: str, attempt: int, position: int) -> str:
    """The Celery task id of the ``position``-th follow-up (from 0) that ``attempt`` of
    the run ``run_id`` handed to a fenced transaction; at most 255 characters."""
    tail = f"followup:{int(attempt)}.{int(position)}"
    if len(run_id) + 1 + len(tail) <= MAX_KEY_LENGTH:
        return f"{run_id}:{tail}"
    return f"{_digest(run_id)}:followup:h{int(attempt)}.{int(position)}"
