"""Redaction of credentials and card numbers in error text and URLs before storing or logging."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

MAX_ERROR_LENGTH = 2000
REDACTED = "***"

# A number of 13+ digits, optionally grouped by single spaces or hyphens, not
# glued to a word before it nor the fraction of a decimal (0.30000000000000004).
_DIGIT_RUN = re.compile(r"(?<!\w)(?<![0-9]\.)(?=(?:[0-9][ -]?){13})[0-9]+(?:[ -][0-9]+)*")
_SEPARATOR = re.compile(r"([ -])")
_WORD_CHAR = re.compile(r"\w")


def _luhn_ok(digits: str) -> bool:
    """Whether ``digits`` passes the Luhn checksum of payment card numbers."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if index % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _card_end(groups: list[str], start: int) -> int:
    """Index of the last group of the longest card number starting at ``groups[start]``, or -1.

    A card is one group of 13 to 19 digits, or consecutive groups of 3 to 6
    digits (``4242 4242 4242 4242``, ``3782 822463 10005``) totalling 13 to 19;
    either way it passes Luhn.
    """
    digits = groups[start]
    if len(digits) > 6:
        return start if 13 <= len(digits) <= 19 and _luhn_ok(digits) else -1
    end = -1
    if len(digits) >= 3:
        for last in range(start + 1, len(groups)):
            if not 3 <= len(groups[last]) <= 6:
                break
            digits += groups[last]
            if len(digits) > 19:
                break
            if len(digits) >= 13 and _luhn_ok(digits):
                end = last
    return end


def _mask_cards(match: re.Match[str]) -> str:
    """The digit run with each card number in it shown as ``***`` and its last four digits.

    Every window of groups is tried, not only the whole run, so a card followed by
    other numbers (``4242 4242 4242 4242 12 26``) is caught.
    """
    parts = _SEPARATOR.split(match[0])  # group, separator, group, ...
    groups = parts[::2]
    if _WORD_CHAR.match(match.string, match.end()):
        groups.pop()  # the last group starts a word (``...4242abc``): not a number
    index = 0
    while index < len(groups):
        end = _card_end(groups, index)
        if end < 0:
            index += 1
            continue
        digits = "".join(groups[index : end + 1])
        parts[2 * index : 2 * end + 1] = [REDACTED + digits[-4:]] + [""] * (2 * (end - index))
        index = end + 1
    return "".join(parts)


_PATTERNS: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
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
    # key=value and key: value pairs, including libpq DSNs (password=...); not MySQL's
    # "(using password: YES)", which says whether a password was sent, not which.
    (
        re.compile(
            r"(?i)(?P<pre>\b[\w\-]*(?:password|passwd|pwd|token|secret|api[_\-]?key|access[_\-]?key)"
            r"[\w\-]*['\"]?\s*[=:]\s*['\"]?)(?!(?:YES|NO)\))[^\s,;&'\"}]+"
        ),
        rf"\g<pre>{REDACTED}",
    ),
    # cvc 123, cvv=1234, "cardCvc": "123". No leading [\w-]* as above: that costs
    # quadratic time on a long hyphenated word, and few words contain "cvc" or "cvv".
    (
        re.compile(r"(?i)(?P<pre>(?:cvc|cvv)[\w\-]{0,16}['\"]?\s*[=:]?\s*['\"]?)[0-9]{3,4}\b"),
        rf"\g<pre>{REDACTED}",
    ),
    # Card numbers last, so a labelled one (token=...) is hidden whole above.
    (_DIGIT_RUN, _mask_cards),
)


#: How far past ``limit`` the patterns read a long text: any secret that begins before
#: the cut is seen whole there (a URL, a DSN, a header), and the text beyond is never
#: read, as some patterns take time growing with the square of the length read.
_LOOKAHEAD = 4096


def sanitize(text: str, limit: int = MAX_ERROR_LENGTH) -> str:
    """``text`` with credentials redacted and its length capped at ``limit``.

    Only the first ``limit`` + ``_LOOKAHEAD`` characters are read: a 1 MB
    exception message took minutes. When the text was cut there, the last
    ``_LOOKAHEAD // 2`` characters read are dropped as well, so what is shown
    never ends in a secret the cut split before its pattern could match it.
    """
    cut = len(text) > limit + _LOOKAHEAD
    if cut:
        text = text[: limit + _LOOKAHEAD]
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    keep = min(limit, len(text) - _LOOKAHEAD // 2) if cut else limit
    if len(text) > keep:
        text = text[: max(0, keep - 15)] + "...[truncated]"
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
