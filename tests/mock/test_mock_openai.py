"""The official OpenAI SDK pointed straight at the mock upstream over HTTP/2 + TLS."""

from __future__ import annotations

import ssl
import time

import httpx2
import openai
import pytest

from tests.conftest import closed_after_the_test
from velox_lab.mock import MockUpstream

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()  # no callback blew up in the mock


@pytest.fixture
def sdk(mock):
    """(client, versions): versions collects the HTTP version of every response."""
    mock.reset()
    versions: list[str] = []
    http = httpx2.Client(http2=True, verify=ssl.create_default_context(cafile=mock.ca_file),
                         event_hooks={"response": [lambda r: versions.append(r.http_version)]})
    closed_after_the_test(http)
    client = openai.OpenAI(base_url=mock.origin + "/v1", api_key="sk-test", http_client=http,
                           max_retries=0, timeout=10)
    closed_after_the_test(client)
    yield client, versions
    client.close()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_chat_completion(sdk, mock):
    client, versions = sdk
    out = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert out.object == "chat.completion" and out.model == "gpt-4o-mini"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage is not None and out.usage.total_tokens > 0
    assert versions == ["HTTP/2"]
    [entry] = mock.requests()
    assert dict(entry["headers"])["authorization"] == "Bearer sk-test"


def test_streaming_chat_counts_chunks(sdk):
    client, versions = sdk
    stream = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True,
                                            extra_headers={"x-mock-chunks": "6"})
    chunks = list(stream)
    assert len(chunks) == 6
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                           extra_headers={"x-mock-chunks": "6"})
    assert text == whole.choices[0].message.content
    assert versions == ["HTTP/2", "HTTP/2"]


def test_embeddings_base64_default_and_float(sdk):
    client, _ = sdk
    b64 = client.embeddings.create(model="text-embedding-3-small", input=["x", "y"])
    flt = client.embeddings.create(model="text-embedding-3-small", input=["x", "y"],
                                   encoding_format="float")
    assert [len(d.embedding) for d in b64.data] == [8, 8]
    for a, b in zip(b64.data, flt.data, strict=False):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert b64.data[0].embedding != b64.data[1].embedding


def test_responses_plain_and_streamed(sdk):
    client, _ = sdk
    plain = client.responses.create(model="gpt-4o", input="hi",
                                    extra_headers={"x-mock-chunks": "4"})
    assert plain.status == "completed" and plain.output_text
    events = list(client.responses.create(model="gpt-4o", input="hi", stream=True,
                                          extra_headers={"x-mock-chunks": "4"}))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4 and "".join(deltas) == plain.output_text
    assert events[-1].response.output_text == plain.output_text


def test_models_and_not_found(sdk):
    client, _ = sdk
    ids = [m.id for m in client.models.list()]
    assert "gpt-4o" in ids
    with pytest.raises(openai.NotFoundError) as err:
        client.post("/does-not-exist", body={}, cast_to=object)
    assert err.value.status_code == 404


@pytest.mark.parametrize("status, error", [(429, openai.RateLimitError),
                                           (500, openai.InternalServerError),
                                           (503, openai.InternalServerError),
                                           (401, openai.AuthenticationError)])
def test_status_injection_maps_to_sdk_errors(sdk, status, error):
    client, _ = sdk
    with pytest.raises(error) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                       extra_headers={"x-mock-status": str(status)})
    assert err.value.status_code == status
    if status == 429:
        assert err.value.response.headers["retry-after"] == "1"


def test_hang_times_out_and_counts_cancel(sdk, mock):
    client, _ = sdk
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).chat.completions.create(
            model="gpt-4o", messages=MESSAGES, extra_headers={"x-mock-fault": "hang"})
    client.close()  # whatever the SDK's transport does on timeout, closing cancels the stream
    assert wait_for(lambda: mock.stats()["streams_cancelled"] == 1)
    [entry] = mock.requests()
    assert entry["fault"] == "hang" and entry["cancelled"] is True


@pytest.mark.parametrize("fault", ["reset", "close", "reset-mid-stream"])
def test_transport_faults_surface_as_connection_errors(sdk, fault):
    client, _ = sdk
    with pytest.raises(openai.APIConnectionError):
        if fault == "reset-mid-stream":
            list(client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                                stream=True,
                                                extra_headers={"x-mock-fault": fault}))
        else:
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                           extra_headers={"x-mock-fault": fault})
