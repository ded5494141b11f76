"""Provider translators: one sans-IO translator per upstream kind (contracts in `base`).

`KINDS` maps each `[[upstream]] kind` to the factory of its translator, called once per target
with that target's settings as keywords (`api_key`, `base_path`, and the kind's own:
`version` and `default_max_tokens` for "anthropic"; `thinking` for "gemini"; `aws_region`,
`aws_access_key_id`, `aws_secret_access_key`, `aws_session_token` (read by the configuration
from the variables its `*_env` keys name), `host` and `embed_input_type` for "bedrock"). A
factory imports its module on first use, so a kind nobody configured costs nothing at start-up.

`messages` is the other direction: the Anthropic Messages API in front, translated to and from
OpenAI chat completions for upstreams that do not speak it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from .base import Translator


def _lazy(module: str, name: str) -> Callable[..., Translator]:
    def make(**settings: Any) -> Translator:
        factory: Callable[..., Translator] = getattr(import_module(module, __name__), name)
        return factory(**settings)
    return make


KINDS: dict[str, Callable[..., Translator]] = {
    "openai": _lazy(".openai", "OpenAITranslator"),
    "anthropic": _lazy(".anthropic", "AnthropicTranslator"),
    "gemini": _lazy(".gemini", "GeminiTranslator"),
    # botocore is an optional extra: importing .bedrock without it names `velox[bedrock]`.
    "bedrock": _lazy(".bedrock", "from_settings"),
}
