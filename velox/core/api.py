"""Which API a client speaks on a request, told from its path (a pure function, no I/O).

OpenAI's API is the default. The Anthropic Messages API (`POST /v1/messages` and
`/v1/messages/count_tokens`) is served first-class: its model calls are parsed, keyed, limited,
cached and routed like chat completions, and everything Velox itself answers on these paths is in
Anthropic's error shape, so the Anthropic SDK raises its own exception classes. The test is a
`startswith` and a length compare, about 40 ns, on paths that reach it.
"""

from __future__ import annotations

OPENAI, MESSAGES, COUNT_TOKENS = 0, 1, 2
MESSAGES_PATH = b"/v1/messages"
COUNT_TOKENS_PATH = b"/v1/messages/count_tokens"
_APIS = {MESSAGES_PATH: MESSAGES, COUNT_TOKENS_PATH: COUNT_TOKENS}


def client_api(path: bytes) -> int:
    """OPENAI, MESSAGES or COUNT_TOKENS for a request target (its query ignored)."""
    if not path.startswith(MESSAGES_PATH):
        return OPENAI
    return _APIS.get(path.split(b"?", 1)[0], OPENAI)
