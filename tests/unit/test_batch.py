"""Embeddings batching without sockets: the split of a merged answer, usage apportioning, the
`batch` key of the tables file, and the group-commit decisions of `Batcher` driven with fakes
(a fake send that records calls, a fake responder per client, a real asyncio loop for the
max_wait_ms timer).

The end-to-end behaviour (real Velox, the mock, the SDK) is tests/e2e/test_batching.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from velox.admission.keys import KeyStage
from velox.batching.batch import Batcher, apportion, apportion_usage, split
from velox.config import settings as config
from velox.config.settings import ConfigError
from velox.config.tables import BatchSpec, RouteSpec, Tables, TargetSpec, UpstreamSpec
from velox.core.fields import F
from velox.core.types import ADMITTED, SENT, Kind, Request
from velox.state.keys import SharedKeys, tpm_index

from .test_keys import load_keys, sha

# --- apportion ------------------------------------------------------------------------------


@pytest.mark.parametrize("total,weights,expected", [
    (10, [1, 1, 1], [4, 3, 3]),  # the remainder goes to the earliest of equal remainders
    (7, [5, 3, 2], [4, 2, 1]),  # quotas 3.5, 2.1, 1.4: the .5 gets the spare one
    (100, [1], [100]),
    (0, [3, 4], [0, 0]),
    (5, [0, 0], [3, 2]),  # no sizes at all: shared equally
    (3, [1, 1000, 1], [0, 3, 0]),
])
def test_apportion_is_largest_remainder(total: int, weights: list[int],
                                        expected: list[int]) -> None:
    assert apportion(total, weights) == expected


def test_apportion_always_adds_up_and_stays_within_one_of_the_quota() -> None:
    for total in (0, 1, 7, 99, 1000, 12345):
        for weights in ([1, 2, 3], [7] * 13, [1, 1, 1000, 5, 0, 2], list(range(1, 33))):
            shares = apportion(total, weights)
            assert sum(shares) == total
            whole = sum(weights)
            for share, w in zip(shares, weights, strict=False):
                assert abs(share - total * w / whole) < 1


def test_apportion_usage_splits_every_count_nested_too() -> None:
    usage = {"prompt_tokens": 11, "total_tokens": 11,
             "prompt_tokens_details": {"cached_tokens": 3}, "note": "x"}
    parts = apportion_usage(usage, [1, 2, 1])
    assert [p["prompt_tokens"] for p in parts] == [3, 5, 3]
    assert sum(p["total_tokens"] for p in parts) == 11
    assert sum(p["prompt_tokens_details"]["cached_tokens"] for p in parts) == 3
    assert all(p["note"] == "x" for p in parts)


# --- split ----------------------------------------------------------------------------------


def _answer(n: int, shuffle: bool = False, tokens: int = 20) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": [float(i), -float(i)]}
            for i in range(n)]
    if shuffle:
        data.reverse()
    return orjson.dumps({"object": "list", "data": data, "model": "up-model-v2",
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def test_split_gives_each_member_its_own_vectors_renumbered_from_zero() -> None:
    parts = [orjson.loads(p) for p in split(_answer(6, shuffle=True), [1, 3, 2], [1, 3, 2])]
    assert [[d["embedding"][0] for d in p["data"]] for p in parts] == [[0.0], [1.0, 2.0, 3.0],
                                                                       [4.0, 5.0]]
    assert [[d["index"] for d in p["data"]] for p in parts] == [[0], [0, 1, 2], [0, 1]]
    assert all(p["model"] == "up-model-v2" and p["object"] == "list" for p in parts)
    usage = [p["usage"]["prompt_tokens"] for p in parts]
    assert sum(usage) == 20 and usage == apportion(20, [1, 3, 2])
    assert sum(p["usage"]["total_tokens"] for p in parts) == 20


@pytest.mark.parametrize("body", [
    _answer(5),  # one embedding short
    orjson.dumps({"object": "list", "data": [{"index": 0}, {"index": 0}, {"index": 1},
                                             {"index": 2}, {"index": 3}, {"index": 4}]}),
    orjson.dumps({"object": "list", "data": [{"index": i} for i in range(1, 7)]}),
    orjson.dumps({"error": "no data"}),
])
def test_split_refuses_an_answer_that_does_not_match_the_inputs(body: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        split(body, [1, 3, 2], [1, 1, 1])


# --- the tables file ------------------------------------------------------------------------


def _load(tmp_path: Path, batch: str) -> config.Settings:
    path = tmp_path / "velox.toml"
    path.write_text(f"""
