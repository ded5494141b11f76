"""Gateway keys without sockets: the `[[key]]` tables (every mistake named by file, table and
key), Auth with keys, and the keys stage's decisions on fake requests against a real shared
`Limits` (403, rpm / tpm / max_parallel refusals giving back what they took, Retry-After,
x-ratelimit headers, tickets released once, settle). The same behaviour is tested against
real gateways in tests/e2e/test_keys.py."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from velox.admission.keys import KeyStage, estimate
from velox.config.settings import ConfigError, load
from velox.config.tables import KeySpec, describe
from velox.core.errors import Unauthorized, to_response
from velox.core.fields import KF
from velox.core.types import Kind, Request
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth, caller_of
from velox.ingress.connection import ClientConnection, IngressState
from velox.state.keys import SharedKeys, rpm_index, tpm_index
from velox_lab.pipeline import FakeTransport

from ..ends import sent


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


ROUTES = """
[[route]]
model = "m"
targets = [{ upstream = "default" }]

[[route]]
model = "other"
targets = [{ upstream = "default" }]
"""


def load_keys(tmp_path: Path, text: str, routes: str = ROUTES, **env: str) -> Any:
    path = tmp_path / "velox.toml"
    path.write_text(routes + text)
    return load({"VELOX_CONFIG": str(path), "VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9",
                 **env}, dotenv=None)


# --- the [[key]] tables ------------------------------------------------------------------------


def test_keys_are_parsed_in_file_order(tmp_path: Path) -> None:
    settings = load_keys(tmp_path, f"""
[[key]]
name = "team-a"
sha256 = "{sha('ka').upper()}"
rpm = 600
tpm = 60000
max_parallel = 4
models = ["m"]

