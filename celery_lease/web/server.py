"""The web view as an ASGI application (Starlette + Jinja2): :func:`build_app`.

Pages are rendered on the server with every value escaped (Jinja2 autoescape on
every template); the browser's script only polls the JSON endpoints and writes
what they return as text. Scripts and styles are the package's own files, served
here, under a Content-Security-Policy that allows nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode

from celery import Celery
from jinja2 import Environment, PackageLoader
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import ActionFailed, LeaseDatabaseError, LeaseError, RunNotFound
from ..sanitize import sanitize
from ..schema import MAX_ID_LENGTH, STATUSES
from ..store import LeaseStore
from . import security, views

Handler = Callable[[Request], Awaitable[Response]]

#: Every asset the pages load, served from the package (no CDN, no build step).
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}

#: No script, style or frame from anywhere but this server; no inline script.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

#: Largest form body an action accepts.
MAX_FORM_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class WebView:
    """One web view: the Celery app, its lease store, the credential and the templates."""

    app: Celery
    store: LeaseStore
    token: str | None
    protect_reads: bool
    poll_ms: int
    database: str
    templates: Environment
    #: The Host header values answered (``lease_web_hosts``; ``*``: any).
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "[::1]")

    @property
    def writable(self) -> bool:
        """True when actions are offered: a write token is set."""
        return self.token is not None

    # -- responses -----------------------------------------------------------------

    def page(
        self, request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        """An HTML page, with the CSRF cookie set if the browser has none yet."""
        csrf = request.cookies.get(security.CSRF_COOKIE) or security.new_csrf_value()
        html = self.templates.get_template(template).render(
            base=_base(request),
            database=self.database,
            writable=self.writable,
            poll_ms=self.poll_ms,
            csrf=csrf,
            **context,
        )
        response = HTMLResponse(html, status_code=status, headers=HEADERS)
        if request.cookies.get(security.CSRF_COOKIE) != csrf:
            response.set_cookie(
                security.CSRF_COOKIE,
                csrf,
                path=_base(request) or "/",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return response

    def message(self, request: Request, status: int, title: str, text: str) -> Response:
        """A page saying one thing (an action's result, a refusal, an error)."""
        return self.page(request, "message.html", {"title": title, "text": text}, status)

    def said(
        self, request: Request, title: str, text: str, back: dict[str, str], status: int = 200
    ) -> Response:
        """An action's outcome, with the link back to what it acted on (``back``: the path
        under the view and its words)."""
        return self.page(request, "message.html", {"title": title, "text": text, **back}, status)

    # -- pages -----------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        data = await run_in_threadpool(views.overview, self.app, self.store)
        if _wants_json(request):
            return _json(data)
        return self.page(request, "overview.html", {"data": data, "nav": "overview"})

    async def runs(self, request: Request) -> Response:
        try:
            filters = views.Filters.parse(request.query_params)
        except views.BadFilter as exc:
            if _wants_json(request):
                return _json({"error": str(exc)}, 400)
            return self.message(request, 400, "Bad filter", str(exc))
        data = await run_in_threadpool(views.runs_page, self.store, filters)
        first = filters.after_id == ""
        if _wants_json(request):
            return _json({**data, "next": _query(data["next"])})
        bulk = views.BulkRerunTarget.of(filters) is not None
        context = {
            "data": data,
            "filters": filters,
            "statuses": STATUSES,
            "ages": list(views.AGES),
            "next": _query(data["next"]),
            "live": first,
            "poll": _query(filters.params()),
            "bulk": _query({"action": BULK_RERUN, **filters.params()}) if bulk else None,
            "nav": "runs",
        }
        return self.page(request, "runs.html", context)

    async def task(self, request: Request) -> Response:
        name = request.query_params.get("name", "").strip()
        if not name or len(name) > MAX_ID_LENGTH:
            if _wants_json(request):
                return _json({"error": "name a task: /task?name=..."}, 400)
            return self.message(request, 400, "No task named", "name a task: /task?name=...")
        data = await run_in_threadpool(views.task_view, self.app, self.store, name)
        if _wants_json(request):
            return _json(data)
        actions = [views.TASK_ACTIONS[a["name"]] for a in data["actions"]]
        links = {status: _query({"task": name, "status": status}) for status in ("", *STATUSES)}
        context = {"data": data, "actions": actions, "links": links, "nav": "overview"}
        return self.page(request, "task.html", context)

    async def run(self, request: Request) -> Response:
        run_id = request.query_params.get("id", "")

        # The full lease owner only for a viewer who presented the token.
        full = security.token_ok(self.token, security.presented_token(request.headers, {}))

        def load() -> dict[str, Any] | None:
            record = self.store.get(run_id) if run_id else None
            if record is None:
                return None
            return views.run_view(record, self.store.now_ms(), full_owner=full)

        data = await run_in_threadpool(load)
        if data is None:
            if _wants_json(request):
                return _json({"error": "no such run"}, 404)
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        if _wants_json(request):
            return _json(data)
        actions = [views.ACTIONS[a["name"]] for a in data["actions"]]
        context = {"data": data, "actions": actions, "nav": "runs"}
        return self.page(request, "run.html", context)

    # -- actions ---------------------------------------------------------------------

    async def confirm(self, request: Request) -> Response:
        """The confirmation step: what the action does, and a form to do it."""
        params = request.query_params
        name = params.get("action", "")
        if not self.writable and (
            name in views.ACTIONS or name in views.TASK_ACTIONS or name == BULK_RERUN
        ):
            return self.message(request, 403, "Read-only", _READ_ONLY)
        if name in views.TASK_ACTIONS:
            return await self._confirm_task(request, views.TASK_ACTIONS[name])
        if name == BULK_RERUN:
            return await self._confirm_bulk(request)
        action = views.ACTIONS.get(name)
        run_id = params.get("id", "")
        if action is None or not run_id:
            return self.message(request, 404, "No such action", "unknown action or run")
        record = await run_in_threadpool(self.store.get, run_id)
        if record is None:
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        context = {
            "heading": f"{action.label} run",
            "subject": record.id,
            "question": action.question,
            "detail": f"Task {record.task_name}, now {record.status}, attempt "
            f"{record.attempt} of {record.max_attempts}.",
            "hidden": {"action": action.name, "id": record.id},
            "confirm": action.confirm,
            "back": f"/run?{_query({'id': record.id})}",
            "back_text": "no, back to the run",
            "nav": "runs",
        }
        return self.page(request, "confirm.html", context)

    async def _confirm_task(self, request: Request, action: views.TaskAction) -> Response:
        name = request.query_params.get("task", "").strip()
        if not name or len(name) > MAX_ID_LENGTH:
            return self.message(request, 404, "No such task", "name a task: task=...")
        data = await run_in_threadpool(views.task_view, self.app, self.store, name)
        context = {
            "heading": f"{action.label} task",
            "subject": name,
            "question": action.question,
            "detail": f"Now {data['state']}; {data['held']} deliveries held.",
            "hidden": {"action": action.name, "task": name},
            "ask_reason": action.name == "pause-task",
            "confirm": action.confirm,
            "back": f"/task?{_query({'name': name})}",
            "back_text": "no, back to the task",
            "nav": "overview",
        }
        return self.page(request, "confirm.html", context)

    async def _confirm_bulk(self, request: Request) -> Response:
        try:
            filters = views.Filters.parse(request.query_params)
        except views.BadFilter as exc:
            return self.message(request, 400, "Bad filter", str(exc))
        target = views.BulkRerunTarget.of(filters)
        if target is None:
            return self.message(
                request,
                400,
                "Nothing to rerun",
                "a bulk rerun takes a list filtered by task and by status failed or cancelled",
            )
        try:
            dry = await run_in_threadpool(lambda: target.run(self.app, self.store, dry_run=True))
        except ActionFailed as exc:
            return self.message(request, 409, "Rerun: refused", str(exc))
        context = {
            "heading": "Rerun the listed runs of",
            "subject": filters.task,
            "question": "Run these runs again? Each goes back to queued with fresh attempts "
            "and is published from its stored message under a new task id (it resumes "
            f"from its checkpoint); at most {views.WEB_BULK_LIMIT:,} per confirmation, "
            "newest first.",
            "detail": dry.message,
            "hidden": {"action": BULK_RERUN, **filters.params()},
            "confirm": f"Yes, rerun {min(dry.with_message, views.WEB_BULK_LIMIT)} runs",
            "back": f"/runs?{_query(filters.params())}",
            "back_text": "no, back to the runs",
            "nav": "runs",
        }
        return self.page(request, "confirm.html", context)

    async def act(self, request: Request) -> Response:
        """Do an action: a POST with the CSRF value and the write token."""
        body = await _bounded_body(request, MAX_FORM_BYTES)
        if body is None:
            return self.message(request, 413, "Refused", "form too large")
        form = dict(parse_qsl(body.decode("utf-8", errors="replace")))
        if any("\x00" in value for value in form.values()):
            return self.message(request, 400, "Bad request", "a form value holds a NUL")
        if not _same_origin(request):
            return self.message(request, 403, "Refused", "cross-origin request refused")
        # A script presenting a bearer header needs no CSRF value: no browser sends that
        # header for another site (security.bearer_token). Its token is checked below, so
        # a wrong one, or any on a read-only view, is told so.
        scripted = security.bearer_token(request.headers) is not None
        if not scripted and not security.csrf_ok(
            request.cookies.get(security.CSRF_COOKIE), form.get(security.CSRF_FIELD)
        ):
            return self.message(
                request, 403, "Refused", "CSRF check failed: reload the page and try again"
            )
        if not self.writable:
            return self.message(request, 403, "Read-only", _READ_ONLY)
        if not security.token_ok(self.token, security.presented_token(request.headers, form)):
            return self.message(request, 403, "Refused", "wrong or missing write token")
        name = form.get("action", "")
        if name in views.TASK_ACTIONS:
            return await self._act_task(request, views.TASK_ACTIONS[name], form)
        if name == BULK_RERUN:
            return await self._act_bulk(request, form)
        action = views.ACTIONS.get(name)
        run_id = form.get("id", "")
        if action is None or not run_id:
            return self.message(request, 404, "No such action", "unknown action or run")
        back = {"back": f"/run?{_query({'id': run_id})}", "back_text": "back to the run"}
        try:
            result = await run_in_threadpool(action.run, self.app, self.store, run_id)
        except RunNotFound:
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        except ActionFailed as exc:
            title = f"{action.label}: refused"
            return self.said(request, title, str(exc), back, 409)
        title = f"{action.label}: done"
        return self.said(request, title, result.message, back)

    async def _act_task(
        self, request: Request, action: views.TaskAction, form: dict[str, str]
    ) -> Response:
        name = form.get("task", "").strip()
        if not name or len(name) > MAX_ID_LENGTH:
            return self.message(request, 404, "No such task", "name a task: task=...")
        back = {"back": f"/task?{_query({'name': name})}", "back_text": "back to the task"}
        try:
            result = await run_in_threadpool(action.run, self.app, self.store, name, form)
        except ActionFailed as exc:
            title = f"{action.label} task: refused"
            return self.said(request, title, str(exc), back, 409)
        title = f"{action.label} task: done"
        return self.said(request, title, result.message, back)

    async def _act_bulk(self, request: Request, form: dict[str, str]) -> Response:
        try:
            filters = views.Filters.parse(form)
        except views.BadFilter as exc:
            return self.message(request, 400, "Bad filter", str(exc))
        target = views.BulkRerunTarget.of(filters)
        if target is None:
            return self.message(request, 400, "Nothing to rerun", "no task and status given")
        back = {"back": f"/runs?{_query(filters.params())}", "back_text": "back to the runs"}
        try:
            result = await run_in_threadpool(
                lambda: target.run(self.app, self.store, dry_run=False)
            )
        except ActionFailed as exc:
            return self.said(request, "Rerun: stopped", str(exc), back, 409)
        return self.said(request, "Rerun: done", result.message, back)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return Response("not found", 404, media_type="text/plain")
        data = resources.files(__package__).joinpath("static", name).read_bytes()
        return Response(
            data, media_type=ASSETS[name], headers={**HEADERS, "Cache-Control": "max-age=300"}
        )

    # -- wiring ----------------------------------------------------------------------

    def guard(self, handler: Handler) -> Handler:
        """``handler`` behind the read credential (when reads are protected) and the
        database's errors turned into one line."""

        async def guarded(request: Request) -> Response:
            if self.protect_reads and not security.token_ok(
                self.token, security.presented_token(request.headers, {})
            ):
                return Response(
                    "celery-lease web: this view needs the token (any user name, the token "
                    "as password)\n",
                    401,
                    headers={"WWW-Authenticate": 'Basic realm="celery-lease"', **HEADERS},
                    media_type="text/plain",
                )
            try:
                return await handler(request)
            except LeaseDatabaseError as exc:
                text = f"lease database {self.database}: {sanitize(str(exc))}"
                if _wants_json(request):
                    return _json({"error": text}, 503)
                return self.message(request, 503, "Database unavailable", text)
            except LeaseError as exc:
                return self.message(request, 500, "Error", sanitize(str(exc)))

        return guarded


_READ_ONLY = (
    "this view is read-only: start it with a write token (lease_web_token or "
    "CELERY_LEASE_WEB_TOKEN) to cancel or rerun runs and pause or resume tasks"
)

#: The bulk rerun's action name (the runs page's filtered list).
BULK_RERUN = "rerun-runs"


def _base(request: Request) -> str:
    """The path the app is mounted at ('' at the root)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


async def _bounded_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it is over ``limit`` bytes: refused on its
    ``Content-Length`` before anything is read, else as soon as the stream passes it."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


class Edge:
    """What every request passes before a route, and every response after it.

    A ``Host`` header outside ``hosts`` is refused (400: DNS rebinding); so is a
    query string with a NUL (400: no run id holds one, and some databases refuse
    it in a query), and a ``Content-Length`` over ``max_body`` (413, nothing read).
    Every response, a router's 404 and an error page included, carries the
    security headers (:data:`HEADERS`).
    """

    def __init__(self, app: Any, hosts: tuple[str, ...], max_body: int) -> None:
        self.app = app
        self.hosts = hosts
        self.max_body = max_body
        self.headers = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status, text = refusal
            response = Response(text + "\n", status, headers=HEADERS, media_type="text/plain")
            await response(scope, receive, send)
            return

        async def secured(message: Any) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.headers if k not in present]
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, secured)

    def _refusal(self, scope: Any) -> tuple[int, str] | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        host = headers.get("host", b"").decode("latin-1")
        if not security.host_allowed(host, self.hosts):
            return 400, (
                f"celery-lease web: Host {host!r} is not served here; "
                "name it in lease_web_hosts to allow it"
            )
        query = bytes(scope.get("query_string", b""))
        if b"%00" in query or b"\x00" in query:
            return 400, "celery-lease web: a NUL in the query: no run, task or key holds one"
        length = headers.get("content-length", b"0").decode("latin-1")
        if not length.isdigit() or int(length) > self.max_body:
            return 413, f"celery-lease web: request body over {self.max_body} bytes refused"
        return None


def _wants_json(request: Request) -> bool:
    return request.url.path.rstrip("/").endswith(
        ("/api/runs", "/api/run", "/api/overview", "/api/task")
    )


def _json(data: Any, status: int = 200) -> Response:
    return JSONResponse(data, status_code=status, headers=HEADERS)


def _query(params: dict[str, str] | None) -> str | None:
    return None if params is None else urlencode(params)


def _same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another origin."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1] == host


def build_app(view: WebView, *, own_store: bool) -> Edge:
    """The ASGI app serving ``view`` (Starlette behind the :class:`Edge`); it disposes the
    store at shutdown if it owns it."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if own_store:
            view.store.dispose()

    routes = [
        Route("/", view.guard(view.overview)),
        Route("/api/overview", view.guard(view.overview)),
        Route("/runs", view.guard(view.runs)),
        Route("/api/runs", view.guard(view.runs)),
        Route("/run", view.guard(view.run)),
        Route("/api/run", view.guard(view.run)),
        Route("/task", view.guard(view.task)),
        Route("/api/task", view.guard(view.task)),
        Route("/confirm", view.guard(view.confirm)),
        Route("/action", view.guard(view.act), methods=["POST"]),
        Route("/static/{name}", view.guard(view.asset)),
    ]
    return Edge(Starlette(routes=routes, lifespan=lifespan), view.hosts, MAX_FORM_BYTES)


def templates() -> Environment:
    """The package's templates, every value escaped."""
    environment = Environment(
        loader=PackageLoader("celery_lease.web", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["tojson_attr"] = json.dumps
    return environment