[[upstream]]
name = "up"
origin = "https://api.openai.com"
api_key_env = "UP_KEY"

[[route]]
model = "emb"
targets = [{{ upstream = "up" }}]
{batch}
""")
    return config.load({"VELOX_CONFIG": str(path), "UP_KEY": "sk-x"}, dotenv=None)


@pytest.mark.parametrize("text,expected", [
    ("", None),
    ("batch = false", None),
    ("batch = true", BatchSpec(32, 2048, 20)),
    ("batch = { max_wait_ms = 5 }", BatchSpec(32, 2048, 5)),
    ("batch = { max_requests = 8, max_inputs = 100, max_wait_ms = 0 }", BatchSpec(8, 100, 0)),
])
def test_batch_key_is_parsed(tmp_path: Path, text: str, expected: BatchSpec | None) -> None:
    assert _load(tmp_path, text).tables.route_for("emb").batch == expected  # type: ignore


@pytest.mark.parametrize("text,message", [
    ("batch = 3", 'key: batch: must be true, false or an inline table'),
    ("batch = { max_requests = 0 }", "batch: max_requests: must be an integer from 1 to 4096"),
    ("batch = { max_wait_ms = 1.5 }", "max_wait_ms: must be an integer from 0 to 60000"),
    ("batch = { max_wait = 5 }", "max_wait: unknown key (did you mean \"max_wait_ms\"?)"),
])
def test_bad_batch_values_name_file_table_and_key(tmp_path: Path, text: str,
                                                  message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    text_of = str(err.value)
    assert text_of.startswith(f"{tmp_path / 'velox.toml'}: [[route]] #1 (model \"emb\")")
    assert message.replace("key: ", "") in text_of


# --- the batcher's decisions, with fakes ----------------------------------------------------


class FakeConn:
    """A client: records what it was answered."""

    closed = False
    write_paused = False

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes]] = []

    def respond(self, request: Request, status: int, headers: Any, body: bytes) -> None:
        self.answers.append((status, bytes(body)))
        request.finish(status, len(body), request.exchange)  # as ingress does once written

    def respond_error(self, request: Request, exc: BaseException) -> None:
        status = getattr(exc, "status", 500)
        self.answers.append((status, b"error"))
        request.finish(status, 5, request.exchange)


class FakeCounters:
    def __init__(self) -> None:
        self.values: dict[int, int] = {}

    def add(self, slot: int, field: int, n: int) -> None:
        self.values[field] = self.values.get(field, 0) + n


class Sent:
    """What the batcher sent through the stage list: one request's exchange."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.doc = orjson.loads(request.body)
        request.exchange = self
        self.t_sent = self.t_headers = 0
        self.upstream_name = b"up"
        self.attempts = 1
        self.streaming = False

    def answer(self, status: int, body: bytes) -> None:
        self.request.conn.respond(self.request, status, [], body)


def _tables(api_key: str = "sk-x", **batch: int) -> Tables:
    up = UpstreamSpec("up", "https://api.openai.com", api_key=api_key)
    return Tables((up,), (RouteSpec("emb", (TargetSpec("up"),), batch=BatchSpec(**batch)),
                          RouteSpec("plain", (TargetSpec("up"),))), source="t.toml")


