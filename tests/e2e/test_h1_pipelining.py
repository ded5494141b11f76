"""Keep-alive pipelining to a cleartext HTTP/1.1 upstream (VELOX_UPSTREAM_PIPELINE), end to end
on both readers (native, httptools): real gateway processes, the bundled mock (it answers
pipelined requests in order), the official openai SDK from many threads at once.

Each client gets exactly its own answer (each request's prompt has its own length, so an answer
given to the wrong request shows in its usage); a slow answer holds the ones behind it but
loses none; a server that drops the connection mid-pipeline costs each request one answer (its
own, or a 502), never a hang, a duplicate or a leak; the pool reports what it pipelined.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import client_for, gateway_env, wait_for, worker_rows
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

CLIENTS = 24
# Rounds of CLIENTS requests sent at once until the worker's micro-batches have put some on
# one connection (a burst from 24 threads makes batches of several; the bound is generous).
MAX_ROUNDS = 40


@pytest.fixture(params=["native", "httptools"])
def gw(request: pytest.FixtureRequest, plain_mock: MockUpstream,
       tmp_path: Path) -> Iterator[GatewayProcess]:
    env = gateway_env(plain_mock, VELOX_WORKERS="1", VELOX_UPSTREAM_PROTOCOL="http1",
                      VELOX_UPSTREAM_PIPELINE="8", VELOX_EGRESS_POOL_CONNECTIONS="1",
                      VELOX_NATIVE="1" if request.param == "native" else "0")
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gateway:
        yield gateway


def _upstream(gw: GatewayProcess) -> dict[str, Any]:
    (worker,) = worker_rows(gw)
    return worker["state"]["upstream"]  # type: ignore[no-any-return]


def _idle(gw: GatewayProcess) -> bool:
    up = _upstream(gw)
    return up["in_flight"] == 0 and up["queued"] == 0


def _prompt(i: int) -> list[Any]:
    return [{"role": "user", "content": " ".join(["word"] * (i + 1))}]


def _burst(n: int, one: Callable[[int], Any]) -> list[Any]:
    """`one(i)` for i < n from n threads released together; each result or exception."""
    start = threading.Barrier(n)

    def run(i: int) -> Any:
        start.wait(10)
        try:
            return one(i)
        except Exception as exc:  # the outcome is what the test checks
            return exc

    with cf.ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def _until_pipelined(gw: GatewayProcess, one: Callable[[int], Any],
                     check: Callable[[list[Any]], None]) -> None:
    """Bursts until the pool has pipelined at least once, each burst's outcomes checked."""
    for _ in range(MAX_ROUNDS):
        check(_burst(CLIENTS, one))
        if _upstream(gw)["pipelined"]:
            return
    raise AssertionError(f"nothing pipelined in {MAX_ROUNDS} bursts of {CLIENTS}")


def test_concurrent_clients_each_get_their_own_answer(gw: GatewayProcess,
                                                      plain_mock: MockUpstream) -> None:
    client = client_for(gw, timeout=30)
    direct = openai.OpenAI(base_url=plain_mock.origin + "/v1", api_key="sk-direct",
                           max_retries=0, timeout=30)
    expected = {i: direct.chat.completions.create(model="gpt-4o", messages=_prompt(i))
                .usage.prompt_tokens for i in range(CLIENTS)}  # type: ignore[union-attr]
    direct.close()
    assert len(set(expected.values())) == CLIENTS  # one length per request

    def one(i: int) -> int:
        answer = client.chat.completions.create(model="gpt-4o", messages=_prompt(i))
        assert answer.choices[0].message.content
        return answer.usage.prompt_tokens  # type: ignore[union-attr]

    def check(outcomes: list[Any]) -> None:
        assert outcomes == [expected[i] for i in range(CLIENTS)], outcomes

    _until_pipelined(gw, one, check)
    wait_for(lambda: _idle(gw))


def test_a_slow_answer_holds_the_ones_behind_it_and_loses_none(gw: GatewayProcess) -> None:
    client = client_for(gw, timeout=30)
    slow = {"x-mock-latency-ms": "300"}

    def one(i: int) -> tuple[int, int]:
        answer = client.chat.completions.create(
            model="gpt-4o", messages=_prompt(i), extra_headers=slow if i % 6 == 0 else None)
        return i, answer.usage.prompt_tokens  # type: ignore[union-attr]

    def check(outcomes: list[Any]) -> None:
        assert all(isinstance(o, tuple) for o in outcomes), outcomes
        tokens = [t for _, t in outcomes]
        assert tokens == sorted(set(tokens)), tokens  # each its own: longer prompt, more tokens

    _until_pipelined(gw, one, check)
    wait_for(lambda: _idle(gw))


def test_a_server_dropping_the_connection_mid_pipeline_costs_one_answer_each(
        gw: GatewayProcess) -> None:
    client = client_for(gw, timeout=30)
    answered: list[int] = []

    def one(i: int) -> int:
        fault = {"x-mock-fault": "close"} if i % 8 == 3 else None
        answer = client.chat.completions.create(model="gpt-4o", messages=_prompt(i),
                                                extra_headers=fault)
        return answer.usage.prompt_tokens  # type: ignore[union-attr]

    def check(outcomes: list[Any]) -> None:
        for i, outcome in enumerate(outcomes):
            if i % 8 == 3:  # its connection was dropped unanswered
                assert isinstance(outcome, openai.InternalServerError), outcome
                assert outcome.status_code == 502
            elif isinstance(outcome, openai.InternalServerError):  # written behind it
                assert outcome.status_code == 502, outcome
            else:
                assert isinstance(outcome, int), outcome
                answered.append(outcome)

    _until_pipelined(gw, one, check)
    wait_for(lambda: _idle(gw))  # nothing held: every attempt ended
    assert answered  # the requests ahead of a dropped one kept their answers
    # And the pool still serves: a new connection replaces the dropped ones.
    assert client.chat.completions.create(model="gpt-4o", messages=_prompt(0)).choices
    assert "Traceback" not in gw.log()


def test_streams_beside_pipelined_answers_are_whole_and_their_own(gw: GatewayProcess) -> None:
    # Streams go alone (a connection each, their reads from C straight to their clients on the
    # native reader) while the plain answers of the same batches are pipelined.
    client = client_for(gw, timeout=30)

    def one(i: int) -> tuple[str, int]:
        if i % 2:
            answer = client.chat.completions.create(model="gpt-4o", messages=_prompt(i))
            return answer.choices[0].message.content or "", \
                answer.usage.prompt_tokens  # type: ignore[union-attr]
        text, tokens = [], 0
        for chunk in client.chat.completions.create(
                model="gpt-4o", messages=_prompt(i), stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                tokens = chunk.usage.prompt_tokens
        return "".join(text), tokens

    def check(outcomes: list[Any]) -> None:
        assert all(isinstance(o, tuple) and o[0] for o in outcomes), outcomes
        tokens = [t for _, t in outcomes]
        assert tokens == sorted(set(tokens)), tokens
        assert len({text for text, _ in outcomes}) == 1  # the mock's one answer, whole

    check(_burst(CLIENTS, lambda i: one(2 * i)))  # streams only: none pipelined
    assert _upstream(gw)["pipelined"] == 0
    _until_pipelined(gw, one, check)
    wait_for(lambda: _idle(gw))
