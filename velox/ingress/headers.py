"""Which header fields belong to one hop (RFC 9110 §7.6.1) and never travel further.

Shared by both directions: `auth.Auth.client_headers` drops them from the client's head before
it goes upstream, the relay drops the upstream's from the answer (velox.relay.exchange), and
embeddings batching from a merged call's head.
"""

from __future__ import annotations

# RFC 9110 §7.6.1 connection-specific fields, plus those an HTTP/2 request must not carry
# (RFC 9113 §8.2.2) and those the egress recomputes (host becomes :authority, content-length
# is set from the body actually sent, expect is answered by ingress).
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
    b"te", b"trailer", b"host", b"content-length", b"expect", b"proxy-authorization",
    b"http2-settings",
})


# Connection values that name no other field (the common ones): no token list to build. The
# relay's answer filter (velox.relay.exchange, native relay_head) skips the same two.
PLAIN_CONNECTION = frozenset({b"keep-alive", b"close"})


def connection_tokens(value: bytes, into: set[bytes] | None) -> set[bytes]:
    """Names listed in a Connection header are hop-by-hop too (RFC 9110 §7.6.1): split at
    commas, ASCII whitespace stripped, lowercased, empty ones skipped (the native relay_head
    parses them the same way)."""
    names = into if into is not None else set()
    names.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return names