class Harness:
    def __init__(self, loop: asyncio.AbstractEventLoop, tables: Tables) -> None:
        self.sent: list[Sent] = []
        self.done: list[tuple[Any, int]] = []  # each client request's end: (holder, status)
        self.counters = FakeCounters()
        self.batcher = Batcher(tables, self, loop, self.counters, 0)

    # The worker's side: its stage list (Pipeline) and the requests' end (Lifecycle).

    def run(self, requests: list[Request], from_stage: str) -> None:
        assert from_stage == "send-batched"
        for request in requests:
            request.advance(SENT)  # from BATCHED: the table says a member may leave so
            self.sent.append(Sent(request))

    def release_segment(self, segment: int) -> None:
        pass

    def finished(self, request: Request, status: int, bytes_out: int, holder: Any) -> None:
        self.done.append((holder, status))

    def offer(self, request: Request) -> bool:
        """The worker's batch stage for one request (the batcher makes it BATCHED)."""
        taken = self.batcher.offer(request)
        assert taken == (request.state != ADMITTED)
        return taken

    def leave(self, request: Request) -> None:
        """Its client disconnects: what ingress does (the holder told, then the request
        finished with a 499 unless it was over)."""
        holder = request.exchange
        assert holder is not None
        holder.client_gone()
        if not request.done:
            request.finish(499, 0, holder)

    def request(self, inputs: Any, model: str = "emb", key: str = "k", **extra: Any) -> Request:
        body = orjson.dumps({"model": model, "input": inputs, **extra})
        request = Request(FakeConn(), b"POST", b"/v1/embeddings", Kind.MODEL_CALL,  # type: ignore
                          [(b"authorization", b"Bearer " + key.encode())], body, True, 0,
                          ends=self)
        request.state = ADMITTED  # past the stages before the batch
        request.model = model
        return request


def _embeddings(doc: dict) -> bytes:
    items = doc["input"] if isinstance(doc["input"], list) else [doc["input"]]
    return orjson.dumps({"object": "list", "model": "m", "data": [
        {"object": "embedding", "index": i, "embedding": [len(s)]} for i, s in enumerate(items)],
        "usage": {"prompt_tokens": 3 * len(items), "total_tokens": 3 * len(items)}})


def test_group_commit_first_alone_then_full_batch_then_timer() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=3, max_wait_ms=30))
        first = h.request("a")
        assert h.offer(first)
        await asyncio.sleep(0)  # the end of this loop pass
        assert len(h.sent) == 1 and h.sent[0].request is first  # at once, unchanged
        waiting = [h.request(s) for s in ("bb", "ccc", "dddd", "eeeee")]
        for r in waiting:
            assert h.offer(r)
        assert len(h.sent) == 2  # three arrived while one was in flight: full, one call
        assert h.sent[1].doc["input"] == ["bb", "ccc", "dddd"]
        await asyncio.sleep(0.1)  # the fourth left alone on the timer
        assert len(h.sent) == 3 and h.sent[2].request is waiting[3]
        for sent in h.sent:
            sent.answer(200, _embeddings(sent.doc))
        answers = [orjson.loads(r.conn.answers[0][1]) for r in waiting]  # type: ignore
        assert [a["data"][0]["embedding"] for a in answers] == [[2], [3], [4], [5]]
        assert sum(a["usage"]["prompt_tokens"] for a in answers[:3]) == 9
        c = h.counters.values
        assert (c[F.EMB_BATCHES], c[F.EMB_BATCH_MEMBERS]) == (3, 5)
        assert (c[F.EMB_IMMEDIATE_BATCHES], c[F.EMB_FULL_BATCHES],
                c[F.EMB_TIMEOUT_BATCHES]) == (1, 1, 1)
        assert sorted(s for _, s in h.done) == [200] * 5  # every client ended exactly once
        assert not h.batcher.groups  # nothing left behind

    asyncio.run(run())


def test_a_burst_with_nothing_in_flight_leaves_as_one_call_and_idle_upstream_ends_waits(
        ) -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=8, max_wait_ms=5000))
        burst = [h.request(s) for s in ("p", "q", "r")]
        for r in burst:  # arrived in the same loop pass, nothing of the group in flight
            h.offer(r)
        assert not h.sent
        await asyncio.sleep(0)  # the end of the pass: one call, at once
        assert [s.doc["input"] for s in h.sent] == [["p", "q", "r"]]
        late = h.request("s")
        h.offer(late)  # a call is in flight: waits (max_wait_ms is 5 s) ...
        await asyncio.sleep(0.05)
        assert len(h.sent) == 1
        h.sent[0].answer(200, _embeddings(h.sent[0].doc))  # ... until the group is idle
        await asyncio.sleep(0)
        assert len(h.sent) == 2 and h.sent[1].request is late
        c = h.counters.values
        assert c[F.EMB_IMMEDIATE_BATCHES] == 2 and F.EMB_TIMEOUT_BATCHES not in c

    asyncio.run(run())


