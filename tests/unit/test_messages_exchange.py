"""The Messages exchange's headers, socket-free: the client's x-api-key never goes upstream
among the forwarded headers, and goes as the credential only from a gateway without keys of its
own to an upstream without one (the rule dispatch applies to Authorization)."""

from __future__ import annotations

from types import SimpleNamespace

from velox.relay.messages import MessagesExchange

HEADERS = [(b"content-type", b"application/json"), (b"x-api-key", b"sk-client"),
           (b"anthropic-version", b"2023-06-01")]
ANTHROPIC = SimpleNamespace(kind="anthropic")


def exchange(keyless: bool, passthrough: list[tuple[bytes, bytes]] | None = None,
             headers: list[tuple[bytes, bytes]] = HEADERS) -> MessagesExchange:
    request = SimpleNamespace(upstream_path=b"/v1/messages", conn=None, method=b"POST",
                              body=b"{}", path=b"/v1/messages", exchange=None, model="m")
    return MessagesExchange(request, headers, passthrough or [], keyless, print)  # type: ignore[arg-type]


def test_the_client_key_goes_upstream_only_from_a_keyless_gateway() -> None:
    keyless = exchange(True)
    assert (b"x-api-key", b"sk-client") not in keyless.headers_base
    assert keyless.passthrough == [(b"x-api-key", b"sk-client")]
    assert keyless.target(ANTHROPIC, "m", [])  # type: ignore[arg-type]
    assert keyless.headers_out.count((b"x-api-key", b"sk-client")) == 1
    keyed = exchange(False)
    assert keyed.passthrough == [] and (b"x-api-key", b"sk-client") not in keyed.headers_base
    assert keyed.target(ANTHROPIC, "m", [(b"x-api-key", b"sk-up")])  # type: ignore[arg-type]
    assert (b"x-api-key", b"sk-client") not in keyed.headers_out
    assert (b"x-api-key", b"sk-up") in keyed.headers_out
    # One anthropic-version upstream: the client's.
    assert [h for h in keyed.headers_out if h[0] == b"anthropic-version"] == [
        (b"anthropic-version", b"2023-06-01")]


def test_a_passthrough_credential_wins_and_no_key_means_none() -> None:
    bearer = [(b"authorization", b"Bearer sk-client")]
    assert exchange(True, bearer).passthrough == bearer
    plain = exchange(True, headers=HEADERS[:1])
    assert plain.passthrough == [] and plain.headers_base == HEADERS[:1]
