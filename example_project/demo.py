"""``python -m example_project demo``: the shop end to end with real workers.

Two ``celery worker`` processes (alpha, bravo) and ``celery beat`` capture a
stream of orders. Midway, alpha is frozen with SIGSTOP past its lease (bravo
takes its runs over, and alpha's late completion is refused once it thaws),
then killed with SIGKILL after the gateway charged one of its captures and
before that capture committed (the sweeper re-enqueues its runs, bravo finishes
them, and the gateway answers bravo's call, made with the same idempotency key,
with the first charge: one charge). Each capture sends a receipt as a follow-up
task, only once it has committed. Meanwhile a third worker (charlie) exports a
few hundred past orders; it is killed with SIGKILL mid-export and a fourth
(delta) resumes the export from its checkpoint. The summary is computed from the database and the
workers' logs, and the exit status is non-zero if any invariant fails.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from celery_lease import store_for

from .processes import PROJECT_ROOT, CeleryProcess

T = TypeVar("T")

MERCHANTS = ("bakery", "bookshop", "florist", "cycles")


def merchant_of(number: int) -> str:
    """Half the orders go to the bakery, so its two capture slots fill up."""
    return MERCHANTS[0] if number % 2 else MERCHANTS[1 + (number // 2) % 3]


#: Past orders the export job sends to the warehouse, and its latency per order (s).
EXPORT_ORDERS = 300
EXPORT_PAUSE = 0.01
#: charlie is killed once this many orders are exported (checkpointed).
EXPORT_KILL_AT = 90

#: Seconds between two orders arriving; every fifth order is submitted twice.
ORDER_SPACING = 0.4
DUPLICATE_EVERY = 5
DUPLICATE_DELAY = 1.0
#: The last third of the orders arrives only once the SIGSTOP step is over, so the SIGKILL
#: step always finds captures to interrupt, however long a loaded machine took to take
#: the frozen capture over.
HELD_BACK_SHARE = 3


class DemoFailed(Exception):
    """A step of the demo could not happen (a worker died, a wait timed out)."""


@dataclasses.dataclass(frozen=True)
class Submission:
    """One enqueue the demo will make, ``due`` seconds after the start."""

    due: float
    order_id: str
    merchant_id: str
    first: bool


def _mask(url: str) -> str:
    """``url`` without its password, for printing."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