def test_not_merged_across_parameters_callers_and_kinds() -> None:
    async def run() -> None:
        tables = _tables(api_key="", max_requests=2, max_wait_ms=1000)  # passthrough upstream
        h = Harness(asyncio.get_running_loop(), tables)
        assert h.offer(h.request("x"))  # in flight: the next ones of ITS group wait
        await asyncio.sleep(0)
        assert not h.offer(h.request("x", model="plain"))  # not a batching route
        for r in (h.request("y", dimensions=4), h.request("y", encoding_format="base64"),
                  h.request("y", user="u1"), h.request("y", key="other"),
                  h.request([1, 2, 3])):
            assert h.offer(r)
        await asyncio.sleep(0)
        assert len(h.sent) == 6  # each found no call of its own group in flight
        assert all(not isinstance(s.doc["input"], list) or s.doc["input"] == [1, 2, 3]
                   for s in h.sent)
        assert h.offer(h.request("z"))  # same group as the first: waits, then ...
        assert h.offer(h.request("w"))  # ... full with this one: one call
        assert h.sent[-1].doc["input"] == ["z", "w"]
        for t in h.batcher.groups.values():
            if t.timer:
                t.timer.cancel()

    asyncio.run(run())


def test_400_sends_each_member_again_alone_and_other_errors_reach_all() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=3, max_wait_ms=1000))
        h.offer(h.request("first"))
        await asyncio.sleep(0)
        members = [h.request(s) for s in ("ok1", "", "ok2")]
        for r in members:
            h.offer(r)
        merged = h.sent[1]
        merged.answer(400, b'{"error": {"message": "bad", "param": "input"}}')
        assert [s.request for s in h.sent[2:]] == members  # each alone, its own request
        assert h.counters.values[F.EMB_SPLIT_RETRIES] == 3
        assert all(not r.conn.answers for r in members)  # type: ignore  # nothing yet
        for sent in h.sent[2:]:
            if sent.doc["input"] == "":
                sent.answer(400, b'{"error": {"message": "bad", "param": "input"}}')
            else:
                sent.answer(200, _embeddings(sent.doc))
        assert [r.conn.answers[0][0] for r in members] == [200, 400, 200]  # type: ignore
        # A 503 (after dispatch gave up) reaches every member as it is.
        more = [h.request(s) for s in ("a", "b", "c")]
        for r in more:
            h.offer(r)
        h.sent[-1].answer(503, b'{"error": {"message": "down"}}')
        assert [r.conn.answers for r in more] == [[(503, b'{"error": {"message": "down"}}')]] * 3  # type: ignore
        h.sent[0].answer(200, _embeddings(h.sent[0].doc))
        assert len(h.done) == 7 and not h.batcher.groups

    asyncio.run(run())


def test_a_member_that_leaves_is_skipped_and_the_last_one_leaving_cancels() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=2, max_wait_ms=1000))
        h.offer(h.request("first"))
        await asyncio.sleep(0)
        a, b, c = h.request("a"), h.request("b"), h.request("c")
        h.offer(a)
        h.leave(a)  # left while waiting
        assert h.done[-1][1] == 499  # its accounting ended at once
        h.offer(b)
        assert len(h.sent) == 1  # a no longer counts: b waits alone
        h.offer(c)  # full: b and c leave as one call, a skipped
        merged = h.sent[-1]
        assert merged.doc["input"] == ["b", "c"]
        cancelled: list[bool] = []
        merged.client_gone = lambda: cancelled.append(True)  # type: ignore[attr-defined]
        h.leave(b)  # left during the call
        assert not cancelled  # c still wants it
        merged.answer(200, _embeddings(merged.doc))
        assert not b.conn.answers  # type: ignore[attr-defined]
        assert orjson.loads(c.conn.answers[0][1])["data"][0]["embedding"] == [1]  # type: ignore
        assert sorted(s for _, s in h.done) == [200, 499, 499]
        d, e = h.request("d"), h.request("e")
        h.offer(d)
        h.offer(e)
        last = h.sent[-1]
        last.client_gone = lambda: cancelled.append(True)  # type: ignore[attr-defined]
        h.leave(d)
        h.leave(e)
        assert cancelled == [True]  # nobody needs the call any more: cancelled

    asyncio.run(run())


