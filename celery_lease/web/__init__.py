"""The web view: runs, a run's detail, overview counts, live updates; cancel and rerun.

Served by ``celery -A proj lease web`` or mounted in an existing ASGI app with
:func:`create_app`. Needs the extra: ``pip install 'celery-lease[web]'``
(Starlette, Jinja2, uvicorn); nothing of it is imported until a view is made.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ..config import LeaseConfig, web_hosts, web_token
from ..sanitize import safe_url
from ..store import LeaseStore

#: Seconds between two refreshes of an open page.
POLL_SECONDS = 2.0


def create_app(
    celery_app: Celery,
    *,
    token: str | None = None,
    store: LeaseStore | None = None,
    protect_reads: bool = False,
    poll_seconds: float = POLL_SECONDS,
    hosts: tuple[str, ...] | None = None,
) -> Any:
    """The web view of ``celery_app``'s lease database, as an ASGI application.

    Args:
        celery_app: the app whose ``lease_database_url`` and tasks the view uses
            (rerun publishes through it).
        token: the write credential; default: ``lease_web_token``, else
            ``$CELERY_LEASE_WEB_TOKEN``. Without one the view is read-only.
        store: a store to read from (default: one on the app's lease database,
            disposed when the server shuts down).
        protect_reads: every page asks for the token too (HTTP Basic auth, the
            token as password); needs a token. ``lease web`` turns it on for a
            non-loopback address.
        poll_seconds: how often an open page refreshes itself.
        hosts: the ``Host`` header values answered (``*``: any); default:
            ``lease_web_hosts``, else the loopback names. Any other Host is
            refused (400), against DNS rebinding.

    Raises:
        ImportError: the ``web`` extra is not installed.
        ImproperlyConfigured: a bad ``lease_web_token`` or ``lease_web_hosts``, or
            ``protect_reads`` without a token.
    """
    try:
        from . import server as web
    except ImportError as exc:
        raise ImportError(
            "celery lease web needs Starlette, Jinja2 and uvicorn: "
            f"pip install 'celery-lease[web]' ({exc})"
        ) from exc
    from celery.exceptions import ImproperlyConfigured

    token = web_token(celery_app.conf if token is None else {"lease_web_token": token})
    allowed = web_hosts(celery_app.conf) if hosts is None else hosts
    if protect_reads and token is None:
        raise ImproperlyConfigured("protect_reads needs a write token (lease_web_token)")
    url = LeaseConfig.from_app(celery_app).database_url
    own_store = store is None
    if store is None:
        store = LeaseStore.from_url(url)
    view = web.WebView(
        app=celery_app,
        store=store,
        token=token,
        protect_reads=protect_reads,
        poll_ms=max(200, round(poll_seconds * 1000)),
        database=safe_url(url if own_store else str(store.engine.url)),
        templates=web.templates(),
        hosts=allowed,
    )
    return web.build_app(view, own_store=own_store)
