"""Secret-shaped text out of everything the operator publishes: `redact`.

Pods and the API server say things (termination messages, kubelet and admission
messages) that the operator copies into status and events; this is applied to
all of it first.
"""

from __future__ import annotations

import logging
import re

_SECRET_SHAPED = re.compile(
    r"(?P<akid>\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b)"
    r"|(?P<kv>(?i:[\w.-]{0,64}(?:secret|password|passwd|token|credential|signature|api[_-]?key|access[_-]?key|session"
    r"|(?<![a-z])sig(?![a-z]))"
    r"[\w.-]*+)"
    r"[\"']?\s*[=:]\s*)(?P<value>\"[^\"]*\"|'[^']*'|\S+)"
    r"|(?P<flag>(?i:--?[\w.-]{0,64}(?<![a-z])(?:secrets?|passwords?|passwd|token|credentials?|api[_-]?keys?)"
    r"(?![a-z])[\w.-]*+)\s+)(?P<fvalue>[^\s-]\S*)"
    r"|(?P<bearer>(?i:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|(?P<userinfo>\b[a-z][a-z0-9+.-]*://)[^/\s:@]+(?::[^/\s@]+)?@"
    r"|(?P<token>\beyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,}|\bhf_[A-Za-z0-9]{30,}\b|\bgh[pousr]_[A-Za-z0-9]{36,}\b"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,})"
    r"|(?P<pem>-----BEGIN [A-Z ]*PRIVATE KEY-----)[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"
)


REDACT_MARGIN = 1024
"""How much text past a cut is redacted with it, so that a secret across the cut (a long token in a URL's
user:password@) is still recognised whole."""


def redact(text: str) -> str:
    """`text` with anything secret-shaped replaced by `***`: AWS access key ids, values of
    key=value / key: value pairs whose key names a secret, token, password or signature (`sig=` of an
    Azure SAS), values after a flag named so (`--password x`), bearer/basic credentials, the user
    (and password) in URLs, JWTs, Hugging Face / GitHub / Slack tokens and private keys. Applied to everything that pods or
    the API server say before it is copied into status or events. A key name is at most 64
    characters before its secret word (the search may start inside a longer one) and is taken whole,
    without backtracking, after it: unbounded, a long run of word characters (a 100 kB annotation) made
    the match quadratic, minutes of CPU per reconcile. Callers cut long text first (`draft.excerpt`)."""
    def sub(m: re.Match[str]) -> str:
        if m.group("akid") or m.group("token"):
            return "***"
        if m.group("kv") is not None:
            return f"{m.group('kv')}***"
        if m.group("flag"):
            return f"{m.group('flag')}***"
        if m.group("bearer"):
            return f"{m.group('bearer')}***"
        if m.group("userinfo"):
            return f"{m.group('userinfo')}***@"
        return "-----PRIVATE KEY REDACTED-----"
    return _SECRET_SHAPED.sub(sub, text)


REDACT_WINDOW_MAX = 8 << 10
"""The most text `redacted_excerpt` redacts to fill its excerpt (the pattern is linear in it)."""


def redacted_excerpt(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, redacted: cut first (with `REDACT_MARGIN`, so that a secret across
    the cut is still recognised whole), redacted, cut again. When what redaction masked pulls the cut's end to
    within half the margin of the excerpt, the window grows and is redacted again: otherwise the start of a
    secret split at the cut (a long token in a URL after a few masked ones) came into view, unrecognisable."""
    window = limit + REDACT_MARGIN
    while True:
        if window >= len(text):
            return redact(text)[:limit]
        shown = redact(text[:window])
        if len(shown) >= limit + REDACT_MARGIN // 2 or window >= REDACT_WINDOW_MAX:
            return shown[:limit]
        window = min(window * 4, REDACT_WINDOW_MAX)


class RedactFilter(logging.Filter):
    """On a log handler: every record it writes is redacted as status and events are. The API server's refusals
    (an admission webhook quoting a pod's env), kopf's own error lines and any later log call are covered
    without each call site remembering to redact."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError, KeyError):  # arguments that do not fit the format: logging reports it
            return True
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        if record.exc_info and not record.exc_text:  # a traceback (log.exception) carries the error's text too
            record.exc_text = redact(self._formatter.formatException(record.exc_info))
        return True
