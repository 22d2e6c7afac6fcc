"""``lease web``: serve the web view (the ``web`` extra) on a local port."""

from __future__ import annotations

import socket

import click
from celery.exceptions import ImproperlyConfigured

from ..config import web_hosts, web_token
from .common import _URL_KEY, _Failure, _open_store, _operator_errors, lease


@lease.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=5566, show_default=True)
@click.pass_context
@_operator_errors
def web(ctx: click.Context, host: str, port: int) -> None:
    """Serve the web view: runs, a run's detail, overview, live updates; cancel and rerun.

    Read-only unless lease_web_token (or CELERY_LEASE_WEB_TOKEN) gives a write token.
    Binds 127.0.0.1 by default; a non-loopback address is refused without a token,
    and with one every page asks for it. Only requests whose Host header is a
    loopback name, the bound address or one of lease_web_hosts are answered.
    Needs pip install 'celery-lease[web]'.
    """
    from ..web.security import BindRefused, check_bind

    app = ctx.obj.app
    try:
        token = web_token(app.conf)
        check_bind(host, token)
        hosts = web_hosts(app.conf)
    except (BindRefused, ImproperlyConfigured) as exc:
        raise _Failure(str(exc)) from None
    try:
        import uvicorn

        from ..web import create_app
    except ImportError:
        raise _Failure(
            "lease web needs Starlette, Jinja2 and uvicorn: pip install 'celery-lease[web]'"
        ) from None
    from ..web.security import is_loopback

    store = _open_store(ctx)
    public = not is_loopback(host)
    bound = host.lower() if ":" not in host else f"[{host.strip('[]').lower()}]"
    if public and bound not in ("0.0.0.0", "[::]") and bound not in hosts:
        hosts = (*hosts, bound)  # the address it is reached at, as well
    asgi = create_app(app, token=token, store=store, protect_reads=public, hosts=hosts)
    shown = ctx.meta.get(_URL_KEY, "?")
    mode = "read-only" if token is None else "writes need the token"
    if public:
        mode += "; every page asks for the token"
    where = f"[{host}]" if ":" in host else host
    listening = _listen(host, port, where)  # before the banner: a port in use is one line
    port = int(listening.getsockname()[1])
    click.echo(f"celery lease web: http://{where}:{port}/ on {shown} ({mode}); Ctrl-C stops")
    if "*" not in hosts:
        click.echo(f"answering Host {', '.join(hosts)} only (lease_web_hosts)")
    config = uvicorn.Config(asgi, host=host, port=port, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[listening])


def _listen(host: str, port: int, where: str) -> socket.socket:
    """A socket bound to ``host``:``port`` for the server to serve on; a port in use or an
    address this host does not have is a one-line failure (exit 1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host.strip("[]"), port))
    except OSError as exc:
        listening.close()
        raise _Failure(f"cannot listen on {where}:{port}: {exc.strerror or exc}") from None
    return listening
