"""What gateway keys cost per request (issue 11's performance bullet: at most 3 µs).

Groups:

* keys-stage: the stage alone (velox.admission.keys.KeyStage.admit on a batch of 64 requests,
  then each ticket released), for a key with rpm, tpm and max_parallel (every check runs,
  nothing is refused), for a key without limits (the lookup,
                                                 the gauge and the ticket), and for requests
  of no key (the lookup only). Per request.
* keys-pipeline: one worker's whole request path without sockets (velox_lab/pipeline.py,
  64 clients, the OpenAI SDK's request), with the same tables file four ways: no client
  auth, the client's key in VELOX_API_KEYS, and the client's key as a `[[key]]` with rpm and
  max_parallel, then also tpm (limits high enough that nothing is refused). The variants are
  interleaved round by round and timed with the thread's own CPU clock, so a busy machine
  moves them alike; `extra_info` carries each variant's CPU µs per request and its difference
  to no auth (the keys' cost per request).

Run: `.venv/bin/pytest --benchmark benches/bench_keys.py`.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from velox.admission.keys import KeyStage
from velox.config.settings import load
from velox.core.types import Kind, Request
from velox.state.keys import SharedKeys
from velox_lab.pipeline import CHAT_BODY, Pipeline

BATCH = 64
CLIENT_KEY = b"sk-client-0123456789abcdef"  # what velox_lab.pipeline's requests present
ROUNDS = 300

TABLES = """
[[route]]
model = "gpt-4o-mini"
targets = [{ upstream = "default" }]

