"""The official AWS SDK (boto3 `bedrock-runtime` with endpoint_url) pointed at the mock's
Bedrock face over TLS: converse, converse_stream (real event-stream frames), invoke_model."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EventStreamError

from tests.conftest import closed_after_the_test
from velox_lab.mock import fingerprint

USER = [{"role": "user", "content": [{"text": "Say hello"}]}]
TOOLS = {"tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}}]}


@pytest.fixture(scope="module")
def mock(logged_mock):
    return logged_mock


def make_client(mock, **credentials):
    client = boto3.client("bedrock-runtime", region_name="us-east-1", endpoint_url=mock.origin,
                          verify=mock.ca_file,
                          config=Config(retries={"max_attempts": 1, "mode": "standard"}),
                          **credentials)
    closed_after_the_test(client)
    return client


@pytest.fixture
def client(mock):
    mock.reset()
    return make_client(mock, aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
                       aws_secret_access_key="secret", aws_session_token="session")


def test_converse_signed(client, mock):
    out = client.converse(modelId="anthropic.claude-3-5-sonnet-20240620-v1:0", messages=USER,
                          inferenceConfig={"maxTokens": 100})
    assert out["output"]["message"]["content"] == [{"text": "Hello from the Velox mock "
                                                             "upstream"}]
    assert out["stopReason"] == "end_turn" and out["usage"]["inputTokens"] > 0
    [entry] = mock.requests()
    assert entry["path"] == "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse"
    headers = dict(entry["headers"])
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential="
                                               "AKIAIOSFODNN7EXAMPLE/")
    assert headers["x-amz-security-token"] == "session"
    assert entry["auth"] == {"kind": "sigv4", "key_sha256": fingerprint("AKIAIOSFODNN7EXAMPLE")}


def test_converse_stream_text_and_tool_use(client):
    events = list(client.converse_stream(modelId="m", messages=USER)["stream"])
    assert next(iter(events[0])) == "messageStart"
    text = "".join(e["contentBlockDelta"]["delta"]["text"] for e in events
                   if "contentBlockDelta" in e)
    assert text == "Hello from the Velox mock upstream"
    assert events[-2] == {"messageStop": {"stopReason": "end_turn"}}
    assert events[-1]["metadata"]["usage"]["outputTokens"] > 0
    events = list(client.converse_stream(modelId="m", messages=USER, toolConfig=TOOLS)["stream"])
    start = events[1]["contentBlockStart"]["start"]["toolUse"]
    args = "".join(e["contentBlockDelta"]["delta"]["toolUse"]["input"] for e in events
                   if "contentBlockDelta" in e)
    assert start["name"] == "get_weather" and json.loads(args) == {"city": "mock"}
    assert {"messageStop": {"stopReason": "tool_use"}} in events


def test_two_turn_tool_conversation(client):
    first = client.converse(modelId="m", messages=USER, toolConfig=TOOLS)
    use = first["output"]["message"]["content"][0]["toolUse"]
    assert first["stopReason"] == "tool_use"
    second = client.converse(modelId="m", toolConfig=TOOLS, messages=[
        *USER, first["output"]["message"],
        {"role": "user", "content": [{"toolResult": {"toolUseId": use["toolUseId"],
                                                     "content": [{"text": "3 degrees"}]}}]}])
    assert second["output"]["message"]["content"][0]["text"] == "The tool said: 3 degrees"
    with pytest.raises(ClientError) as info:
        client.converse(modelId="m", toolConfig=TOOLS, messages=[
            *USER, first["output"]["message"],
            {"role": "user", "content": [{"toolResult": {"toolUseId": "other",
                                                         "content": [{"text": "x"}]}}]}])
    assert info.value.response["Error"]["Code"] == "ValidationException"


def test_image_and_structured_output(client):
    out = client.converse(modelId="m", messages=[{"role": "user", "content": [
        {"image": {"format": "png", "source": {"bytes": b"\x89PNG\r\n"}}}, {"text": "What?"}]}])
    assert out["output"]["message"]["content"][0]["text"].endswith("I see 1 image.")
    out = client.converse(modelId="m", messages=USER, outputConfig={"textFormat": {
        "type": "json_schema", "structure": {"jsonSchema": {"schema": json.dumps({
            "type": "object", "properties": {"ok": {"type": "boolean"}}})}}}})
    assert json.loads(out["output"]["message"]["content"][0]["text"]) == {"ok": True}


def test_invoke_model_cohere_embeddings(client):
    out = client.invoke_model(modelId="cohere.embed-english-v3", body=json.dumps({
        "texts": ["a", "bb"], "input_type": "search_document"}))
    body = json.loads(out["body"].read())
    assert len(body["embeddings"]) == 2 and len(body["embeddings"][0]) == 8
    assert int(out["ResponseMetadata"]["HTTPHeaders"]["x-amzn-bedrock-input-token-count"]) > 0


@pytest.mark.parametrize("name, status", [
    ("ThrottlingException", 429), ("ModelNotReadyException", 429),
    ("ValidationException", 400), ("AccessDeniedException", 403),
    ("ResourceNotFoundException", 404), ("ModelTimeoutException", 408),
    ("ModelErrorException", 424), ("InternalServerException", 500),
    ("ServiceUnavailableException", 503),
])
def test_errors_by_model_name(client, name, status):
    with pytest.raises(ClientError) as info:
        client.converse(modelId="error-" + name, messages=USER)
    assert info.value.response["Error"]["Code"] == name
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status


def test_mid_stream_exception(client):
    stream = client.converse_stream(modelId="midstream-ThrottlingException",
                                    messages=USER)["stream"]
    seen = []
    with pytest.raises(EventStreamError) as info:
        for event in stream:
            seen.append(event)
    stream.close()  # the connection the broken stream was read from
    assert info.value.response["Error"]["Code"] == "throttlingException"
    assert any("contentBlockDelta" in e for e in seen)


def test_unsigned_request_refused(mock):
    from botocore import UNSIGNED

    anonymous = boto3.client("bedrock-runtime", region_name="us-east-1",
                             endpoint_url=mock.origin, verify=mock.ca_file,
                             config=Config(signature_version=UNSIGNED,
                                           retries={"max_attempts": 1}))
    closed_after_the_test(anonymous)
    with pytest.raises(ClientError) as info:
        anonymous.converse(modelId="m", messages=USER)
    assert info.value.response["Error"]["Code"] == "MissingAuthenticationTokenException"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