class ProgressBar:
    """A plain text bar on stderr, redrawn in place with ``\\r``."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = total
        self.width = width
        self.shown: str | None = None

    def draw(self, done: int, note: str = "") -> None:
        filled = self.width * done // max(self.total, 1)
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} captured"
        if note:
            text += f"  {note}"
        if text != self.shown:
            sys.stderr.write("\r" + text.ljust(len(self.shown or "")))
            sys.stderr.flush()
            self.shown = text

    def clear(self) -> None:
        if self.shown is not None:
            sys.stderr.write("\r" + " " * len(self.shown) + "\r")
            sys.stderr.flush()
            self.shown = None

    def finish(self) -> None:
        if self.shown is not None:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.shown = None


class Demo:
    """One run of the demo in ``workdir``; :meth:`run` returns the exit status."""

    def __init__(self, workdir: Path, orders: int, timeout: float, temporary: bool = False) -> None:
        self.workdir = workdir
        self.temporary = temporary
        self.order_count = orders
        self.timeout = timeout
        self.batch = uuid.uuid4().hex[:6]
        self.env = {
            **os.environ,
            "EXAMPLE_WORKDIR": str(workdir),
            "EXAMPLE_TIMINGS": "demo",
            "EXAMPLE_QUEUE": f"shop-{self.batch}",
        }
        # The demo process is a producer of the same app: configure it the same way.
        os.environ.update(self.env)
        from . import tasks
        from .app import app, settings

        self.tasks = tasks
        self.app = app
        self.settings = settings
        self.store = store_for(app)
        self.engine = tasks.read_engine()
        self.processes: list[CeleryProcess] = []
        self.bar = ProgressBar(orders)
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.plan = self._plan()
        self.held_back_from = orders - orders // HELD_BACK_SHARE + 1  # the first order held
        self.holding_back = True
        self.notes: list[str] = []
        #: The captures alpha was killed between the gateway's reply and the commit of.
        self.charged_at_kill: list[str] = []
        self.killed: set[str] = set()
        # The export's key (its run id reads "export:hist-<batch>"); its orders are
        # "hist-<batch>-001" and on.
        self.export_prefix = f"hist-{self.batch}"
        self.export_run = tasks.export_orders.lease_run_id(self.export_prefix)
        self.export_resumed_at: int | None = None

    # -- output ---------------------------------------------------------------

    def say(self, message: str = "") -> None:
        """Print a line of the story on stdout, keeping the bar below it."""
        self.bar.clear()
        print(message, flush=True)

    # -- set-up -----------------------------------------------------------------

    def _order_id(self, number: int) -> str:
        return f"ord-{self.batch}-{number:03d}"

    @staticmethod
    def _number(sub: Submission) -> int:
        return int(sub.order_id.rsplit("-", 1)[-1])

    def _plan(self) -> collections.deque[Submission]:
        plan = []
        for n in range(1, self.order_count + 1):
            merchant = merchant_of(n)
            plan.append(Submission(n * ORDER_SPACING, self._order_id(n), merchant, True))
            if n % DUPLICATE_EVERY == 0:
                due = n * ORDER_SPACING + DUPLICATE_DELAY
                plan.append(Submission(due, self._order_id(n), merchant, False))
        return collections.deque(sorted(plan, key=lambda s: s.due))

    def prepare_database(self) -> None:
        """Lease table (``celery lease migrate`` off SQLite) and the shop's own tables."""
        from .tables import metadata

        if self.store.db.dialect != "sqlite":
            proc = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "example_project.app", "lease", "migrate"],
                env={**self.env, "PYTHONPATH": str(PROJECT_ROOT)},
                cwd=str(self.workdir),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode != 0:
                raise DemoFailed(f"celery lease migrate failed:\n{proc.stdout}{proc.stderr}")
            self.say(f"  {proc.stdout.strip()}")
        metadata.create_all(self.engine)
        self.place_past_orders()

    def place_past_orders(self) -> None:
        """The orders the export job sends: already captured, in one insert."""
        from sqlalchemy import insert

        from .tables import orders

        now = self.store.now_ms()
        rows = [
            {
                "id": f"{self.export_prefix}-{n:03d}",
                "merchant_id": merchant_of(n),
                "amount_cents": 1000 + (n * 1379) % 9000,
                "currency": "EUR",
                "status": "captured",
                "submitted_at_ms": now,
            }
            for n in range(1, EXPORT_ORDERS + 1)
        ]
        with self.tasks.shop_engine().begin() as conn:
            conn.execute(insert(orders), rows)

    def start(self) -> tuple[CeleryProcess, CeleryProcess]:
        alpha = CeleryProcess.worker("alpha", self.env, self.workdir)
        self.processes.append(alpha)
        bravo = CeleryProcess.worker("bravo", self.env, self.workdir)
        self.processes.append(bravo)
        beat = CeleryProcess.beat(self.env, self.workdir)
        self.processes.append(beat)
        charlie = self.exporter("charlie")
        alpha.wait_ready()
        bravo.wait_ready()
        charlie.wait_ready()
        self.say(
            f"started worker alpha (pid {alpha.pid}), worker bravo (pid {bravo.pid}), "
            f"beat (pid {beat.pid}); 2 pool processes each; exporter charlie (pid {charlie.pid})"
        )
        self.started = time.monotonic()
        return alpha, bravo

    def exporter(self, name: str) -> CeleryProcess:
        """A worker with one pool process consuming only the export queue."""
        proc = CeleryProcess.worker(
            name, self.env, self.workdir, queues=[self.settings.export_queue], concurrency=1
        )
        self.processes.append(proc)
        return proc

    def kill_mid_export(self) -> None:
        """Start the export; SIGKILL charlie once it has checkpointed; delta resumes it."""
        self.tasks.export_orders.apply_async(args=(self.export_prefix, EXPORT_PAUSE))

        def checkpointed() -> int:
            row = self.store.get(self.export_run)
            saved = 0 if row is None or row.checkpoint is None else int(row.checkpoint)
            return saved if saved >= EXPORT_KILL_AT else 0

        if not self.wait_until(checkpointed, 30):
            raise DemoFailed(f"the export never checkpointed {EXPORT_KILL_AT} orders")
        charlie = next(p for p in self.processes if p.name == "charlie")
        charlie.kill9()
        self.killed.add("charlie")
        row = self.store.get(self.export_run)
        saved = 0 if row is None or row.checkpoint is None else int(row.checkpoint)
        self.export_resumed_at = saved
        self.say(
            f"SIGKILL charlie (pid {charlie.pid}) mid-export of {self.export_run}: "
            f"checkpoint at {saved} of {EXPORT_ORDERS} orders; exporter delta takes over"
        )
        self.exporter("delta")  # ready in the background; the sweeper hands it the run

    def say_export(self) -> None:
        """Tell who finished the export and where it resumed."""
        from sqlalchemy import func, select

        from .tables import exports

        row = self.store.get(self.export_run)
        with self.engine.connect() as conn:
            first = conn.execute(
                select(func.min(exports.c.id)).where(
                    exports.c.order_id.like(self.export_prefix + "%"), exports.c.attempt > 1
                )
            ).scalar()
            resumed_with = (
                None
                if first is None
                else conn.execute(select(exports.c.order_id).where(exports.c.id == first)).scalar()
            )
        if row is None or row.status != "succeeded":
            self.notes.append(f"{self.export_run} did not finish")
            return
        worker = (row.lease_owner or "?").split("@")[0]
        self.say(
            f"  {self.export_run}: resumed by {worker} on attempt {row.attempt} at order "
            f"{resumed_with} (checkpoint {self.export_resumed_at}); "
            f"{EXPORT_ORDERS} orders exported"
        )

    # -- the loop ---------------------------------------------------------------

    def captured(self) -> int:
        from sqlalchemy import func, select

        from .tables import orders

        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).where(
                        orders.c.id.like(f"ord-{self.batch}-%"), orders.c.status == "captured"
                    )
                ).scalar_one()
            )

    def tick(self) -> None:
        """Submit the orders that are due, check the processes, redraw the bar."""
        elapsed = time.monotonic() - self.started
        while self.plan and self.plan[0].due <= elapsed:
            if self.holding_back and self._number(self.plan[0]) >= self.held_back_from:
                break
            sub = self.plan.popleft()
            if sub.first:
                number = self._number(sub)
                amount = 1000 + (number * 1379) % 9000
                self.tasks.place_order(sub.order_id, sub.merchant_id, amount)
            self.tasks.submit_capture(sub.order_id, sub.merchant_id)
        if time.monotonic() > self.deadline:
            raise DemoFailed(f"the demo did not finish within {self.timeout:.0f} s")
        for proc in self.processes:
            if proc.name not in self.killed and not proc.alive():
                raise DemoFailed(f"{proc.name} exited unexpectedly:\n{proc.log()[-3000:]}")
        left = len({s.order_id for s in self.plan if s.first})
        self.bar.draw(self.captured(), f"({left} orders still to arrive)" if left else "")

    def wait_until(self, predicate: Callable[[], T], timeout: float) -> T | None:
        """Run the loop until ``predicate()`` is truthy; None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.tick()
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def held_by(
        self, worker: str, *, fresh_ms: int | None = None, min_age_ms: int = 0
    ) -> list[Any]:
        """Capture runs of this demo running on ``worker`` with a live lease."""
        now = self.store.now_ms()
        held = []
        for run in self.store.reads.list_runs(status="running", limit=1000):
            if not run.id.startswith(f"capture:ord-{self.batch}-"):
                continue
            if not (run.lease_owner or "").startswith(f"{worker}@"):
                continue
            if (run.lease_expires_at or 0) <= now:
                continue
            # started_at is the first claim; fresh means claimed moments ago.
            age = now - (run.started_at or 0)
            if fresh_ms is not None and (run.attempt != 1 or not min_age_ms <= age <= fresh_ms):
                continue
            held.append(run)
        return held

    # -- the story ----------------------------------------------------------------

    def pause_past_lease(self, alpha: CeleryProcess) -> None:
        """SIGSTOP the alpha pool process mid-capture; bravo takes over; its late finish is refused.

        Only the one process is frozen (a long GC pause, a stalled VM), while it
        waits on the gateway: frozen inside a database transaction instead, it
        would keep its locks and stall everyone until it thawed.
        """
        # Let both workers capture a few orders first.
        self.wait_until(lambda: self.captured() >= 4, 20)
        held = self.wait_until(lambda: self.held_by("alpha", fresh_ms=600, min_age_ms=150), 20)
        if not held:
            raise DemoFailed("alpha never started a capture")
        run = held[0]
        pid = int((run.lease_owner or "").rsplit(":", 2)[1])  # owner is host:pid:uuid
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            group = None
        if group != alpha.pid:  # only ever signal a process this demo started
            raise DemoFailed(f"pid {pid} is not one of alpha's pool processes")
        ids = [run.id]
        os.kill(pid, signal.SIGSTOP)
        self.say(
            f"SIGSTOP alpha's pool process {pid} mid-capture of {run.id} "
            f"(lease {self.settings.timings.lease_seconds:g} s): frozen past its lease"
        )
        try:
            done = self.wait_until(
                lambda: all((r := self.store.get(i)) and r.status == "succeeded" for i in ids), 25
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        for run_id in ids:
            self.say_takeover(run_id)
        if not done:
            self.notes.append("the frozen run was not taken over before SIGCONT")
        self.say(f"SIGCONT {pid}: it wakes up and tries to finish {', '.join(ids)}")
        pattern = re.compile(
            rf"(automation_run_lease_lost: run ({'|'.join(map(re.escape, ids))}) .*)"
        )

        def refusals() -> dict[str, str]:
            found = {m.group(2): m.group(1) for m in pattern.finditer(alpha.log())}
            return found if len(found) == len(ids) else {}

        self.wait_until(refusals, 15)
        found = {m.group(2): m.group(1) for m in pattern.finditer(alpha.log())}
        for run_id in ids:
            if run_id not in found:
                self.notes.append(f"no refusal for {run_id} seen in alpha's log")
                continue
            # The owner's random part only makes the line longer.
            line = re.sub(r"(owner \S+?:\d+:)[0-9a-f]{32}", r"\1…", found[run_id])
            self.say(f"  refused: {line}")

    def charged_uncommitted(self) -> set[str]:
        """Orders of this demo the gateway has charged and whose capture has not committed."""
        from sqlalchemy import select

        from .tables import gateway_charges, orders

        with self.engine.connect() as conn:
            return set(
                conn.execute(
                    select(gateway_charges.c.order_id)
                    .join(orders, orders.c.id == gateway_charges.c.order_id)
                    .where(
                        gateway_charges.c.order_id.like(f"ord-{self.batch}-%"),
                        orders.c.status == "pending",
                    )
                ).scalars()
            )

    def kill_mid_run(self, alpha: CeleryProcess) -> list[str]:
        """SIGKILL alpha after the gateway charged one of its captures and before that
        capture committed; the sweeper hands its runs to bravo, whose attempt sends the
        gateway the same idempotency key and gets the first charge back."""

        def charged_by_alpha() -> list[Any]:
            charged = self.charged_uncommitted()
            return [r for r in self.held_by("alpha") if r.id.split(":", 1)[1] in charged]

        self.holding_back = False  # the last orders arrive now, late ones at once
        found = self.wait_until(charged_by_alpha, 25)
        if not found:
            raise DemoFailed("alpha never held a charged capture to kill it before the commit")
        held = self.held_by("alpha")
        alpha.kill9()
        self.killed.add("alpha")
        charged = [run.id for run in found]
        self.charged_at_kill = charged
        others = [run.id for run in held if run.id not in charged]
        self.say(
            f"SIGKILL alpha (pid {alpha.pid}) between the gateway's reply and the commit of "
            f"{', '.join(charged)}" + (f"; also mid-capture: {', '.join(others)}" if others else "")
        )
        ids = charged + others
        self.wait_until(
            lambda: all((r := self.store.get(i)) and r.status == "succeeded" for i in ids), 30
        )
        for run_id in ids:
            if not self.say_takeover(run_id):
                self.notes.append(f"{run_id} was not recovered within 30 s of the kill")
        for run_id in charged:
            self.say_gateway(run_id)
        return ids

    def say_gateway(self, run_id: str) -> None:
        """Tell how the gateway answered the capture alpha was killed after charging."""
        from sqlalchemy import select

        from .tables import gateway_charges

        order_id = run_id.split(":", 1)[1]
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(gateway_charges).where(gateway_charges.c.order_id == order_id)
            ).all()
        row = self.store.get(run_id)
        attempt = "?" if row is None else row.attempt
        if len(rows) == 1 and rows[0].replays:
            self.say(
                f"  {run_id}: attempt {attempt} sent the gateway the same key "
                f"({rows[0].idempotency_key}): answered with the first charge; charged once"
            )
        else:
            self.notes.append(
                f"{run_id}: {len(rows)} gateway charges, "
                f"{sum(r.replays for r in rows)} replays after the kill"
            )

    def say_takeover(self, run_id: str) -> bool:
        """Tell who finished ``run_id`` after its lease expired; False if nobody yet."""
        row = self.store.get(run_id)
        if row is None or row.status != "succeeded":
            return False
        # The row's recovery history says what happened (no claim resets it).
        if row.republishes:
            how = "swept and re-enqueued"
        elif row.takeovers:
            how = "claimed by another delivery"
        else:
            how = "handed back and claimed again"
        worker = (row.lease_owner or "?").split("@")[0]
        self.say(f"  {run_id}: lease expired, {how}, captured by {worker} on attempt {row.attempt}")
        return True

    def finish(self) -> bool:
        """Wait until every order is captured and every run is terminal."""
        remaining = max(1.0, self.deadline - time.monotonic())
        return bool(self.wait_until(lambda: not self.plan and self.all_done(), remaining))

    def all_done(self) -> bool:
        if self.captured() < self.order_count or self.receipts_sent() < self.order_count:
            return False
        export = self.store.get(self.export_run)
        if export is None or not export.terminal:
            return False
        runs = self.runs()
        return len(runs) == self.order_count and all(r.terminal for r in runs)

    def receipts_sent(self) -> int:
        from sqlalchemy import func, select

        from .tables import receipts

        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count(func.distinct(receipts.c.order_id))).where(
                        receipts.c.order_id.like(f"ord-{self.batch}-%")
                    )
                ).scalar_one()
            )

    def runs(self) -> list[Any]:
        return [
            run
            for run in self.store.reads.list_runs(
                task_name=self.tasks.capture_payment.name, limit=10_000
            )
            if run.id.startswith(f"capture:ord-{self.batch}-")
        ]

    # -- the summary ----------------------------------------------------------------

    def logs(self) -> str:
        return "\n".join(proc.log() for proc in self.processes)

    def summary(self) -> bool:
        """Print the table and the invariants; True when every invariant holds."""
        from sqlalchemy import select

        from .tables import exports, gateway_charges, orders, payments, receipts

        prefix = f"ord-{self.batch}-"
        with self.engine.connect() as conn:
            order_rows = conn.execute(select(orders).where(orders.c.id.like(prefix + "%"))).all()
            pay_rows = conn.execute(
                select(payments).where(payments.c.order_id.like(prefix + "%"))
            ).all()
            charge_rows = conn.execute(
                select(gateway_charges).where(gateway_charges.c.order_id.like(prefix + "%"))
            ).all()
            receipt_rows = conn.execute(
                select(receipts).where(receipts.c.order_id.like(prefix + "%"))
            ).all()
            export_rows = conn.execute(
                select(exports).where(exports.c.order_id.like(self.export_prefix + "%"))
            ).all()
        per_export = collections.Counter(e.order_id for e in export_rows)
        exported_twice = sorted(o for o, n in per_export.items() if n > 1)
        export_run = self.store.get(self.export_run)
        runs = {run.id: run for run in self.runs()}
        logs = self.logs()
        run_re = rf"capture:{re.escape(prefix)}\d+"

        def distinct(pattern: str) -> set[str]:
            return set(re.findall(pattern, logs))

        per_order = collections.Counter(p.order_id for p in pay_rows)
        double = sorted(order_id for order_id, n in per_order.items() if n > 1)
        charges = collections.Counter(c.order_id for c in charge_rows)
        charged_twice = sorted(o for o, n in charges.items() if n > 1)
        receipted = collections.Counter(r.order_id for r in receipt_rows)
        receipted_twice = sorted(o for o, n in receipted.items() if n > 1)
        succeeded = sum(1 for r in runs.values() if r.status == "succeeded")
        retried = sum(1 for r in runs.values() if r.attempt > 1)
        refused = set(re.findall(rf"automation_run_lease_lost: run ({run_re}) attempt (\d+)", logs))
        by_worker = collections.Counter(p.captured_by.split("@")[0] for p in pay_rows)
        rows = [
            ("orders", len(order_rows)),
            ("runs", len(runs)),
            ("succeeded", succeeded),
            ("retried (attempt > 1)", retried),
            (
                "recovered by the sweeper",
                len(distinct(rf"run ({run_re}): re-enqueued \(expired\)")),
            ),
            (
                "waiting runs re-enqueued",
                len(distinct(rf"run ({run_re}): re-enqueued \(stranded\)")),
            ),
            (
                "orders resubmitted by the shop",
                len(distinct(rf"order ({re.escape(prefix)}\d+): capture never started")),
            ),
            ("stale completions refused", len(refused)),
            (
                "gateway timeouts retried",
                len(distinct(rf"run ({run_re}) attempt \d+/\d+ raised GatewayTimeout -> retrying")),
            ),
            (
                "deliveries dropped (run done)",
                len(re.findall(rf"run {run_re} is already succeeded", logs)),
            ),
            (
                "waits for a merchant slot",
                len(re.findall(rf"run {run_re}: concurrency limit reached", logs)),
            ),
            ("peak captures per merchant", self.peak_per_merchant(pay_rows)),
            ("payments committed", len(pay_rows)),
            ("double commits", len(double)),
            ("gateway charges", len(charge_rows)),
            ("gateway calls answered by key", sum(c.replays for c in charge_rows)),
            ("orders charged twice", len(charged_twice)),
            ("receipts sent", len(receipt_rows)),
            ("receipts sent twice", len(receipted_twice)),
            ("orders exported", len(per_export)),
            ("export attempts", 0 if export_run is None else export_run.attempt),
            ("orders exported twice", len(exported_twice)),
        ]
        self.say("")
        self.say("summary")
        for label, value in rows:
            self.say(f"  {label:<32}{value:>6}")
        self.say(
            "  captured by: "
            + ", ".join(f"{name} {count}" for name, count in sorted(by_worker.items()))
        )

        failures = []
        orders_by_id = {o.id: o for o in order_rows}
        if len(order_rows) != self.order_count:
            failures.append(f"{len(order_rows)} orders recorded, expected {self.order_count}")
        not_once = sorted(o for o in orders_by_id if per_order.get(o, 0) != 1)
        not_captured = sorted(o.id for o in order_rows if o.status != "captured")
        if not_once or not_captured:
            failures.append(
                f"orders not captured exactly once: {', '.join(sorted({*not_once, *not_captured}))}"
            )
        if double:
            failures.append(f"double commits: {', '.join(double)}")
        open_runs = sorted(r.id for r in runs.values() if not r.terminal)
        run_id_of = self.tasks.capture_payment.lease_run_id
        missing = sorted(o for o in orders_by_id if run_id_of(o, "") not in runs)
        if open_runs or missing:
            failures.append(f"runs not terminal: {', '.join(open_runs + missing)}")
        for pay in pay_rows:
            run = runs.get(run_id_of(pay.order_id, ""))
            if run is None or (run.attempt, run.lease_owner) != (
                pay.fencing_token,
                pay.captured_by,
            ):
                failures.append(f"{pay.order_id}: payment not written by the run's final owner")
        refs = {c.order_id: c.ref for c in charge_rows}
        not_charged_once = sorted(o for o in orders_by_id if charges.get(o, 0) != 1)
        if not_charged_once:
            failures.append(f"orders not charged exactly once: {', '.join(not_charged_once)}")
        if any(refs.get(p.order_id) != p.gateway_ref for p in pay_rows):
            failures.append("a payment records another charge than the gateway's")
        not_receipted = sorted(o for o in orders_by_id if receipted.get(o, 0) != 1)
        if not_receipted:
            failures.append(f"receipts not sent exactly once: {', '.join(not_receipted)}")
        replayed = {c.order_id for c in charge_rows if c.replays}
        if not self.charged_at_kill or any(
            run_id.split(":", 1)[1] not in replayed for run_id in self.charged_at_kill
        ):
            failures.append("the capture killed after its charge was not answered by its key")
        peak = self.peak_per_merchant(pay_rows)
        if peak > self.tasks.MAX_CAPTURES_PER_MERCHANT:
            failures.append(f"{peak} captures of one merchant overlapped")
        if len(per_export) != EXPORT_ORDERS or exported_twice:
            failures.append(
                f"{len(per_export)} of {EXPORT_ORDERS} orders exported, {len(exported_twice)} twice"
            )
        before_kill = [e for e in export_rows if e.attempt == 1]
        if (
            export_run is None
            or export_run.attempt < 2
            or (len(before_kill) != self.export_resumed_at)
        ):
            failures.append("the export did not resume from the checkpoint of its killed worker")

        self.say("")
        if failures:
            for failure in failures:
                self.say(f"INVARIANT FAILED: {failure}")
        else:
            self.say(
                "invariants hold: every order captured exactly once, every run terminal, "
                "no double commit, each order charged once at the gateway (the capture "
                "killed after its charge too), each receipt sent once, "
                "each payment fenced by its run's final attempt, "
                f"at most {self.tasks.MAX_CAPTURES_PER_MERCHANT} captures per merchant at once, "
                "the export resumed from its checkpoint with no order exported twice"
            )
        for note in self.notes:
            self.say(f"note: {note}")
        return not failures

    @staticmethod
    def peak_per_merchant(pay_rows: Sequence[Any]) -> int:
        """Most committed captures of one merchant whose bodies overlapped in time."""
        peak = 0
        for merchant in {p.merchant_id for p in pay_rows}:
            events = []
            for p in pay_rows:
                if p.merchant_id == merchant:
                    events += [(p.body_started_at, 1), (p.committed_at, -1)]
            depth = 0
            for _, step in sorted(events, key=lambda e: (e[0], e[1])):
                depth += step
                peak = max(peak, depth)
        return peak

    # -- all together ---------------------------------------------------------------

    def run(self) -> int:
        s = self.settings
        t = s.timings
        broker = _mask(s.broker_url)
        if s.broker_folder is not None:
            broker += f" (folder {s.broker_folder})"
        duplicates = self.order_count // DUPLICATE_EVERY
        self.say(
            f"celery-lease demo: {self.order_count} orders ({duplicates} submitted twice), "
            f"{len(MERCHANTS)} merchants, at most {self.tasks.MAX_CAPTURES_PER_MERCHANT} "
            "captures per merchant at once"
        )
        self.say(f"  lease database  {_mask(s.database_url)}")
        self.say(f"  broker          {broker}")
        self.say(
            f"  lease {t.lease_seconds:g} s, heartbeat {t.lease_seconds / 3:g} s, "
            f"sweeper every {t.sweep_interval:g} s"
        )
        self.say(f"  {workdir_note(self.workdir, self.temporary)}")
        self.prepare_database()
        alpha, _bravo = self.start()
        self.kill_mid_export()
        self.pause_past_lease(alpha)
        self.kill_mid_run(alpha)
        finished = self.finish()
        self.bar.draw(self.captured())
        self.bar.finish()
        elapsed = time.monotonic() - self.started
        if finished:
            self.say_export()
            self.say(
                f"all {self.order_count} orders captured, all runs finished in {elapsed:.1f} s"
            )
        else:
            self.say(f"not everything finished within {self.timeout:.0f} s")
        self.stop_all()
        ok = self.summary()
        return 0 if ok and finished else 1

    def stop_all(self) -> None:
        """Stop every process this demo started, by PID (beat first, then workers)."""
        for proc in reversed(self.processes):
            proc.stop()

    def close(self) -> None:
        """Stop processes, drop the queue on a server broker, release connections."""
        self.stop_all()
        if self.settings.broker_folder is None:
            try:
                with self.app.connection_for_write() as conn:
                    conn.default_channel.queue_delete(self.settings.queue)
            except Exception as exc:
                self.say(f"note: could not delete queue {self.settings.queue}: {exc}")
        self.engine.dispose()


class _Interrupted(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C so every started process is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


@dataclasses.dataclass
class DemoOptions:
    """Command-line options of ``demo``."""

    orders: int = 30
    workdir: Path | None = None
    keep: bool = False
    timeout: float = 150.0


MARKER = ".celery-lease-demo"


def workdir_note(workdir: Path, temporary: bool) -> str:
    """Where the logs are, and whether they outlive a successful run."""
    if temporary:
        return f"logs in {workdir} (removed after a successful run; --keep keeps them)"
    return f"logs in {workdir} (kept)"


def _workdir(requested: Path | None) -> Path:
    """A fresh directory for the demo's database, broker folder and logs."""
    if requested is None:
        path = Path(tempfile.mkdtemp(prefix="celery-lease-demo-"))
    else:
        path = requested.resolve()
        if path.exists() and any(path.iterdir()):
            if not (path / MARKER).exists():
                raise DemoFailed(f"{path} is not empty and was not made by the demo")
            shutil.rmtree(path)  # an earlier demo's directory: start afresh
        path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).touch()
    return path


def run(options: DemoOptions) -> int:
    """Run the demo; returns the process exit status."""
    temporary = options.workdir is None and not options.keep
    try:
        workdir = _workdir(options.workdir)
    except DemoFailed as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (e.g. a test runner's timeout) stops the workers too, like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    demo: Demo | None = None
    status = 1
    try:
        demo = Demo(workdir, options.orders, options.timeout, temporary)
        status = demo.run()
    except KeyboardInterrupt:
        status = 130
    except _Interrupted as exc:
        status = 128 + exc.signum
    except DemoFailed as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        status = 1
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # bounded clean-up; let it finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if demo is not None:
                demo.bar.finish()
                demo.close()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
    if status == 0 and temporary:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"removed {workdir}; run with --keep to keep the logs and database", file=sys.stderr)
    elif status == 0:
        print(f"logs and database kept in {workdir}", file=sys.stderr)
    else:
        print(f"logs and database kept in {workdir}", file=sys.stderr)
    return status
