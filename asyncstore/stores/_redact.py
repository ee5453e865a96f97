"""Keep credentials out of botocore's own DEBUG log.

botocore logs every request it sends at DEBUG: the canonical request it signs (with the
``x-amz-security-token`` header), the prepared request (with ``Authorization`` and
``X-Amz-Security-Token``), presigned query strings and raw response bodies (an STS answer
carries ``SecretAccessKey`` and ``SessionToken``). A user who turns DEBUG on to debug a
network problem would paste those into a ticket. :class:`RedactingFilter` rewrites each record
of those loggers before any handler sees it.

What it covers: records emitted by any ``botocore*`` or ``aiobotocore*`` logger that exists when
an S3 store creates its client (botocore creates its loggers at import, before that point),
their formatted message only. In them it replaces every credential value an S3 store was
configured with or resolved (secret key, session token, in plain and URL-encoded form), and the
values of ``Authorization``, ``X-Amz-Security-Token``, ``X-Amz-Signature``/``Signature``,
``X-Amz-Credential`` and XML ``SecretAccessKey``/``SessionToken`` fields wherever they appear.
What it does not cover: tracebacks attached to records (``exc_info``), loggers of other
libraries (``urllib3``, ``aiohttp``), and handlers installed directly on the root logger that
receive records from loggers created after the filter was installed.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import quote

__all__ = ["RedactingFilter", "install", "remember_secret"]

MASK = "***"

# A value ends at a quote, whitespace, '&' (query strings), ',' or '}' (dict reprs) or '<'.
_VALUE = r"[^'\"\s&,}<]+"
_PATTERNS = (
    # The Authorization header as a dict entry ('Authorization': b'AWS4-HMAC-SHA256 ...') or a
    # header line: the whole value, up to its closing quote or the end of the line.
    re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*b?['\"])[^'\"]*"),
    re.compile(r"(?im)^(authorization:)[^\n]*"),
    # Tokens, signatures and credential scopes as header lines, dict entries or query fields.
    re.compile(
        r"(?i)((?:x-amz-security-token|x-amz-signature|x-amz-credential|signature|"
        r"aws_secret_access_key|aws_session_token|secretaccesskey|sessiontoken)"
        r"['\"]?\s*[:=]\s*b?['\"]?)" + _VALUE
    ),
    # STS-style XML answers logged as raw bodies.
    re.compile(r"(?i)(<(?:SecretAccessKey|SessionToken)>)[^<]*"),
)

_secrets: set[str] = set()
_lock = threading.Lock()


def remember_secret(value: str | None) -> None:
    """Mask ``value`` (and its URL-encoded forms) in every record the filter sees from now on."""
    if not value or len(value) < 4:  # a 1-3 character "secret" would mask ordinary text
        return
    with _lock:
        _secrets.update({value, quote(value, safe=""), quote(value, safe="/~")})


def redact(text: str) -> str:
    """``text`` with every known secret and every credential-bearing field masked."""
    with _lock:
        known = sorted(_secrets, key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    return text


class RedactingFilter(logging.Filter):
    """A logging filter that masks credentials in a record's message; it drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


_FILTER = RedactingFilter()
_PREFIXES = ("botocore", "aiobotocore")


def install() -> None:
    """Attach the filter to every botocore and aiobotocore logger that exists now.

    A filter on a logger only sees records created by that very logger, not by its children,
    so each module's logger gets it. Idempotent and cheap: called whenever a client is made.
    """
    manager = logging.Logger.manager
    with _lock:
        names = [
            name
            for name in list(manager.loggerDict)
            if name in _PREFIXES or name.startswith(tuple(p + "." for p in _PREFIXES))
        ]
    for name in (*_PREFIXES, *names):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
