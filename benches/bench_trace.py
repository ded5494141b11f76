"""What tracing costs per request (velox/spend/trace.py), sampled and unsampled.

Groups:

* trace-request: per request, on the recording thread: `Tracer.start` (the sampling decision
  and ids) + `Tracer.record` of a settled request, against building the record alone
  (`record-only`, what the pipeline pays anyway), three ways: unsampled (VELOX_OTEL_SAMPLE=0:
  start and an early return), sampled with one attempt (two ReadableSpans built and queued),
  sampled with three attempts (four spans). Interleaved round by round, timed with the
  thread's CPU clock; `extra_info` has what each adds to `record-only`, in us per request.
* trace-export: the batch processor's thread making those spans and encoding them to OTLP
  protobuf (the bytes are discarded instead of sent), per request of two spans, two ways:
  Velox's encoder (velox/spend/otlp.py, what the OTLP/HTTP exporter is sent) and the SDK's
  (`encode_spans` over the SDK's spans, what any other exporter gets). It runs off the loop,
  but in the same process, so it is CPU the worker's process pays.
* trace-pipeline: one worker's whole request path without sockets (velox_lab/pipeline.py, 64
  clients, one attempt each) with tracing off (VELOX_OTEL_ENDPOINT unset), on at 1% and on at
  100% (VELOX_OTEL_SAMPLE), interleaved round by round on the loop thread's CPU clock. A timed
  round is 8 pipeline rounds (512 requests, ~5 sampled at 1%: with one pipeline round of 64,
  half the rounds held no sampled request and the median round missed their cost). What a
  variant sampled is made into spans and encoded as for the OTLP exporter right after its
  round, untimed (a flush; its CPU counted apart and added per request in `extra_info`):
  left to the processor's thread, the 100% variant's encoding ran during the next variant's
  rounds, always the same one (the rotation keeps the order), and slowed it.

Run: `.venv/bin/pytest --benchmark benches/bench_trace.py`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExportResult

from benches.paired import paired_cpu_us
from velox.spend.trace import AttemptSpan, RequestRecord, RequestTrace, Tracer
from velox_lab.pipeline import Pipeline

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BATCH = 64


class Encoding:
    """An exporter that is handed what the OTLP/HTTP one is (the request's bytes, encoded by
    Velox) and sends nothing. `cpu_ns`: all the CPU of the threads that exported (the
    processor's, and the one closing it), since they started: making and encoding the spans,
    and the queue's handling."""

    def __init__(self) -> None:
        self.threads: dict[int, int] = {}

    @property
    def cpu_ns(self) -> int:
        return sum(self.threads.values())

    def export_encoded(self, data: bytes) -> bool:
        self.threads[threading.get_ident()] = time.thread_time_ns()  # its CPU so far
        return True

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        raise AssertionError("handed spans, not the encoded request")

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def _record(tracer: Tracer, attempts: int, parent: bytes | None,
            rt: RequestTrace | None = None) -> RequestRecord:
    rt = rt or tracer.start(parent)
    t0 = time.perf_counter_ns()
    tries = [AttemptSpan(rt.new_span_id(), "openai", "openai", "api.openai.com", 443, "gpt-4o",
                     t0 + 1000, t0 + 900_000, status=200 if n == attempts - 1 else 503,
                     response_model="gpt-4o-2024-08-06", finish_reasons=("stop",),
                     input_tokens=120, output_tokens=40) for n in range(attempts)]
    return RequestRecord(rt, "chat", "POST", "/v1/chat/completions", "gpt-4o", 200, t0,
                         t0 + 1_000_000, queued_ns=t0 + 5000, parsed_ns=t0 + 9000,
                         limits_ns=t0 + 12_000, key="team-a", route="gpt-4o",
                         response_model="gpt-4o-2024-08-06", finish_reasons=("stop",),
                         input_tokens=120, output_tokens=40, cost_nanos=700_000,
                         attempts=tries)


VARIANTS = ("record-only", "unsampled", "sampled-1-attempt", "sampled-3-attempts")
# record-only: the record with a trace made once, no Tracer.start and no Tracer.record.
_FIXED = RequestTrace(1, 2, 0, False)
ROUNDS = 200


def _variant(variant: str) -> tuple[Tracer, int, bytes | None, bool]:
    # No export during the rounds (one batch as big as the queue): the export thread's
    # encoding is measured apart, and would otherwise take the GIL in the middle of these.
    tracer = Tracer(exporter=Encoding(), sample=0.0 if variant == "unsampled" else 1.0,
                    max_queue=1 << 20, max_export_batch=1 << 20,
                    schedule_delay_ms=3_600_000)
    attempts = 3 if variant.endswith("3-attempts") else 1
    parent = None if variant in ("unsampled", "record-only") else TRACEPARENT
    return tracer, attempts, parent, variant != "record-only"


def test_trace_request_paired(benchmark: Any) -> None:
    """The variants interleaved round by round, each timed with the thread's own CPU clock
    (a busy machine moves them alike). `record-only` builds the record with a fixed trace,
    neither starting nor recording one: what the pipeline pays anyway; the others' difference
    to it is what tracing adds (Tracer.start included)."""
    setups = {v: _variant(v) for v in VARIANTS}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def one_round() -> None:
        for variant, (tracer, attempts, parent, record) in setups.items():
            t0 = time.thread_time_ns()
            for _ in range(BATCH):
                if record:
                    tracer.record(_record(tracer, attempts, parent))
                else:
                    _record(tracer, attempts, parent, _FIXED)
            samples[variant].append((time.thread_time_ns() - t0) / BATCH / 1000)

    benchmark.group = "trace-request: start + record, per request"
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=5)
    base = statistics.median(samples["record-only"])
    info: dict[str, float] = {"record_only_us": round(base, 2)}
    for variant in VARIANTS[1:]:
        info[f"{variant}_adds_us"] = round(statistics.median(samples[variant]) - base, 2)
    benchmark.extra_info.update(info)
    for tracer, *_ in setups.values():
        tracer.processor.on_end = lambda span: None  # type: ignore[method-assign]
        tracer.close(timeout_s=1)


