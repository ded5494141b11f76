"""Run-time keys through the admin API of real gateways, and the console's protections.

Every admin endpoint refuses without the token; the key API's whole cycle (create, list, get,
change, rotate, revoke) with the audit naming the token's label; bad input gets 400 and
changes nothing; a restart keeps run-time keys; two gateways sharing a real redis-server see
each other's keys; no secret or hash in any page, answer after creation, log or audit line;
the console's files carry CSP and X-Frame-Options; cross-site and rebinding requests are
refused; `velox key` talks to the same API.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from velox_lab.launch import GatewayProcess, raw_request
from velox_lab.mock import MockUpstream

from .conftest import gateway_env, two_hosts, wait_for

TOKEN = "adm-token-SECRET-0123456789"
ALICE = "alice-token-SECRET-987654321"
FILE_KEY = "vx-file-key-SECRET-abcdef0123"
CONFIG = """
[[upstream]]
name = "main"
origin = "{origin}"
ca_file = "{ca}"
api_key_env = "UPSTREAM_KEY_ENV"

[[route]]
model = "gpt-4o"
targets = [{{ upstream = "main" }}]

[[route]]
model = "*"
targets = [{{ upstream = "main" }}]

[[key]]
name = "from-file"
sha256 = "{digest}"
rpm = 100
"""
CHANGING = (("POST", "/keys"), ("PATCH", "/keys/x"), ("DELETE", "/keys/x"),
            ("POST", "/keys/x/rotate"))
READING = ("/stats", "/metrics", "/debug/pprof/", "/debug/pprof/profile?seconds=1",
           "/debug/pprof/last", "/keys", "/keys/x", "/audit", "/ui/api/series",
           "/ui/api/upstreams")


def config_env(tmp_path: Path, mock: MockUpstream, **extra: str) -> dict[str, str]:
    path = tmp_path / "velox.toml"
    path.write_text(CONFIG.format(origin=mock.origin, ca=mock.ca_file,
                                  digest=hashlib.sha256(FILE_KEY.encode()).hexdigest()))
    return gateway_env(mock, VELOX_CONFIG=str(path), UPSTREAM_KEY_ENV="sk-up-0123456789",
                       **extra)


@pytest.fixture(scope="module")
def gw(upstream: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
       ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("keys-gw")
    env = config_env(tmp, upstream, VELOX_ADMIN_TOKEN=TOKEN,
                     VELOX_ADMIN_TOKENS=f"alice={ALICE}", VELOX_STATE_DIR=str(tmp / "state"))
    with GatewayProcess(env, log_path=tmp / "velox.log") as gateway:
        yield gateway


def admin(gw: GatewayProcess, token: str | None = TOKEN) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=gw.admin_url or "", headers=headers, timeout=20)


def names(client: httpx.Client) -> list[str]:
    return [k["name"] for k in client.get("/keys").json()["keys"]]


def test_every_admin_endpoint_refuses_without_the_token(gw: GatewayProcess) -> None:
    with admin(gw) as ok:
        before = (names(ok), ok.get("/audit").json())
    for token in (None, "wrong", TOKEN + "x"):
        with admin(gw, token) as client:
            for path in READING:
                assert client.get(path).status_code == 401, (token, path)
            for method, path in CHANGING:
                r = client.request(method, path, json={"name": "intruder"})
                assert r.status_code == 401, (token, method, path, r.text)
                assert "VELOX_ADMIN_TOKEN" in r.json()["error"]["message"]
    with admin(gw) as ok:
        assert (names(ok), ok.get("/audit").json()) == before


def test_key_lifecycle_and_the_audit_names_the_tokens_label(gw: GatewayProcess) -> None:
    with admin(gw, ALICE) as client:
        made = client.post("/keys", json={"name": "team-a", "rpm": 600, "tpm": 40_000,
                                          "max_parallel": 8, "models": ["gpt-4o"],
                                          "team": "search", "budget_usd": 50,
                                          "expires_at": "2031-06-01T00:00:00Z"})
        assert made.status_code == 201, made.text
        doc = made.json()
        secret = doc["key"]
        assert secret.startswith("vx-") and doc["created_by"] == "alice"
        assert doc["expires_at"] == "2031-06-01T00:00:00Z" and doc["models"] == ["gpt-4o"]
        listed = {k["name"]: k for k in client.get("/keys").json()["keys"]}
        assert listed["from-file"]["source"] == "config" and listed["from-file"]["read_only"]
        assert listed["from-file"]["usage"]["remaining_requests"] is not None  # live, shared memory
        assert listed["team-a"]["source"] == "runtime"
        # Its usage is live once the supervisor has given it its place in the key table.
        wait_for(lambda: client.get("/keys/team-a").json()["usage"] is not None, timeout=10)
        assert client.get("/keys/team-a").json()["usage"]["remaining_requests"] == 600
        assert "key" not in listed["team-a"]
        one = client.get("/keys/team-a").json()
        assert one["rpm"] == 600 and "key" not in one
        changed = client.patch("/keys/team-a", json={"rpm": 1200, "models": None})
        assert changed.status_code == 200 and changed.json()["rpm"] == 1200
        assert changed.json()["models"] is None
        rotated = client.post("/keys/team-a/rotate", json={"overlap_s": 30})
        assert rotated.status_code == 200 and rotated.json()["key"] not in (secret, "")
        assert rotated.json()["previous_secret_valid_until"] is not None
        assert client.delete("/keys/team-a").status_code == 204
        assert client.get("/keys/team-a").status_code == 404
        assert client.delete("/keys/team-a").status_code == 404
        audit = client.get("/audit?limit=4").json()["entries"]
    assert [(e["who"], e["action"], e["key"]) for e in audit] == [
        ("alice", "revoke", "team-a"), ("alice", "rotate", "team-a"),
        ("alice", "update", "team-a"), ("alice", "create", "team-a")]
    assert audit[1]["detail"] == {"overlap_s": 30}
    assert audit[2]["detail"]["changed"]["rpm"] == [600, 1200]


def settings_of(client: httpx.Client) -> list[dict[str, object]]:
    """GET /keys without each key's live usage (its buckets refill as time passes, and a key
    made a moment ago gets its usage once the workers applied it): what a change would change."""
    return [{k: v for k, v in key.items() if k != "usage"}
            for key in client.get("/keys").json()["keys"]]


@pytest.mark.parametrize(("body", "words"), [
    ({"name": "k1", "colour": "red"}, "unknown field(s) 'colour'"),
    ({"name": "k1", "rpm": -5}, "rpm must be an integer from 0"),
    ({"name": "k1", "max_parallel": -1}, "max_parallel must be an integer from 0"),
    ({"name": "k1", "models": ["no-such-route"]}, "names no route"),
    ({"name": "dup"}, "exists already"),
    ({"name": "from-file"}, "exists already (in the configuration file)"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"x" * 10_000_000, "does not take a body of 10,000,000 bytes"),
])
def test_bad_input_gets_400_with_a_clear_message_and_changes_nothing(
        gw: GatewayProcess, body: object, words: str) -> None:
    with admin(gw) as client:
        if "dup" not in names(client):
            assert client.post("/keys", json={"name": "dup"}).status_code == 201
        before = (settings_of(client), client.get("/audit").json())
        if isinstance(body, bytes):
            r = client.post("/keys", content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post("/keys", json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        assert (settings_of(client), client.get("/audit").json()) == before


def test_file_keys_are_read_only(gw: GatewayProcess) -> None:
    with admin(gw) as client:
        for method, path, body in (("PATCH", "/keys/from-file", {"rpm": 1}),
                                   ("POST", "/keys/from-file/rotate", {}),
                                   ("DELETE", "/keys/from-file", None)):
            r = client.request(method, path, json=body)
            assert r.status_code == 400 and "read-only" in r.json()["error"]["message"], r.text
        assert client.get("/keys/from-file").json()["rpm"] == 100


def test_rotation_overlap_ends_on_time(gw: GatewayProcess) -> None:
    with admin(gw) as client:
        client.post("/keys", json={"name": "short"})
        r = client.post("/keys/short/rotate", json={"overlap_s": 1})
        assert r.json()["previous_secret_valid_until"] is not None
        # The event: the overlap's end, as the API reports it (the workers enforce it in step 2).
        wait_for(lambda: client.get("/keys/short").json()["previous_secret_valid_until"] is None,
                 timeout=30)
        unbound = client.post("/keys/short/rotate", json={"overlap_s": -1})
        assert unbound.status_code == 400 and "overlap_s" in unbound.json()["error"]["message"]


def test_no_secret_or_hash_in_pages_answers_logs_or_audit(gw: GatewayProcess) -> None:
    with admin(gw) as client:
        made = client.post("/keys", json={"name": "leak-check", "rpm": 5}).json()
        secret = made["key"]
        rotated = client.post("/keys/leak-check/rotate", json={"overlap_s": 60}).json()["key"]
        shown = []
        for path in ("/keys", "/keys/leak-check", "/audit", "/stats", "/metrics", "/ui",
                     "/ui/app.js", "/ui/api/series?after=0", "/ui/api/upstreams",
                     "/debug/pprof/"):
            r = client.get(path)
            assert r.status_code == 200, path
            shown.append(r.text)
    text = "\n".join(shown) + gw.log()
    for value in (secret, rotated, TOKEN, ALICE, FILE_KEY):
        assert value not in text
        assert hashlib.sha256(value.encode()).hexdigest() not in text


def test_console_files_carry_csp_and_frame_options_and_load_nothing_from_outside(
        gw: GatewayProcess) -> None:
    with admin(gw, None) as client:  # the files hold no data: no token needed
        for path in ("/ui", "/ui/", "/ui/index.html", "/ui/app.js", "/ui/app.css",
                     "/ui/vendor/uPlot.iife.min.js", "/ui/vendor/uPlot.min.css"):
            r = client.get(path)
            assert r.status_code == 200, path
            csp = r.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
            assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
            assert r.headers["x-frame-options"] == "DENY"
            assert r.headers["x-content-type-options"] == "nosniff"
            if path.endswith((".html", ".css", "/ui", "/ui/")):
                for outside in ('src="http', 'href="http', "@import", "url(http", "//fonts"):
                    assert outside not in r.text, (path, outside)
        assert client.get("/ui/../velox.toml").status_code in (401, 404)
        assert client.get("/ui/nope.js").status_code == 404


def test_cross_site_and_rebinding_requests_are_refused(
        upstream: MockUpstream, tmp_path: Path) -> None:
    # No token at all (loopback): the protections that stand when no credential does.
    with GatewayProcess(gateway_env(upstream), log_path=tmp_path / "velox.log") as open_gw:
        host, _, port = (open_gw.admin_url or "").removeprefix("http://").rpartition(":")

        def post(headers: bytes, body: bytes) -> bytes:
            return raw_request(host, int(port), b"POST /keys HTTP/1.1\r\nHost: " + host.encode()
                               + b":" + port.encode() + b"\r\n" + headers + b"Content-Length: "
                               + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                               + body)

        form = post(b"Origin: http://evil.example\r\nContent-Type: "
                    b"application/x-www-form-urlencoded\r\n", b"name=csrf1")
        assert form.startswith(b"HTTP/1.1 403") and b"another origin" in form
        plain = post(b"Content-Type: text/plain\r\n", b'{"name": "csrf2"}')
        assert plain.startswith(b"HTTP/1.1 403") and b"must be JSON" in plain
        site = post(b"Sec-Fetch-Site: cross-site\r\nContent-Type: application/json\r\n",
                    b'{"name": "csrf3"}')
        assert site.startswith(b"HTTP/1.1 403") and b"Sec-Fetch-Site" in site
        rebound = raw_request(host, int(port), b"POST /keys HTTP/1.1\r\nHost: evil.example:"
                              + port.encode() + b"\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 16\r\nConnection: close\r\n\r\n"
                              b'{"name":"csrf4"}')
        assert rebound.startswith(b"HTTP/1.1 403") and b"loopback" in rebound
        with admin(open_gw, None) as client:
            assert names(client) == []
            same = client.post("/keys", json={"name": "fine"},
                               headers={"Origin": open_gw.admin_url or ""})
            assert same.status_code == 201 and same.json()["created_by"] == "local"


def test_restart_keeps_run_time_keys(upstream: MockUpstream, tmp_path: Path) -> None:
    env = gateway_env(upstream, VELOX_ADMIN_TOKEN=TOKEN, VELOX_STATE_DIR=str(tmp_path / "st"))
    with GatewayProcess(env, log_path=tmp_path / "one.log") as first, admin(first) as client:
        made = client.post("/keys", json={"name": "durable", "tpm": 1000}).json()
    env["VELOX_ADMIN_ADDR"] = f"127.0.0.1:{_port(first)}"
    with GatewayProcess(env, log_path=tmp_path / "two.log") as second, admin(second) as client:
        again = client.get("/keys/durable").json()
        assert again["tpm"] == 1000 and again["created_at"] == made["created_at"]
        assert client.get("/audit").json()["entries"][0]["action"] == "create"


def _port(gw: GatewayProcess) -> int:
    return int((gw.admin_url or "").rpartition(":")[2])


def test_two_gateways_sharing_redis_see_each_others_keys(
        upstream: MockUpstream, tmp_path: Path) -> None:
    with two_hosts(upstream, tmp_path, TOKEN) as (a, b), admin(a) as on_a, admin(b) as on_b:
        assert on_a.post("/keys", json={"name": "shared", "rpm": 60}).status_code == 201
        wait_for(lambda: on_b.get("/keys/shared").status_code == 200)
        assert on_b.get("/keys/shared").json()["rpm"] == 60
        assert on_b.delete("/keys/shared").status_code == 204
        wait_for(lambda: on_a.get("/keys/shared").status_code == 404)
        assert on_a.post("/keys", json={"name": "shared"}).status_code == 201  # free again
        assert [e["action"] for e in on_b.get("/audit").json()["entries"]] == [
            "create", "revoke", "create"]


def velox_cli(gw: GatewayProcess, *args: str, stdin: str | None = None,
              ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    env.update(VELOX_ADMIN_ADDR=gw.env["VELOX_ADMIN_ADDR"], VELOX_ADMIN_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "velox", "key", *args], check=False, env=env,
                          input=stdin, capture_output=True, text=True, timeout=60,
                          cwd=gw.env["VELOX_STATE_DIR"])


def test_the_key_commands_talk_to_the_api(gw: GatewayProcess) -> None:
    made = velox_cli(gw, "create", "cli-key", "--rpm", "600", "--models", "gpt-4o")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("vx-") and "shown this once" in made.stderr
    listed = velox_cli(gw, "list")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("cli-key "))
    assert "runtime" in row and "600" in row and "gpt-4o" in row and secret not in listed.stdout
    assert "from-file" in listed.stdout
    rotated = velox_cli(gw, "rotate", "cli-key", "--overlap-s", "5")
    assert rotated.returncode == 0 and rotated.stdout.strip() not in ("", secret)
    as_json = orjson.loads(velox_cli(gw, "list", "--json").stdout)
    assert any(k["name"] == "cli-key" for k in as_json["keys"])
    dup = velox_cli(gw, "create", "cli-key")
    assert dup.returncode == 1 and "exists already" in dup.stderr
    assert velox_cli(gw, "revoke", "cli-key").stdout.strip() == "revoked cli-key"
    gone = velox_cli(gw, "revoke", "cli-key")
    assert gone.returncode == 1 and "404" in gone.stderr
    digest = hashlib.sha256(b"vx-some-key").hexdigest()
    assert velox_cli(gw, "hash", "vx-some-key").stdout.strip() == digest
    assert velox_cli(gw, "hash", stdin="vx-some-key\n").stdout.strip() == digest
