"""The web view's guards: the write credential, the CSRF check, the bind address.

No web stack import: the checks take plain values, so the CLI can refuse a bind
before anything is served and tests can check each rule alone.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import secrets
from collections.abc import Mapping

#: The cookie holding the CSRF value a form must repeat (double submit).
CSRF_COOKIE = "celery_lease_csrf"
#: The form field that repeats it.
CSRF_FIELD = "csrf"
#: The form field an operator types the write token into.
TOKEN_FIELD = "token"


class BindRefused(ValueError):
    """A non-loopback address without a credential; ``str()`` is the one line to print."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback ``host`` without a write token.

    Raises:
        BindRefused: naming the address and how to set a token.
    """
    if token is None and not is_loopback(host):
        raise BindRefused(
            f"refusing to serve on {host} without a credential: set lease_web_token or "
            "CELERY_LEASE_WEB_TOKEN (every page then asks for it), or bind 127.0.0.1"
        )


def new_csrf_value() -> str:
    """A fresh, unguessable CSRF value for the cookie."""
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, field: str | None) -> bool:
    """True when the form repeats the cookie's CSRF value (both present and equal)."""
    if not cookie or not field:
        return False
    return hmac.compare_digest(cookie.encode(), field.encode())


def presented_token(headers: Mapping[str, str], form: Mapping[str, str]) -> str | None:
    """The credential a request presents: the form's token field, or an ``Authorization``
    header (``Bearer <token>``, or Basic auth with the token as password)."""
    if form.get(TOKEN_FIELD):
        return form[TOKEN_FIELD]
    bearer = bearer_token(headers)
    if bearer is not None:
        return bearer
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if the request has one.

    A browser never adds this header by itself (unlike a cookie or Basic auth it
    remembered), and a page of another site cannot make it send one without a
    CORS grant this server never gives: a request that carries the right one is
    a script's, not a forged form's."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def token_ok(expected: str | None, presented: str | None) -> bool:
    """True when a token is configured and ``presented`` is it (constant-time compare)."""
    if expected is None or presented is None:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


def request_host(header: str) -> str:
    """The host of a ``Host`` header, lowercase, without its port (IPv6 in brackets)."""
    host = header.strip().lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    """True when a request's ``Host`` header names one of ``allowed`` (``*``: any).

    The check against DNS rebinding: a page of another site whose name its
    attacker points at this address sends its own name as the Host, and is refused.
    """
    if "*" in allowed:
        return True
    if not header:
        return False
    host = request_host(header)
    return host in allowed or (host.startswith("[") and host.strip("[]") in allowed)
