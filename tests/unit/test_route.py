from __future__ import annotations

import pytest

from velox.config.settings import load
from velox.core.errors import InvalidPath, MethodNotAllowed, NotFound, Unauthorized
from velox.core.types import Kind
from velox.ingress.auth import Auth
from velox.ingress.classify import classify, normal_target


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        (b"POST", b"/v1/chat/completions", Kind.MODEL_CALL),
        (b"POST", b"/v1/completions", Kind.MODEL_CALL),
        (b"POST", b"/v1/embeddings", Kind.MODEL_CALL),
        (b"POST", b"/v1/responses?x=1", Kind.MODEL_CALL),
        (b"GET", b"/v1/chat/completions", Kind.FORWARD),  # lists stored completions
        (b"GET", b"/v1/models", Kind.FORWARD),
        (b"GET", b"/v1/models/gpt-4o", Kind.FORWARD),
        (b"DELETE", b"/v1/files/file-1", Kind.FORWARD),
        (b"POST", b"/v1/audio/speech", Kind.MODEL_OTHER),
        (b"POST", b"/v1/audio/transcriptions", Kind.MODEL_OTHER),
        (b"POST", b"/v1/images/generations?x=1", Kind.MODEL_OTHER),
        (b"POST", b"/v1/moderations", Kind.MODEL_OTHER),
        (b"POST", b"/v1/batches", Kind.FORWARD),
        (b"POST", b"/v1/files", Kind.FORWARD),
        (b"POST", b"/", Kind.ROOT),
        (b"GET", b"/healthz", Kind.HEALTH),
        (b"HEAD", b"/readyz", Kind.READY),
    ],
)
def test_classify(method: bytes, path: bytes, route: Kind) -> None:
    assert classify(method, path) is route


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        (b"PUT", b"/v1/chat/completions", b"POST, GET"),
        (b"GET", b"/v1/embeddings", b"POST"),
        (b"POST", b"/v1/models", b"GET"),
        (b"GET", b"/", b"POST"),
        (b"POST", b"/healthz", b"GET, HEAD"),
        (b"GET", b"/v1/images/generations", b"POST"),
    ],
)
def test_wrong_method_on_known_route_is_405_with_allow(method: bytes, path: bytes,
                                                       allow: bytes) -> None:
    with pytest.raises(MethodNotAllowed) as err:
        classify(method, path)
    assert err.value.headers == ((b"allow", allow),)


@pytest.mark.parametrize("path", [b"/v2/chat/completions", b"/admin", b"/v1", b"/favicon.ico"])
def test_unknown_route_is_404(path: bytes) -> None:
    with pytest.raises(NotFound):
        classify(b"GET", path)


@pytest.mark.parametrize("path", [b"/v1/deployments/gpt-4o/chat/completions",
                                  b"/v1/deployments/x/embeddings?api-version=1",
                                  b"/v1/deployments"])
def test_azure_deployment_paths_are_404(path: bytes) -> None:
    # An Azure upstream would take the deployment from the client's path, not the route.
    with pytest.raises(NotFound, match="deployment"):
        classify(b"POST", path)
    assert classify(b"GET", b"/v1/deploymentsx") is Kind.FORWARD


@pytest.mark.parametrize(("target", "normal"), [
    (b"/v1/chat/c%6Fmpletions", b"/v1/chat/completions"),
    (b"/v1/%63hat/%43OMPLETIONS", b"/v1/chat/COMPLETIONS"),  # decoded, then it is unknown
    (b"/v1/emb%65ddings?q=%2e%2F", b"/v1/embeddings?q=%2e%2F"),  # the query is left alone
    (b"/v1/models/ft%3Agpt-4o%20x", b"/v1/models/ft%3Agpt-4o%20x"),  # reserved: kept as sent
    (b"/v1/files/%C3%A9", b"/v1/files/%C3%A9"),
    (b"/v1/models/a%2Db%5F%7e", b"/v1/models/a-b_~"),
])
def test_escaped_unreserved_characters_are_decoded_once(target: bytes, normal: bytes) -> None:
    assert normal_target(target) == normal
    assert normal_target(normal) == normal  # once: the result is stable


@pytest.mark.parametrize("target", [
    b"/v1/chat/completions%00", b"/v1/a%252e", b"/v1/chat/completions%3Bx", b"/v1/x%3fy",
    b"/v1/x%23y", b"/v1/x%7F", b"/v1/x%", b"/v1/x%4", b"/v1/x%zz", b"/v1/a%2e", b"/v1/a%2F",
])
def test_escapes_that_could_become_structure_are_refused(target: bytes) -> None:
    with pytest.raises(InvalidPath):
        normal_target(target)