[[key]]
name = "batch.jobs"
sha256 = "{sha('kb')}"
""")
    a, b = settings.tables.keys
    assert a == KeySpec("team-a", sha("ka"), 600, 60000, 4, ("m",))  # hex lowercased
    assert a.digest == hashlib.sha256(b"ka").digest()
    assert b == KeySpec("batch.jobs", sha("kb"))  # no limits, every model
    text = describe(settings.tables)
    assert 'name = "team-a"' in text and "rpm = 600" in text and 'models = ["m"]' in text


@pytest.mark.parametrize(("table", "where", "message"), [
    ('name = "a"\nsha256 = "abc"', '[[key]] #1 (name "a"): sha256:', "64 hex digits"),
    (f'name = "a"\nsha256 = "{"g" * 64}"', '[[key]] #1 (name "a"): sha256:', "64 hex digits"),
    (f'sha256 = "{sha("x")}"', "[[key]] #1: name:", "missing (required)"),
    ('name = "a"', '[[key]] #1 (name "a"): sha256:', "missing (required)"),
    (f'name = "a b"\nsha256 = "{sha("x")}"', '[[key]] #1 (name "a b"): name:', "1-64 letters"),
    (f'name = "a"\nsha256 = "{sha("x")}"\nrpm = -1', '[[key]] #1 (name "a"): rpm:',
     "from 0 to 1000000000, got -1"),
    (f'name = "a"\nsha256 = "{sha("x")}"\ntpm = "many"', '[[key]] #1 (name "a"): tpm:',
     'got the string "many"'),
    (f'name = "a"\nsha256 = "{sha("x")}"\nmax_parallel = 1000001',
     '[[key]] #1 (name "a"): max_parallel:', "from 0 to 1000000"),
    (f'name = "a"\nsha256 = "{sha("x")}"\nmodels = ["gpt-5"]', '[[key]] #1 (name "a"): models:',
     '"gpt-5" names no [[route]]'),
    (f'name = "a"\nsha256 = "{sha("x")}"\nmodels = "m"', '[[key]] #1 (name "a"): models:',
     "must be an array"),
    (f'name = "a"\nsha256 = "{sha("x")}"\nmodels = ["m", "m"]',
     '[[key]] #1 (name "a"): models:', "names a route twice"),
    (f'name = "a"\nsha256 = "{sha("x")}"\nrmp = 5', '[[key]] #1 (name "a"): rmp:',
     'unknown key (did you mean "rpm"?)'),
    ('name = "a"\nkey = "sk-secret"', '[[key]] #1 (name "a"): key:', "never goes in the file"),
])
def test_key_mistakes_name_file_table_and_key(tmp_path: Path, table: str, where: str,
                                              message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_keys(tmp_path, "\n[[key]]\n" + table + "\n")
    text = str(info.value)
    assert f"velox.toml: {where}" in text, text
    assert message in text, text
    assert "sk-secret" not in text


def test_duplicate_names_and_hashes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'\[\[key\]\] #2 \(name "a"\): name: duplicate name '
                                          r'"a": \[\[key\]\] #1 has it already'):
        load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("x")}"\n'
                            f'[[key]]\nname = "a"\nsha256 = "{sha("y")}"\n')
    with pytest.raises(ConfigError, match=r'\[\[key\]\] #2 \(name "b"\): sha256: the same key as '
                                          r'\[\[key\]\] #1 \("a"\)'):
        load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("x")}"\n'
                            f'[[key]]\nname = "b"\nsha256 = "{sha("x").upper()}"\n')
    with pytest.raises(ConfigError, match=r"top level: key: .*write \[\[key\]\]"):
        load_keys(tmp_path, f'[key]\nname = "a"\nsha256 = "{sha("x")}"\n')


def test_catch_all_is_a_route_a_key_may_name(tmp_path: Path) -> None:
    routes = ROUTES + '\n[[route]]\nmodel = "*"\ntargets = [{ upstream = "default" }]\n'
    settings = load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("x")}"\n'
                                   f'models = ["*"]\n', routes=routes)
    assert settings.tables.keys[0].models == ("*",)


# --- Auth ---------------------------------------------------------------------------------------


def test_auth_accepts_keys_and_api_keys_and_never_forwards_them(tmp_path: Path) -> None:
    settings = load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("vx-k")}"\n',
                         VELOX_API_KEYS="plain")
    auth = Auth(settings)
    assert auth.required
    assert auth.check(b"Bearer vx-k") == hashlib.sha256(b"vx-k").digest()
    assert auth.check(b"bearer  vx-k ") == hashlib.sha256(b"vx-k").digest()
    assert auth.check(b"Bearer plain") == hashlib.sha256(b"plain").digest()  # computed anyway
    for bad in (None, b"Bearer nope", b"Basic vx-k", b"Bearer ", b"vx-k"):
        with pytest.raises(Unauthorized):
            auth.check(bad)
    # Valid keys' digests are remembered (no SHA-256 per request); unknown keys never are.
    assert auth._digests == {b"vx-k": hashlib.sha256(b"vx-k").digest()}
    assert auth.check(b"Bearer vx-k") == hashlib.sha256(b"vx-k").digest()
    # So are the whole Authorization values accepted (one lookup before any parsing), with
    # the same results; refused values never are.
    assert auth._valid == {b"Bearer vx-k": hashlib.sha256(b"vx-k").digest(),
                           b"bearer  vx-k ": hashlib.sha256(b"vx-k").digest(),
                           b"Bearer plain": hashlib.sha256(b"plain").digest()}
    for bad in (b"Bearer nope", b"Basic vx-k"):
        with pytest.raises(Unauthorized):
            auth.check(bad)
    assert len(auth._valid) == 3
    plain_only = Auth(load_keys(tmp_path, "", VELOX_API_KEYS="plain"))
    # VELOX_API_KEYS alone: the digest of the key checked too (the caller's identity is the
    # credential the check read, never another header of the request).
    assert plain_only.check(b"Bearer plain") == hashlib.sha256(b"plain").digest()
    assert plain_only.check(b"Bearer plain") == hashlib.sha256(b"plain").digest()  # _valid
    assert plain_only._valid == {b"Bearer plain": hashlib.sha256(b"plain").digest()}
    # Keys only (no VELOX_API_KEYS): the client's credential is still never passed upstream.
    only_keys = Auth(load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("vx-k")}"\n'))
    headers, passthrough = only_keys.client_headers([(b"authorization", b"Bearer vx-k"),
                                                     (b"x-a", b"1")])
    assert headers == [(b"x-a", b"1")] and passthrough == []


# --- the stage ----------------------------------------------------------------------------------


class FakeConn:
    closed = False
    write_paused = False

    def __init__(self) -> None:
        self.answers: list[tuple[int, dict, dict]] = []

    def respond_error(self, request: Request, exc: BaseException) -> None:
        error = to_response(exc)
        headers = dict(error.headers) | dict(request.extra_headers or [])
        self.answers.append((error.status, headers, orjson.loads(error.body)))


def make_request(key: str | None, model: str | None = "m", body: bytes = b"{}",
                 route: Kind = Kind.MODEL_CALL, method: bytes = b"POST",
                 path: bytes = b"/v1/chat/completions") -> Request:
    headers = [(b"authorization", b"Bearer " + key.encode())] if key else []
    request = Request(FakeConn(), method, path, route, headers, body, True, 0)
    request.model = model if route is not Kind.FORWARD else None
    return request


def stage_for(tmp_path: Path, keys: str, slot: int = 0) -> tuple[KeyStage, SharedKeys]:
    settings = load_keys(tmp_path, keys)
    shared = SharedKeys(settings.tables.keys, slots=4)
    return KeyStage(settings.tables, shared, slot), shared


def answer(request: Request) -> tuple[int, dict, dict]:
    (only,) = request.conn.answers  # type: ignore[attr-defined]
    return only


def test_requests_of_no_key_pass_untouched(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\nrpm = 1\n')
    batch = [make_request(None), make_request("other"), make_request("other")]
    assert stage.run(batch) == batch
    assert all(r.key == -1 and r.ticket is None and r.extra_headers is None for r in batch)
    assert shared.limits.level(rpm_index(0)) == 1  # nothing taken from the key


def test_forbidden_model_is_403_and_takes_nothing(tmp_path: Path) -> None:
    stage, shared = stage_for(
        tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\nrpm = 5\nmodels = ["m"]\n')
    ok, bad, unknown = make_request("k"), make_request("k", "other"), make_request("k", "gpt-x")
    # The gateway's own model list: no model to check, and no forward.
    forward = make_request("k", route=Kind.FORWARD, method=b"GET", path=b"/v1/models")
    assert stage.run([ok, bad, unknown, forward]) == [ok, forward]
    for refused in (bad, unknown):  # "gpt-x" is served by no named route, hence by "*"
        status, headers, body = answer(refused)
        assert status == 403 and body["error"]["code"] == "model_not_allowed"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == "model"
        assert headers[b"x-ratelimit-limit-requests"] == b"5"
    assert shared.limits.level(rpm_index(0)) == 3  # only the two admitted took a request
    assert shared.counters[KF.REFUSED_MODEL].totals()[0] == 2


def test_forwards_need_a_key_that_may_forward(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, "".join(
        f'[[key]]\nname = "{name}"\nsha256 = "{sha(name)}"\n{extra}\n' for name, extra in (
            ("models", 'models = ["m"]'), ("tpm", "tpm = 100"), ("plain", "rpm = 5"),
            ("allowed", 'models = ["m"]\nforward = true'), ("closed", "forward = false"))))
    files = {name: make_request(name, route=Kind.FORWARD, path=b"/v1/files?purpose=batch")
             for name in ("models", "tpm", "plain", "allowed", "closed")}
    admitted = stage.run(list(files.values()))
    assert admitted == [files["plain"], files["allowed"]]
    for name in ("models", "tpm", "closed"):
        status, _, body = answer(files[name])
        assert (status, body["error"]["code"]) == (403, "endpoint_not_allowed")
        assert f"'{name}'" in body["error"]["message"] and "POST /v1/files" in \
            body["error"]["message"] and "forward = true" in body["error"]["message"]
    assert shared.counters[KF.REFUSED_FORWARD].totals()[:5] == [1, 1, 0, 0, 1]
    assert [k["refused"]["forward"] for k in shared.snapshot()] == [1, 1, 0, 0, 1]
    # Admitted forwards are counted among the key's requests.
    assert shared.snapshot()[2]["requests"] == 1 and shared.snapshot()[3]["requests"] == 1


def test_images_and_audio_are_checked_by_model_and_reserve_one_token(tmp_path: Path) -> None:
    stage, _shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n'
                              'tpm = 1000\nmodels = ["m"]\n')
    other = Kind.MODEL_OTHER
    named = make_request("k", "m", route=other, path=b"/v1/images/generations")
    denied = make_request("k", "other", route=other, path=b"/v1/audio/speech")
    default = make_request("k", None, route=other, path=b"/v1/moderations")  # takes "*"
    assert stage.run([named, denied, default]) == [named]
    assert named.ticket.reserved == 1
    assert [answer(r)[2]["error"]["code"] for r in (denied, default)] == \
        ["model_not_allowed"] * 2


def test_rpm_refusal_has_retry_after_and_headers(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\nrpm = 2\n')
    batch = [make_request("k") for _ in range(3)]
    admitted = stage.run(batch)
    assert admitted == batch[:2]
    assert [r.extra_headers for r in admitted] == [
        [(b"x-ratelimit-limit-requests", b"2"), (b"x-ratelimit-remaining-requests", b"1")],
        [(b"x-ratelimit-limit-requests", b"2"), (b"x-ratelimit-remaining-requests", b"0")]]
    status, headers, body = answer(batch[2])
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert "'a'" in body["error"]["message"] and "rpm" in body["error"]["message"]
    # Two requests a minute: the next one in ~30 s.
    assert 25 <= int(headers[b"retry-after"]) <= 30
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert shared.counters[KF.REFUSED_RPM].totals()[0] == 1
    assert shared.limits.entered(rpm_index(0)) == 2 == shared.snapshot()[0]["requests"]


def test_tpm_refusal_gives_the_request_back(tmp_path: Path) -> None:
    stage, shared = stage_for(
        tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\nrpm = 10\ntpm = 1000\n')
    big = b'{"model": "m", "max_tokens": 900}'  # 9 + 900 tokens (velox.relay.usage.estimate)
    first, second = make_request("k", body=big), make_request("k", body=big)
    assert stage.run([first, second]) == [first]
    assert first.ticket.reserved == estimate(first) == -(-len(big) // 4) + 900
    assert first.extra_headers == [
        (b"x-ratelimit-limit-requests", b"10"), (b"x-ratelimit-remaining-requests", b"9"),
        (b"x-ratelimit-limit-tokens", b"1000"),
        (b"x-ratelimit-remaining-tokens", b"%d" % (1000 - first.ticket.reserved))]
    status, headers, _ = answer(second)
    assert status == 429 and headers[b"x-ratelimit-limit-tokens"] == b"1000"
    assert shared.limits.level(rpm_index(0)) == 9  # the refused request's rpm token came back
    # A request estimated above the whole tpm reserves the tpm (not "never"): it can pass a
    # full bucket, the difference is settled later.
    huge = make_request("k", body=b'{"max_tokens": 5000}')
    shared.limits.give(tpm_index(0), 1000)
    assert stage.run([huge]) == [huge] and huge.ticket.reserved == 1000


def test_max_parallel_refusal_gives_back_request_and_tokens(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n'
                                        "rpm = 10\ntpm = 1000\nmax_parallel = 1\n")
    small = b'{"max_tokens": 1}'  # 5 + 1 tokens: the reservation cannot be what refuses
    first, second = make_request("k", body=small), make_request("k", body=small)
    assert stage.run([first, second]) == [first]
    status, headers, body = answer(second)
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert "max_parallel" in body["error"]["message"]
    limits = shared.limits
    # Only the admitted one holds anything: one request and its reservation (six tokens).
    assert limits.level(rpm_index(0)) == 9
    assert limits.level(tpm_index(0)) == 1000 - first.ticket.reserved == 994
    assert limits.active(rpm_index(0)) == 1
    first.ticket.release()
    first.ticket.release()  # idempotent: the second call gives nothing back
    assert limits.active(rpm_index(0)) == 0
    third = make_request("k", body=small)
    assert stage.run([third]) == [third]
    assert limits.active(rpm_index(0)) == 1


def test_every_key_counts_its_requests_in_flight(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n', slot=3)
    batch = [make_request("k") for _ in range(5)]
    assert stage.run(batch) == batch  # no limits: all pass, no headers
    assert all(r.extra_headers is None for r in batch)
    assert shared.limits.active(rpm_index(0)) == 5
    assert shared.forget_slot(3) == 5  # what a dead worker in slot 3 held
    assert shared.snapshot()[0]["active"] == 0
    for r in batch:  # the dead worker's tickets can no longer give anything back
        r.ticket.release()
    assert shared.limits.active(rpm_index(0)) == 0


def test_settle_refunds_or_charges_once(tmp_path: Path) -> None:
    stage, shared = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n'
                                        "tpm = 1000\n")
    limits = shared.limits
    one = make_request("k", body=b'{"max_tokens": 100}')
    assert stage.run([one]) == [one]
    reserved = one.ticket.reserved
    assert limits.level(tpm_index(0)) == 1000 - reserved
    one.ticket.settle(30)  # used less: the rest goes back
    one.ticket.settle(999)  # a second settle changes nothing
    assert limits.taken(tpm_index(0)) == 30
    two = make_request("k", body=b'{"max_tokens": 100}')
    assert stage.run([two]) == [two]
    two.ticket.release()
    two.ticket.settle(2000)  # after release still settles: over-use becomes debt
    assert limits.level(tpm_index(0)) < 0
    three = make_request("k", body=b"{}")
    assert stage.run([three]) == []  # in debt: refused until repaid
    assert answer(three)[0] == 429


def test_caller_digest_from_ingress_is_used(tmp_path: Path) -> None:
    stage, _ = stage_for(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n')
    request = make_request(None)
    request.caller = hashlib.sha256(b"k").digest()  # as ingress sets it after Auth.check
    assert stage.run([request]) == [request] and request.key == 0
    plain = make_request("k")
    assert caller_of(plain) == hashlib.sha256(b"k").digest()


def test_a_reload_with_the_same_key_names_keeps_the_buckets(tmp_path: Path) -> None:
    settings = load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\nrpm = 10\n')
    shared = SharedKeys(settings.tables.keys, slots=4)
    assert shared.limits.take(rpm_index(0), 8) == 0
    lowered = load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k2")}"\nrpm = 5\n')
    again = SharedKeys(lowered.tables.keys, slots=4, previous=shared)
    assert again.limits is shared.limits
    assert again.limits.level(rpm_index(0)) == 2  # kept (capped at the new 5)
    renamed = load_keys(tmp_path, f'[[key]]\nname = "b"\nsha256 = "{sha("k")}"\nrpm = 10\n')
    fresh = SharedKeys(renamed.tables.keys, slots=4, previous=shared)
    assert fresh.limits is not shared.limits and fresh.limits.level(rpm_index(0)) == 10


# --- ingress writes the stage's headers -------------------------------------------------------


def test_ingress_appends_extra_headers_to_every_answer() -> None:
    state = IngressState(None, None, lambda: None, Arena(0),  # type: ignore[arg-type]
                         Auth(load({}, dotenv=None)), 1 << 20, 64 * 1024, lambda: True,
                         None)
    for kind in ("respond", "stream"):
        conn = ClientConnection(state)
        transport = FakeTransport(keep=True)
        conn.connection_made(transport)  # type: ignore[arg-type]
        request = Request(conn, b"POST", b"/v1/x", Kind.MODEL_CALL, [], b"", True, 0)
        request.extra_headers = [(b"x-ratelimit-limit-requests", b"7")]
        conn.current = request
        if kind == "respond":
            conn.respond(request, 200, [(b"content-type", b"application/json")], b"{}")
        else:
            conn.parser.feed_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # the HTTP version
            conn.current = request
            conn.start_stream(sent(request), 200, [(b"content-type", b"text/event-stream")])
        head = b"".join(transport.chunks).partition(b"\r\n\r\n")[0]
        assert b"\r\nx-ratelimit-limit-requests: 7" in head, (kind, head)
