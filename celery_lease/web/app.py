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
from ..schema import STATUSES
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

    # -- pages -----------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        data = await run_in_threadpool(views.overview, self.store)
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
        context = {
            "data": data,
            "filters": filters,
            "statuses": STATUSES,
            "ages": list(views.AGES),
            "next": _query(data["next"]),
            "live": first,
            "poll": _query(filters.params()),
            "nav": "runs",
        }
        return self.page(request, "runs.html", context)

    async def run(self, request: Request) -> Response:
        run_id = request.query_params.get("id", "")

        def load() -> dict[str, Any] | None:
            record = self.store.get(run_id) if run_id else None
            return None if record is None else views.run_view(record, self.store.now_ms())

        data = await run_in_threadpool(load)
        if data is None:
            if _wants_json(request):
                return _json({"error": "no such run"}, 404)
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        if _wants_json(request):
            return _json(data)
        actions = [views.ACTIONS[name] for name in data["actions"]]
        context = {"data": data, "actions": actions, "nav": "runs"}
        return self.page(request, "run.html", context)

    # -- actions ---------------------------------------------------------------------

    async def confirm(self, request: Request) -> Response:
        """The confirmation step: what the action does, and a form to do it."""
        action = views.ACTIONS.get(request.query_params.get("action", ""))
        run_id = request.query_params.get("id", "")
        if action is None or not run_id:
            return self.message(request, 404, "No such action", "unknown action or run")
        if not self.writable:
            return self.message(request, 403, "Read-only", _READ_ONLY)
        record = await run_in_threadpool(self.store.get, run_id)
        if record is None:
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        context = {"action": action, "run": record, "nav": "runs"}
        return self.page(request, "confirm.html", context)

    async def act(self, request: Request) -> Response:
        """Do an action: a POST with the CSRF value and the write token."""
        body = await request.body()
        if len(body) > MAX_FORM_BYTES:
            return self.message(request, 413, "Refused", "form too large")
        form = dict(parse_qsl(body.decode("utf-8", errors="replace")))
        if not _same_origin(request):
            return self.message(request, 403, "Refused", "cross-origin request refused")
        if not security.csrf_ok(
            request.cookies.get(security.CSRF_COOKIE), form.get(security.CSRF_FIELD)
        ):
            return self.message(
                request, 403, "Refused", "CSRF check failed: reload the page and try again"
            )
        if not self.writable:
            return self.message(request, 403, "Read-only", _READ_ONLY)
        if not security.token_ok(self.token, security.presented_token(request.headers, form)):
            return self.message(request, 403, "Refused", "wrong or missing write token")
        action = views.ACTIONS.get(form.get("action", ""))
        run_id = form.get("id", "")
        if action is None or not run_id:
            return self.message(request, 404, "No such action", "unknown action or run")
        try:
            result = await run_in_threadpool(action.run, self.app, self.store, run_id)
        except RunNotFound:
            return self.message(request, 404, "No such run", f"no run with id {run_id!r}")
        except ActionFailed as exc:
            return self.page(
                request,
                "message.html",
                {"title": f"{action.label}: refused", "text": str(exc), "run_id": run_id},
                409,
            )
        return self.page(
            request,
            "message.html",
            {"title": f"{action.label}: done", "text": result.message, "run_id": run_id},
        )

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
    "CELERY_LEASE_WEB_TOKEN) to cancel or rerun runs"
)


def _base(request: Request) -> str:
    """The path the app is mounted at ('' at the root)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _wants_json(request: Request) -> bool:
    return request.url.path.rstrip("/").endswith(("/api/runs", "/api/run", "/api/overview"))


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


def build_app(view: WebView, *, own_store: bool) -> Starlette:
    """The Starlette app serving ``view``; it disposes the store at shutdown if it owns it."""

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
        Route("/confirm", view.guard(view.confirm)),
        Route("/action", view.guard(view.act), methods=["POST"]),
        Route("/static/{name}", view.guard(view.asset)),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


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