def test_trace_export_encoding(benchmark: Any) -> None:
    """The export thread's work for one request's two spans (thread CPU clock): made from the
    queued records and encoded by Velox (what the OTLP/HTTP exporter is sent), and the SDK's
    way (its spans, `encode_spans`) interleaved with it for comparison."""
    tracer = Tracer(exporter=Encoding(), max_queue=1 << 16, schedule_delay_ms=3_600_000)
    entries: list[Any] = []
    tracer.processor.on_end = entries.append  # type: ignore[method-assign]
    for _ in range(BATCH):
        tracer.record(_record(tracer, 1, TRACEPARENT))
    spans = tracer.exporter.spans
    samples: dict[str, list[float]] = {"velox": [], "sdk": []}

    def run() -> None:
        for name, encode in (("velox", lambda: spans.encoded(entries)),
                             ("sdk", lambda: encode_spans(
                                 spans.readables(entries)).SerializePartialToString())):
            t0 = time.thread_time_ns()
            encode()
            samples[name].append((time.thread_time_ns() - t0) / BATCH / 1000)

    benchmark.group = "trace-export: spans made and encoded, per request of 2 spans"
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=5)
    benchmark.extra_info.update({f"{name}_cpu_us_per_request": round(statistics.median(v), 2)
                                 for name, v in samples.items()})
    tracer.close(timeout_s=1)


PIPELINE_ROUNDS = 60
PIPELINE_WARMUP = 4
PER_ROUND = 8  # pipeline rounds of BATCH requests in a timed round


