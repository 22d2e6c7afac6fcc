"""Redaction of credentials in error text and URLs before they are stored or logged."""

from __future__ import annotations

import logging
import re

MAX_ERROR_LENGTH = 2000
REDACTED = "***"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host -> scheme://user:***@host. The password runs
    # to the last "@" of the URL, so one containing "@", ":" or "/" is hidden
    # whole (a stray "@" later in the URL over-redacts, which is the safe side).
    (
        re.compile(r"(?P<pre>[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/\s]*:)\S*(?=@)"),
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
    """A database URL with its password hidden, safe to log or print.

    Redacted as text, not re-rendered by SQLAlchemy's parser: a password with a
    raw ``@`` would be split by it and partly shown as the host.
    """
    return sanitize(url)


#: Longest log message (and traceback) the filter lets through.
MAX_LOG_LENGTH = 8000


class SanitizingFilter(logging.Filter):
    """Redacts each record's final message and traceback, as :func:`sanitize` does.

    Applied to every ``celery_lease`` logger, so a line that forgot to call
    :func:`describe_exception` still leaks no credential.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record`` in place; never drops it."""
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: leave it to logging's own error report
            return True
        record.msg, record.args = sanitize(message, MAX_LOG_LENGTH), None
        if record.exc_info and not record.exc_text:
            formatted = logging.Formatter().formatException(record.exc_info)
            record.exc_text = sanitize(formatted, MAX_LOG_LENGTH)
        return True


_FILTER = SanitizingFilter()


def protect_loggers() -> None:
    """Attach the sanitizing filter to every ``celery_lease`` logger created so far."""
    manager = logging.Logger.manager
    for name in list(manager.loggerDict):
        if name == "celery_lease" or name.startswith("celery_lease."):
            found = logging.getLogger(name)
            if _FILTER not in found.filters:
                found.addFilter(_FILTER)