def test_a_member_leaving_settles_its_keys_token_reservation(tmp_path: Path) -> None:
    """A keyed member's tpm reservation is settled when its client leaves: all of it comes
    back when it left while queued (nothing of it reached the upstream), and it is charged its
    estimated input when it left while its merged call was upstream (the upstream read it),
    as a lone request's meter charges a client that left mid-call. The merged call's answer
    then settles nobody twice."""
    settings = load_keys(tmp_path, f'[[key]]\nname = "a"\nsha256 = "{sha("k")}"\n'
                                   "tpm = 100000\n", routes=_EMB_ROUTE)
    shared = SharedKeys(settings.tables.keys, slots=1)
    stage = KeyStage(settings.tables, shared, 0)
    limits = shared.limits

    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=2, max_wait_ms=5000))
        h.offer(h.request("first"))  # in flight: what follows waits in the group
        await asyncio.sleep(0)
        queued, carried, stays = (h.request(text) for text in ("queued", "carried", "stays"))
        assert stage.run([queued, carried, stays]) == [queued, carried, stays]
        reserved = sum(r.ticket.reserved for r in (queued, carried, stays))  # type: ignore
        assert limits.taken(tpm_index(0)) == reserved
        h.offer(queued)
        h.leave(queued)  # left while waiting
        assert queued.ticket.settled  # type: ignore[union-attr]
        assert limits.taken(tpm_index(0)) == reserved - queued.ticket.reserved  # type: ignore
        h.offer(carried)
        h.offer(stays)  # full: the two leave as one call
        merged = h.sent[-1]
        assert merged.doc["input"] == ["carried", "stays"]
        h.leave(carried)  # left during the call
        assert carried.ticket.settled  # type: ignore[union-attr]
        input_tokens = -(-len(carried.body) // 4)  # a small body: bytes / 4
        merged.answer(200, _embeddings(merged.doc))  # stays: settled from its own share
        share = orjson.loads(stays.conn.answers[0][1])["usage"]["total_tokens"]  # type: ignore
        assert share == 2  # 6 tokens by weight 7 : 5, the tie to the earlier member
        assert limits.taken(tpm_index(0)) == input_tokens + share

    asyncio.run(run())


_EMB_ROUTE = """
[[route]]
model = "emb"
targets = [{ upstream = "default" }]
"""


def test_merged_call_asks_for_an_uncompressed_answer_and_decodes_a_compressed_one() -> None:
    import gzip

    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=2, max_wait_ms=1000))
        h.offer(h.request("first"))
        await asyncio.sleep(0)
        members = [h.request(s) for s in ("aa", "bbb")]
        for r in members:
            r.headers.append((b"accept-encoding", b"gzip, deflate"))
            h.offer(r)
        merged = h.sent[-1]
        assert merged.doc["input"] == ["aa", "bbb"]
        assert all(name != b"accept-encoding" for name, _ in merged.request.headers)
        # An upstream that compresses anyway: decoded, split, sent without content-encoding.
        body = gzip.compress(_embeddings(merged.doc))
        merged.request.conn.respond(merged.request, 200, [(b"content-encoding", b"gzip")], body)
        answers = [orjson.loads(r.conn.answers[0][1]) for r in members]  # type: ignore
        assert [a["data"][0]["embedding"] for a in answers] == [[2], [3]]

    asyncio.run(run())


def test_print_config_shows_the_batch_of_a_route(tmp_path: Path) -> None:
    from velox.config.tables import describe

    text = describe(_load(tmp_path, "batch = { max_requests = 8 }").tables)
    assert "batch = { max_requests = 8, max_inputs = 2048, max_wait_ms = 20 }" in text


def test_the_last_waiting_member_leaving_stops_its_groups_timer() -> None:
    """A member waiting behind its group's call in flight arms the group's max_wait timer; when
    it was the only one waiting and its client leaves, nothing is left to send: the timer goes
    too (it held the group until it fired), and the group is forgotten with its last call."""
    async def run() -> None:
        h = Harness(asyncio.get_running_loop(), _tables(max_requests=8, max_wait_ms=60_000))
        first = h.request("first")
        h.offer(first)
        await asyncio.sleep(0)  # leaves alone: the group has a call in flight
        waiting = h.request("waiting")
        h.offer(waiting)
        (group,) = h.batcher.groups.values()
        assert group.timer is not None  # armed for the waiting member
        h.leave(waiting)
        assert group.timer is None and not group.pending
        h.sent[0].answer(200, _embeddings(h.sent[0].doc))
        assert not h.batcher.groups
        assert sorted(status for _, status in h.done) == [200, 499]

    asyncio.run(run())
