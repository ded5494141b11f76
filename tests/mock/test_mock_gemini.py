"""The official google-genai SDK pointed at the mock's Gemini face over TLS (real sockets):
if the SDK cannot read the mock, the mock is wrong."""

from __future__ import annotations

import ssl

import pytest
from google import genai
from google.genai import errors, types

from tests.conftest import closed_after_the_test
from velox_lab.mock import fingerprint


def trusting(mock) -> ssl.SSLContext:
    """The mock's CA as a context: the SDK's httpx deprecates verify=<path>."""
    return ssl.create_default_context(cafile=mock.ca_file)


@pytest.fixture(scope="module")
def mock(logged_mock):
    return logged_mock


@pytest.fixture
def client(mock):
    mock.reset()
    client = genai.Client(api_key="AIza-test", http_options=types.HttpOptions(
          base_url=mock.origin, api_version="v1beta", client_args={"verify": trusting(mock)}))
    closed_after_the_test(client)
    return client


WEATHER = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="get_weather", description="Weather of a city",
    parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}}})])


def test_generate_content_with_key_in_header(client, mock):
    out = client.models.generate_content(model="gemini-2.5-flash", contents="Say hello")
    assert out.text == "Hello from the Velox mock upstream"
    assert out.candidates[0].finish_reason == types.FinishReason.STOP
    assert out.usage_metadata.prompt_token_count > 0
    assert out.usage_metadata.candidates_token_count > 0
    [entry] = mock.requests()
    assert entry["path"] == "/v1beta/models/gemini-2.5-flash:generateContent"
    assert dict(entry["headers"])["x-goog-api-key"] == "AIza-test" and entry["query"] == ""
    assert entry["auth"] == {"kind": "x-goog-api-key", "key_sha256": fingerprint("AIza-test")}


def test_stream(client):
    chunks = list(client.models.generate_content_stream(
        model="gemini-2.5-flash", contents="Say hello",
        config=types.GenerateContentConfig(thinking_config=types.ThinkingConfig(
            thinking_budget=512))))
    assert len(chunks) > 2
    assert "".join(c.text for c in chunks) == "Hello from the Velox mock upstream"
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.thoughts_token_count == 7


def test_image_and_json_mode(client):
    out = client.models.generate_content(model="gemini-2.5-flash", contents=[
        types.Part.from_bytes(data=b"\x89PNG\r\n", mime_type="image/png"), "What is it?"])
    assert out.text.endswith("I see 1 image.")
    out = client.models.generate_content(
        model="gemini-2.5-flash", contents="JSON please",
        config=types.GenerateContentConfig(response_mime_type="application/json",
                                           response_json_schema={"type": "object",
                                                                 "properties": {
                                                                     "n": {"type": "integer"}}}))
    assert out.parsed == {"n": 1} or out.text == '{"n":1}'


def test_two_turn_tool_call_needs_the_thought_signature(client):
    config = types.GenerateContentConfig(
        tools=[WEATHER],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    first = client.models.generate_content(model="gemini-3-pro", contents="Weather in Oslo?",
                                           config=config)
    [call] = first.function_calls
    assert call.name == "get_weather" and call.args == {"city": "mock"} and call.id
    model_turn = first.candidates[0].content
    assert model_turn.parts[0].thought_signature  # bytes, as the SDK decodes them
    answer = types.Content(role="user", parts=[types.Part(function_response=types.
                                                          FunctionResponse(
        id=call.id, name="get_weather", response={"temp": 3}))])
    second = client.models.generate_content(
        model="gemini-3-pro", contents=[types.Content(role="user", parts=[
            types.Part(text="Weather in Oslo?")]), model_turn, answer], config=config)
    assert second.text == 'The tool said: {"temp":3}'
    unsigned = types.Content(role="model", parts=[types.Part(function_call=call)])
    with pytest.raises(errors.ClientError) as info:
        client.models.generate_content(model="gemini-3-pro", contents=[
            types.Content(role="user", parts=[types.Part(text="Weather?")]), unsigned,
            answer], config=config)
    assert info.value.code == 400 and "thought_signature" in info.value.message


def test_embed_content(client, mock):
    out = client.models.embed_content(model="text-embedding-004", contents=["a", "bb", "ccc"],
                                      config=types.EmbedContentConfig(output_dimensionality=4))
    assert [len(e.values) for e in out.embeddings] == [4, 4, 4]
    assert out.embeddings[0].values != out.embeddings[1].values
    assert mock.requests(1)[0]["path"].endswith(":batchEmbedContents")


@pytest.mark.parametrize("name, code, cls", [
    ("INVALID_ARGUMENT", 400, errors.ClientError),
    ("UNAUTHENTICATED", 401, errors.ClientError),
    ("PERMISSION_DENIED", 403, errors.ClientError),
    ("NOT_FOUND", 404, errors.ClientError),
    ("RESOURCE_EXHAUSTED", 429, errors.ClientError),
    ("INTERNAL", 500, errors.ServerError),
    ("UNAVAILABLE", 503, errors.ServerError),
    ("DEADLINE_EXCEEDED", 504, errors.ServerError),
])
def test_errors_by_model_name(client, name, code, cls):
    with pytest.raises(cls) as info:
        client.models.generate_content(model="error-" + name, contents="x")
    assert info.value.code == code and info.value.status == name
    if name == "RESOURCE_EXHAUSTED":
        assert info.value.details["error"]["details"][0]["retryDelay"] == "2s"


def test_error_by_status_header_and_missing_key(client, mock):
    with pytest.raises(errors.ServerError) as info:
        client.models.generate_content(
            model="gemini-2.5-flash", contents="x",
            config=types.GenerateContentConfig(http_options=types.HttpOptions(
                headers={"x-mock-status": "503"})))
    assert info.value.status == "UNAVAILABLE"
    keyless = genai.Client(api_key="placeholder", http_options=types.HttpOptions(
        base_url=mock.origin, client_args={"verify": trusting(mock)},
        headers={"x-goog-api-key": ""}))
    closed_after_the_test(keyless)
    with pytest.raises(errors.ClientError) as info:
        keyless.models.generate_content(model="gemini-2.5-flash", contents="x")
    assert info.value.code == 403 and info.value.status == "PERMISSION_DENIED"


def test_mid_stream_error_raises(client):
    with pytest.raises(errors.APIError) as info:
        for _ in client.models.generate_content_stream(model="midstream-UNAVAILABLE",
                                                       contents="x"):
            pass
    assert info.value.status == "UNAVAILABLE"