@pytest.mark.parametrize("path", [
    b"/v1/../x", b"/v1/%2e%2e/x", b"/v1/%2E%2e/x", b"/v1/.%2E/x", b"/v1/chat/completions/../../x",
    b"/v1//host/x", b"//v1/models", b"/v1/chat/completions/", b"/v1/models/", b"/v1/.",
    b"/v1/./models", b"/v1/models/..", b"/v1/chat/completions;x", b"/v1/models;v=1",
    b"/v1/a%2fb", b"/v1/a%2Fb", b"/v1/a%5cb", b"/v1/a%5Cb", b"/v1/a\\b", b"/v1/x#frag",
    b"/healthz/", b"/./healthz", b"/v1/chat/completions/?x=1",
])
@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_unnormalised_paths_are_400_before_routing(method: bytes, path: bytes) -> None:
    with pytest.raises(InvalidPath) as err:
        classify(method, path)
    assert err.value.status == 400 and err.value.code == "invalid_path"


@pytest.mark.parametrize(("path", "route"), [
    (b"/v1/models?after=/../x;%2e//", Kind.FORWARD),  # queries are not inspected
    (b"/v1/files/file.jsonl", Kind.FORWARD),
    (b"/v1/files/..hidden", Kind.FORWARD),  # a name starting with dots is not a dot segment
    (b"/v1/a%2Db", Kind.FORWARD),  # other escapes are the upstream's business
    (b"/", Kind.ROOT),
])
def test_normal_paths_still_route(path: bytes, route: Kind) -> None:
    assert classify(b"POST" if route is Kind.ROOT else b"GET", path) is route


def _auth(**env: str) -> Auth:
    return Auth(load(env, dotenv=None))


def test_client_keys_are_enforced() -> None:
    auth = _auth(VELOX_API_KEYS="k1,k2")
    auth.check(b"Bearer k2")
    auth.check(b"bearer k1")
    for bad in (None, b"Bearer nope", b"Basic k1", b"Bearer", b"k1"):
        with pytest.raises(Unauthorized):
            auth.check(bad)


def test_no_client_keys_means_no_client_auth() -> None:
    _auth().check(None)


HOP = [
    (b"host", b"gw"), (b"connection", b"keep-alive, x-trace"), (b"keep-alive", b"5"),
    (b"transfer-encoding", b"chunked"), (b"te", b"trailers"), (b"upgrade", b"h2c"),
    (b"content-length", b"10"), (b"expect", b"100-continue"), (b"x-trace", b"1"),
]
END_TO_END = [(b"content-type", b"application/json"), (b"openai-organization", b"org-1"),
              (b"x-stainless-lang", b"python")]


def test_upstream_headers_drop_hop_by_hop_and_swap_in_the_gateway_key() -> None:
    auth = _auth(VELOX_UPSTREAM_API_KEY="sk-upstream", VELOX_API_KEYS="client-key")
    out = auth.upstream_headers([*HOP, *END_TO_END, (b"authorization", b"Bearer client-key")])
    assert out == [*END_TO_END, (b"authorization", b"Bearer sk-upstream")]


def test_client_gateway_key_is_never_forwarded_even_without_upstream_key() -> None:
    auth = _auth(VELOX_API_KEYS="client-key")
    out = auth.upstream_headers([*END_TO_END, (b"authorization", b"Bearer client-key")])
    assert out == END_TO_END


def test_client_key_passes_through_when_gateway_has_none() -> None:
    auth = _auth()
    out = auth.upstream_headers([*END_TO_END, (b"authorization", b"Bearer sk-own")])
    assert out == [*END_TO_END, (b"authorization", b"Bearer sk-own")]


def test_caller_of_is_the_digest_of_the_presented_credential():
    import hashlib

    from velox.core.types import Request
    from velox.ingress.auth import caller_of

    def req(headers):
        return Request(None, b"POST", b"/v1/embeddings", Kind.MODEL_CALL, headers, b"", True, 0)

    digest = hashlib.sha256(b"sk-one").digest()
    assert caller_of(req([(b"authorization", b"Bearer sk-one")])) == digest
    assert caller_of(req([(b"authorization", b"bearer   sk-one ")])) == digest
    assert caller_of(req([(b"api-key", b"sk-one")])) == digest  # Azure's header
    assert caller_of(req([(b"authorization", b"Bearer sk-two")])) != digest
    assert caller_of(req([])) == b""
    r = req([(b"authorization", b"Bearer sk-one")])
    caller_of(r)
    r.headers = []  # computed once, kept on the request
    assert caller_of(r) == digest