[[route]]
model = "*"
targets = [{ upstream = "default" }]
"""
KEY = f"""
[[key]]
name = "bench"
sha256 = "{hashlib.sha256(CLIENT_KEY).hexdigest()}"
rpm = 1000000000
tpm = 1000000000
max_parallel = 1000000
models = ["gpt-4o-mini"]
"""
KEY_WITHOUT_LIMITS = f"""
[[key]]
name = "bench"
sha256 = "{hashlib.sha256(CLIENT_KEY).hexdigest()}"
"""

def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "velox.toml"
    path.write_text(text)
    return str(path)


class _Conn:
    closed = False
    write_paused = False

    def respond_error(self, request: Request, exc: BaseException) -> None:
        raise AssertionError(f"refused in a benchmark: {exc}")


def _batch(key: bytes | None) -> list[Request]:
    headers = [(b"authorization", b"Bearer " + key)] if key else []
    out = []
    for _ in range(BATCH):
        request = Request(_Conn(), b"POST", b"/v1/chat/completions",  # type: ignore[arg-type]
                          Kind.MODEL_CALL, headers, CHAT_BODY, True, 0)
        request.model = "gpt-4o-mini"
        # As ingress leaves it: the digest made by the auth check.
        request.caller = hashlib.sha256(key).digest() if key else b""
        out.append(request)
    return out


@pytest.mark.parametrize("variant", ["key with rpm, tpm, max_parallel", "key without limits",
                                     "no key (VELOX_API_KEYS or none)"])
def test_keys_stage(benchmark: Any, tmp_path: Path, variant: str) -> None:
    text = TABLES + (KEY if "rpm" in variant else KEY_WITHOUT_LIMITS)
    settings = load({"VELOX_CONFIG": _config(tmp_path, text),
                     "VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid"}, dotenv=None)
    stage = KeyStage(settings.tables, SharedKeys(settings.tables.keys, slots=2), 0)
    key = None if variant.startswith("no key") else CLIENT_KEY

    def setup() -> tuple[tuple[list[Request]], dict[str, Any]]:
        return (_batch(key),), {}

    def run(batch: list[Request]) -> None:
        for request in stage.run(batch):
            ticket = request.ticket
            if ticket is not None:
                ticket.settle(10)
                ticket.release()

    benchmark.group = "keys-stage: admit a batch of 64 and release, per request"
    benchmark.pedantic(run, setup=setup, rounds=2000, warmup_rounds=50)
    per_request_us = benchmark.stats.stats.median / BATCH * 1e6
    benchmark.extra_info.update({"requests_per_call": BATCH,
                                 "per_request_us": round(per_request_us, 3)})


PIPELINE_VARIANTS = {  # name -> (tables added to TABLES, env)
    "no client auth": ("", {}),
    "VELOX_API_KEYS": ("", {"VELOX_API_KEYS": CLIENT_KEY.decode()}),
    "[[key]] rpm + max_parallel": (KEY.replace("tpm = 1000000000\n", ""), {}),
    "[[key]] rpm + tpm + max_parallel": (KEY, {}),
}
PAIRED_ROUNDS = 400


def test_keys_pipeline_paired(benchmark: Any, tmp_path: Path) -> None:
    """CPU time of the worker's thread per round (time.thread_time_ns: time the thread ran,
    so other processes on a busy machine do not count), the variants interleaved round by
    round in a rotating order so that drifts of the machine hit them alike."""
    pipelines = {}
    for n, (name, (extra, env)) in enumerate(PIPELINE_VARIANTS.items()):
        directory = tmp_path / str(n)
        directory.mkdir()
        pipeline = Pipeline(clients=BATCH, VELOX_CONFIG=_config(directory, TABLES + extra),
                            **env)
        for _ in range(50):
            pipeline.round()
        pipelines[name] = pipeline
    names = list(pipelines)
    samples: dict[str, list[int]] = {name: [] for name in names}

    def run() -> None:
        clock = time.thread_time_ns
        for r in range(PAIRED_ROUNDS):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                round_ = pipelines[name].round
                t0 = clock()
                round_()
                samples[name].append(clock() - t0)

    gc.collect()
    gc.freeze()
    try:
        benchmark.group = "keys-pipeline: one worker, 64 requests per round, no sockets"
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        gc.unfreeze()
    for pipeline in pipelines.values():
        assert pipeline.worker.in_flight == 0
        keys = pipeline.worker.shared.keys
        if keys.keys:  # every request of the keyed variants was admitted and released
            row = keys.snapshot()[0]
            assert row["active"] == 0 and not any(row["refused"].values())
            assert row["requests"] == (PAIRED_ROUNDS + 50) * BATCH
    per_request_us = {name: statistics.median(v) / BATCH / 1000 for name, v in samples.items()}
    base = per_request_us["no client auth"]
    benchmark.extra_info.update({
        "requests_per_round": BATCH, "rounds_per_variant": PAIRED_ROUNDS,
        "cpu_us_per_request": {k: round(v, 2) for k, v in per_request_us.items()},
        "over_no_auth_us": {k: round(v - base, 2) for k, v in per_request_us.items()},
        "keys_over_api_keys_us": round(per_request_us["[[key]] rpm + tpm + max_parallel"]
                                       - per_request_us["VELOX_API_KEYS"], 2),
    })
    print()
    for name, value in per_request_us.items():
        print(f"  {name:34s} {value:7.2f} us/request CPU  ({value - base:+.2f})")


TEN = 10


@pytest.mark.parametrize("source", ["[[key]] tables", "run-time keys"])
def test_keys_stage_ten_keys(benchmark: Any, tmp_path: Path, source: str) -> None:
    """The stage (lookup, checks, ticket) at 10 keys with rpm, tpm and max_parallel, the
    client's key the 10th: from the file's tables, or made at run time (the same _Key, put
    in by_digest by KeyStage.use_runtime, as a worker applies a control frame). Run on the
    commit before run-time keys too (its `[[key]] tables` row is the before)."""
    digest = hashlib.sha256(CLIENT_KEY).hexdigest()
    others = [hashlib.sha256(b"other-%d" % i).hexdigest() for i in range(TEN - 1)]
    limits = "rpm = 1000000000\ntpm = 1000000000\nmax_parallel = 1000000\n"
    if source == "run-time keys":
        if not hasattr(KeyStage, "use_runtime"):
            pytest.skip("no run-time keys on this commit")
        from velox.admission.runtime import spec_of

        settings = load({"VELOX_CONFIG": _config(tmp_path, TABLES),
                         "VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid"}, dotenv=None)
        shared = SharedKeys(settings.tables.keys, slots=2)
        stage = KeyStage(settings.tables, shared, 0)
        live = {}
        for i, sha in enumerate([*others, digest]):
            index = shared.claim(f"rt{i}")
            assert index is not None
            shared.set_limits(index, 10**9, 10**9)
            row = {"name": f"rt{i}", "sha256": sha, "rpm": 10**9, "tpm": 10**9,
                   "max_parallel": 10**6, "models": ["gpt-4o-mini"]}
            live[bytes.fromhex(sha)] = stage.runtime_key(index, spec_of(row))
        stage.use_runtime(live)
    else:
        text = TABLES + "".join(
            f'\n[[key]]\nname = "k{i}"\nsha256 = "{sha}"\n{limits}models = ["gpt-4o-mini"]\n'
            for i, sha in enumerate([*others, digest]))
        settings = load({"VELOX_CONFIG": _config(tmp_path, text),
                         "VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid"}, dotenv=None)
        stage = KeyStage(settings.tables, SharedKeys(settings.tables.keys, slots=2), 0)

    def setup() -> tuple[tuple[list[Request]], dict[str, Any]]:
        return (_batch(CLIENT_KEY),), {}

    def run(batch: list[Request]) -> None:
        for request in stage.run(batch):
            ticket = request.ticket
            assert ticket is not None
            ticket.settle(10)
            ticket.release()

    benchmark.group = "keys-stage at 10 keys: admit a batch of 64 and release, per request"
    benchmark.pedantic(run, setup=setup, rounds=2000, warmup_rounds=50)
    per_request_us = benchmark.stats.stats.median / BATCH * 1e6
    benchmark.extra_info.update({"keys": TEN, "per_request_us": round(per_request_us, 3)})
