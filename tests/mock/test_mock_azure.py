"""The mock as an Azure OpenAI upstream (the official SDK's AzureOpenAI client against it), its
request log (which instance answered, path, query, model, deployment, auth kind without the
key), and embeddings that are a function of their inputs, with a per-input latency."""

from __future__ import annotations

import json
import ssl
import time

import httpx2
import openai
import pytest

from tests.conftest import closed_after_the_test
from velox_lab.mock import MockUpstream, fingerprint
from velox_lab.mock.payloads import embedding_vector

API_VERSION = "2024-10-21"
AZURE_KEY = "azure-mock-key-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log), name="azure-east") as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()


def http_client(mock: MockUpstream) -> httpx2.Client:
    client = httpx2.Client(http2=True, verify=ssl.create_default_context(cafile=mock.ca_file))
    closed_after_the_test(client)
    return client


@pytest.fixture
def azure(mock):
    mock.reset()
    client = openai.AzureOpenAI(azure_endpoint=mock.origin, api_version=API_VERSION,
                                api_key=AZURE_KEY, http_client=http_client(mock),
                                max_retries=0, timeout=10)
    yield client
    client.close()


def test_azure_sdk_chat_streaming_and_embeddings(azure, mock):
    reply = azure.chat.completions.create(model="gpt4o-prod", messages=MESSAGES)
    assert reply.object == "chat.completion" and reply.choices[0].message.content
    chunks = list(azure.chat.completions.create(model="gpt4o-prod", messages=MESSAGES,
                                                stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    emb = azure.embeddings.create(model="emb-small", input=["a", "b"])
    assert [d.index for d in emb.data] == [0, 1]

    log = mock.requests(10)
    assert [e["path"].partition("?")[0] for e in log] == [
        "/openai/deployments/gpt4o-prod/chat/completions",
        "/openai/deployments/gpt4o-prod/chat/completions",
        "/openai/deployments/emb-small/embeddings"]
    for entry in log:
        assert entry["instance"] == "azure-east"
        assert entry["query"] == f"api-version={API_VERSION}"
        assert entry["path"].endswith("?" + entry["query"])
        assert entry["auth"] == {"kind": "api-key", "key_sha256": fingerprint(AZURE_KEY)}
        assert AZURE_KEY not in json.dumps({k: v for k, v in entry.items() if k != "headers"})
        assert entry["status"] == 200
    # The SDK also puts the model in the body; the log shows both it and the deployment.
    assert [(e["model"], e["deployment"]) for e in log] == [
        ("gpt4o-prod", "gpt4o-prod"), ("gpt4o-prod", "gpt4o-prod"), ("emb-small", "emb-small")]


def test_azure_without_api_key_is_401_with_azure_body(mock):
    with openai.AzureOpenAI(azure_endpoint=mock.origin, api_version=API_VERSION,
                            azure_ad_token="not-a-key", http_client=http_client(mock),
                            max_retries=0, timeout=10) as client, \
            pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="gpt4o-prod", messages=MESSAGES)
    assert err.value.status_code == 401
    assert err.value.body == {"code": "401", "message": (
        "Access denied due to invalid subscription key or wrong API endpoint. Make sure to "
        "provide a valid key for an active subscription and use a correct regional API "
        "endpoint for your resource.")}
    entry = mock.requests(1)[0]
    assert entry["auth"] == {"kind": "authorization", "key_sha256": fingerprint("not-a-key")}
    assert entry["status"] == 401


def test_azure_needs_api_version_and_a_known_path(mock):
    with http_client(mock) as http:
        body = {"messages": MESSAGES}
        chat = mock.origin + "/openai/deployments/d1/chat/completions"
        missing = http.post(chat, json=body, headers={"api-key": AZURE_KEY})
        assert missing.status_code == 404
        assert missing.json() == {"error": {"code": "404", "message": "Resource not found"}}
        empty = http.post(chat + "?api-version=", json=body, headers={"api-key": AZURE_KEY})
        assert empty.status_code == 404
        ok = http.post(chat + "?x=1&api-version=" + API_VERSION, json=body,
                       headers={"api-key": AZURE_KEY})
        assert ok.status_code == 200 and ok.json()["model"] == "d1"  # no model in the body
        unknown = http.post(mock.origin + "/openai/deployments/d1/images/edits?api-version=1",
                            json=body, headers={"api-key": AZURE_KEY})
        assert unknown.status_code == 404
        models = http.get(mock.origin + "/openai/models?api-version=" + API_VERSION,
                          headers={"api-key": AZURE_KEY})
        assert models.status_code == 200 and models.json()["object"] == "list"
        responses = http.post(mock.origin + "/openai/responses?api-version=" + API_VERSION,
                              json={"model": "d2", "input": "hi"},
                              headers={"api-key": AZURE_KEY})
        assert responses.status_code == 200 and responses.json()["model"] == "d2"
    entry = next(e for e in mock.requests(10) if e["query"] == "x=1&api-version=" + API_VERSION)
    assert (entry["model"], entry["deployment"]) == (None, "d1")


def test_three_named_mocks_tell_which_answered():
    mocks = [MockUpstream(tls=False, name=name) for name in ("alpha", "beta", "gamma")]
    try:
        for m in mocks:
            m.start()
        assert [m.ready["name"] for m in mocks] == ["alpha", "beta", "gamma"]
        for m, key in zip(mocks, ("k-alpha", "k-beta", "k-gamma"), strict=True):
            with httpx2.Client() as http:
                r = http.post(m.origin + "/v1/chat/completions", json={
                    "model": f"model-of-{m.name}", "messages": MESSAGES},
                    headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200
        for m, key in zip(mocks, ("k-alpha", "k-beta", "k-gamma"), strict=True):
            [entry] = m.requests()
            assert entry["instance"] == m.name and m.stats()["name"] == m.name
            assert entry["model"] == f"model-of-{m.name}" and entry["deployment"] is None
            assert entry["auth"] == {"kind": "authorization", "key_sha256": fingerprint(key)}
            assert entry["query"] == ""
    finally:
        for m in mocks:
            m.stop()


def test_embeddings_are_a_function_of_each_input(mock):
    mock.reset()
    with http_client(mock) as http:
        def embed(inputs):
            r = http.post(mock.origin + "/v1/embeddings",
                          json={"model": "text-embedding-3-small", "input": inputs})
            assert r.status_code == 200
            return r.json()

        first = embed(["alpha", "beta", "a much longer input text " * 20])
        again = embed(["beta", "alpha"])
    by_text = {"alpha": first["data"][0]["embedding"], "beta": first["data"][1]["embedding"]}
    assert [d["index"] for d in first["data"]] == [0, 1, 2]
    assert again["data"][0]["embedding"] == by_text["beta"]  # same text, same vector
    assert again["data"][1]["embedding"] == by_text["alpha"]
    assert by_text["alpha"] != by_text["beta"]
    assert by_text["alpha"] == embedding_vector("alpha", len(by_text["alpha"]))
    # Tokens follow the input's length: ~4 characters per token.
    long_tokens = first["usage"]["prompt_tokens"] - 2 * 2
    assert long_tokens == len("a much longer input text " * 20) // 4 + 1
    assert again["usage"]["prompt_tokens"] == 2 * (len("alpha") // 4 + 1)


def test_per_input_latency_adds_up(mock):
    """A lower bound only: the answer cannot come before base + n x per-input delay."""
    with http_client(mock) as http:
        started = time.monotonic()
        r = http.post(mock.origin + "/v1/embeddings",
                      json={"model": "text-embedding-3-small", "input": ["x"] * 20},
                      headers={"x-mock-latency-ms": "50", "x-mock-latency-per-input-us": "10000"})
        elapsed = time.monotonic() - started
    assert r.status_code == 200 and len(r.json()["data"]) == 20
    assert elapsed >= 0.05 + 20 * 0.010