class Flushed(Encoding):
    """`Encoding`, exporting only when flushed (`flush`): `cpu_ns` is the CPU of the flushes
    (the export runs on the flushing thread: the spans made, encoded, handed over)."""

    def __init__(self) -> None:
        super().__init__()
        self.spent_ns = 0
        self.tracer: Tracer | None = None

    @property
    def cpu_ns(self) -> int:
        return self.spent_ns

    def flush(self) -> None:
        assert self.tracer is not None
        t0 = time.thread_time_ns()
        self.tracer.processor.force_flush()
        self.spent_ns += time.thread_time_ns() - t0


def _pipeline(sample: str | None) -> tuple[Pipeline, Flushed | None, Tracer | None]:
    """A socket-free worker with tracing off (None) or on at `sample`; its exporter encodes
    and discards when flushed (the processor's own thread never exports: its batch is the
    queue, its delay an hour). The queue holds a timed round, so no span is dropped
    (dropping is cheaper than recording: a full queue would flatter the figure)."""
    if sample is None:
        return Pipeline(clients=BATCH), None, None
    pipeline = Pipeline(clients=BATCH, VELOX_OTEL_ENDPOINT="http://127.0.0.1:9",
                        VELOX_OTEL_SAMPLE=sample)
    traced = pipeline.worker.traced
    assert traced is not None
    traced.tracer.close(timeout_s=1)  # the OTLP exporter it made never sent anything
    encoding = Flushed()
    traced.tracer = encoding.tracer = Tracer(exporter=encoding, sample=float(sample),
                                             max_queue=1 << 17, max_export_batch=1 << 17,
                                             schedule_delay_ms=3_600_000)
    return pipeline, encoding, traced.tracer


def _rounds(pipeline: Pipeline) -> Any:
    def run() -> None:
        for _ in range(PER_ROUND):
            pipeline.round()
    return run


def test_trace_pipeline_paired(benchmark: Any) -> None:
    variants = {"tracing off": _pipeline(None), "on, 1% sampled": _pipeline("0.01"),
                "on, 100% sampled": _pipeline("1")}
    flushes = {name: encoding.flush for name, (_, encoding, _) in variants.items()
               if encoding is not None}
    for name, (pipeline, encoding, _) in variants.items():
        _rounds(pipeline)()  # warm-up, its spans encoded and not counted
        for _ in range(PIPELINE_WARMUP - 1):
            _rounds(pipeline)()
        if encoding is not None:
            flushes[name]()
            encoding.spent_ns = 0
    loop_us = paired_cpu_us(
        benchmark, "trace-pipeline: one worker, 512 requests per round, no sockets",
        {name: _rounds(pipeline) for name, (pipeline, _, _) in variants.items()},
        PIPELINE_ROUNDS, BATCH * PER_ROUND, after=flushes)
    requests = PIPELINE_ROUNDS * PER_ROUND * BATCH
    export_us: dict[str, float] = {}
    for name, (pipeline, encoding, tracer) in variants.items():
        assert pipeline.worker.in_flight == 0, name
        if encoding is None or tracer is None:
            assert pipeline.worker.traced is None
            continue
        tracer.close(timeout_s=60)
        stats = tracer.stats()
        assert stats["dropped"] == 0 and stats["pending"] == 0, stats
        export_us[name] = encoding.cpu_ns / requests / 1000
    base = loop_us["tracing off"]
    benchmark.extra_info.update({
        "requests_per_round": BATCH * PER_ROUND, "rounds_per_variant": PIPELINE_ROUNDS,
        "loop_cpu_us_per_request": {k: round(v, 2) for k, v in loop_us.items()},
        "loop_over_off_us": {k: round(v - base, 2) for k, v in loop_us.items()},
        "export_thread_cpu_us_per_request": {k: round(v, 2) for k, v in export_us.items()},
    })
    print()
    for name, value in loop_us.items():
        extra = export_us.get(name, 0.0)
        print(f"  {name:18s} loop {value:6.2f} us/request CPU ({value - base:+.2f}), export "
              f"thread {extra:6.2f}: total {value - base + extra:+.2f} over off")
