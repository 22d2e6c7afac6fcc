"""Redaction of credentials in error text and URLs before they are stored or logged."""

from __future__ import annotations

import re

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

MAX_ERROR_LENGTH = 2000
REDACTED = "***"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host -> scheme://user:***@host
    (
        re.compile(r"(?P<pre>[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*:)[^@\s]*(?=@)"),
        rf"\g<pre>{REDACTED}",
    ),
    # Authorization: Bearer xxx / Basic xxx
    (
        re.compile(
            r"(?i)(?P<pre>authorization\s*[:=]\s*)(?:(?:bearer|basic|token)\s+)?[^\s,;'\"]+"
        ),
        rf"\g<pre>{REDACTED}",
    ),
    (re.compile(r"(?i)(?P<pre>\bbearer\s+)[A-Za-z0-9\-._~+/]+=*"), rf"\g<pre>{REDACTED}"),
    # key=value and key: value pairs, including libpq DSNs (password=...)
    (
        re.compile(
            r"(?i)(?P<pre>\b[\w\-]*(?:password|passwd|pwd|token|secret|api[_\-]?key|access[_\-]?key)"
            r"[\w\-]*['\"]?\s*[=:]\s*['\"]?)[^\s,;&'\"}]+"
        ),
        rf"\g<pre>{REDACTED}",
    ),
)


def sanitize(text: str, limit: int = MAX_ERROR_LENGTH) -> str:
    """``text`` with credentials redacted and its length capped at ``limit``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    if len(text) > limit:
        text = text[: limit - 15] + "...[truncated]"
    return text


def describe_exception(exc: BaseException, limit: int = MAX_ERROR_LENGTH) -> str:
    """``Type: message`` of an exception, sanitized, for ``last_error``."""
    return sanitize(f"{type(exc).__name__}: {exc}", limit)


def safe_url(url: str) -> str:
    """A database URL with its password hidden, safe to log or print."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return sanitize(url)
