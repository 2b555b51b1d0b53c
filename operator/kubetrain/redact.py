"""Secret-shaped text out of everything the operator publishes: `redact`.

Pods and the API server say things (termination messages, kubelet and admission
messages) that the operator copies into status and events; this is applied to
all of it first.
"""

from __future__ import annotations

import re

_SECRET_SHAPED = re.compile(
    r"(?P<akid>\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b)"
    r"|(?P<kv>(?i:[\w.-]{0,64}(?:secret|password|passwd|token|credential|signature|api[_-]?key|access[_-]?key|session)"
    r"[\w.-]*+)"
    r"[\"']?\s*[=:]\s*)(?P<value>\"[^\"]*\"|'[^']*'|\S+)"
    r"|(?P<bearer>(?i:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|(?P<userinfo>\b[a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"
    r"|(?P<pem>-----BEGIN [A-Z ]*PRIVATE KEY-----)[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"
)


REDACT_MARGIN = 1024
"""How much text past a cut is redacted with it, so that a secret across the cut (a long token in a URL's
user:password@) is still recognised whole."""


def redact(text: str) -> str:
    """`text` with anything secret-shaped replaced by `***`: AWS access key ids, values of
    key=value / key: value pairs whose key names a secret, token or password, bearer/basic
    credentials, user:password@ in URLs and private keys. Applied to everything that pods or
    the API server say before it is copied into status or events. A key name is at most 64
    characters before its secret word (the search may start inside a longer one) and is taken whole,
    without backtracking, after it: unbounded, a long run of word characters (a 100 kB annotation) made
    the match quadratic, minutes of CPU per reconcile. Callers cut long text first (`draft.excerpt`)."""
    def sub(m: re.Match[str]) -> str:
        if m.group("akid"):
            return "***"
        if m.group("kv") is not None:
            return f"{m.group('kv')}***"
        if m.group("bearer"):
            return f"{m.group('bearer')}***"
        if m.group("userinfo"):
            return f"{m.group('userinfo')}***@"
        return "-----PRIVATE KEY REDACTED-----"
    return _SECRET_SHAPED.sub(sub, text)


def redacted_excerpt(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, redacted: cut first (with `REDACT_MARGIN`, so that a secret across
    the cut is still recognised whole), redacted, cut again."""
    return redact(text[:limit + REDACT_MARGIN])[:limit]
