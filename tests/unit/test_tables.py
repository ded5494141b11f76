"""The VELOX_CONFIG tables file: every mistake named by file, table and key; a full valid file.

Socket-free: files are written to a temporary directory and read through `config.load`, the
same call the gateway makes at start-up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from velox.config import settings as config
from velox.config.settings import ConfigError, load
from velox.config.tables import (
    CATCH_ALL,
    BreakerPolicy,
    RetryPolicy,
    TargetSpec,
    UpstreamSpec,
    azure_path,
    describe,
)

ROOT = Path(__file__).resolve().parents[2]
OPENAI_KEY = "sk-openai-SECRET-0123456789"
AZURE_KEY = "azure-SECRET-abcdef0123456789"
KEYS = {"OPENAI_API_KEY": OPENAI_KEY, "AZURE_OPENAI_API_KEY": AZURE_KEY}

FULL = """
[[upstream]]
name = "openai"
origin = "https://api.openai.com"
api_key_env = "OPENAI_API_KEY"
max_in_flight = 200
rpm = 5000

[[upstream]]
name = "azure"
kind = "azure"
origin = "https://example-eastus.openai.azure.com/"
api_key_env = "AZURE_OPENAI_API_KEY"
api_version = "2024-10-21"
connections = 2
request_timeout_ms = 120000
ca_file = "ca.pem"

[[upstream]]
name = "vllm"
origin = "http://10.0.0.5:8000"
protocol = "h2"
warmup_path = "/health"

[[route]]
model = "gpt-4o"
strategy = "least_busy"
targets = [
  { upstream = "openai", weight = 3 },
  { upstream = "azure", model = "gpt-4o-prod", priority = 1 },
]
fallbacks = ["llama"]

[[route]]
model = "llama"
targets = [{ upstream = "vllm", model = "meta-llama/Llama-3.1-8B-Instruct" }]
strategy = "hash"

[[route]]
model = "*"
targets = [{ upstream = "openai" }]
fallbacks = ["gpt-4o"]

[retry]
attempts = 4
budget_percent = 10

[breaker]
failures = 3
open_s = 10
"""


def write(tmp_path: Path, text: str, name: str = "velox.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_file(path: Path, **env: str) -> config.Settings:
    return load({"VELOX_CONFIG": str(path), **KEYS, **env}, dotenv=None)


def error_for(tmp_path: Path, text: str, **env: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_file(path, **env)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message  # the FILE comes first, always
    return message


# --- a full valid file ---------------------------------------------------------------------


def test_full_file_is_parsed_into_frozen_tables(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not parsed here, only checked to exist\n")
    path = write(tmp_path, FULL)
    s = load_file(path, VELOX_EGRESS_POOL_CONNECTIONS="6", VELOX_REQUEST_TIMEOUT_MS="90000",
                  VELOX_CONNECT_TIMEOUT_MS="3000")
    t = s.tables
    assert t.source == str(path) and s.config_file == str(path)
    assert [u.name for u in t.upstreams] == ["openai", "azure", "vllm"]

    openai_up = t.upstream("openai")
    assert openai_up == UpstreamSpec(
        name="openai", origin="https://api.openai.com", api_key=OPENAI_KEY,
        api_key_env="OPENAI_API_KEY", kind="openai", protocol="auto",
        connections=6, request_timeout_ms=90_000, connect_timeout_ms=3000,  # the VELOX_* scalars
        warmup_path="/v1/models", max_in_flight=200, rpm=5000)
    assert openai_up.auth_headers() == [(b"authorization", b"Bearer " + OPENAI_KEY.encode())]

    azure = t.upstream("azure")
    assert azure.origin == "https://example-eastus.openai.azure.com"  # trailing '/' dropped
    assert (azure.kind, azure.api_version, azure.api_key) == ("azure", "2024-10-21", AZURE_KEY)
    assert (azure.connections, azure.request_timeout_ms) == (2, 120_000)
    assert azure.ca_file == str(tmp_path / "ca.pem")  # relative to the file's directory
    assert azure.warmup_path == "/openai/models?api-version=2024-10-21"
    assert azure.auth_headers() == [(b"api-key", AZURE_KEY.encode())]

    vllm = t.upstream("vllm")
    assert (vllm.protocol, vllm.warmup_path, vllm.api_key, vllm.auth_headers()) == (
        "h2", "/health", "", [])
    assert (vllm.scheme, vllm.host, vllm.port) == ("http", "10.0.0.5", 8000)

    gpt = t.route_for("gpt-4o")
    assert gpt is not None and gpt.strategy == "least_busy" and gpt.fallbacks == ("llama",)
    assert gpt.targets == (TargetSpec("openai", "", 3, 0), TargetSpec("azure", "gpt-4o-prod", 1, 1))
    assert gpt.targets[1].upstream_model("gpt-4o") == "gpt-4o-prod"
    assert gpt.targets[0].upstream_model("gpt-4o") == "gpt-4o"
    llama = t.route_for("llama")
    assert llama is not None and llama.strategy == "hash" and llama.fallbacks == ()
    catch_all = t.route_for("anything-else")
    assert catch_all is not None and catch_all.model == CATCH_ALL
    assert catch_all.strategy == "weighted"

    assert t.retry == RetryPolicy(attempts=4, budget_percent=10)
    assert t.breaker == BreakerPolicy(failures=3, open_s=10)
    for secret in (OPENAI_KEY, AZURE_KEY):  # keys stay out of repr and the printed tables
        assert secret not in repr(s) and secret not in describe(t)
    with pytest.raises(AttributeError):
        t.upstreams[0].name = "other"  # type: ignore[misc]


def test_without_velox_config_the_tables_are_synthesised() -> None:
    s = load({"VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9000", "OPENAI_API_KEY": "sk-x"},
             dotenv=None)
    assert s.config_file == "" and s.tables.source == ""
    [up] = s.tables.upstreams
    assert (up.name, up.origin, up.api_key) == ("default", "http://127.0.0.1:9000", "sk-x")
    [route] = s.tables.routes
    assert route.model == "*" and route.targets == (TargetSpec("default"),)


def test_a_file_without_upstreams_keeps_the_velox_upstream_one(tmp_path: Path) -> None:
    path = write(tmp_path, "[retry]\nattempts = 1\n")
    s = load({"VELOX_CONFIG": str(path), "VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9000"},
             dotenv=None)
    assert [u.origin for u in s.tables.upstreams] == ["http://127.0.0.1:9000"]
    assert s.tables.routes[0].targets == (TargetSpec("default"),)
    assert s.tables.retry.attempts == 1 and s.tables.source == str(path)


def test_one_upstream_without_routes_gets_the_catch_all(tmp_path: Path) -> None:
    path = write(tmp_path, '[[upstream]]\nname = "vllm"\norigin = "http://127.0.0.1:8000"\n')
    [route] = load_file(path).tables.routes
    assert route.model == "*" and route.targets == (TargetSpec("vllm"),)


def test_key_variable_may_come_from_dotenv(tmp_path: Path) -> None:
    path = write(tmp_path, '[[upstream]]\nname = "a"\norigin = "https://a.example"\n'
                           'api_key_env = "A_KEY"\n')
    dotenv = write(tmp_path, "A_KEY=sk-from-dotenv-file\n", name=".env")
    s = load({"VELOX_CONFIG": str(path)}, dotenv=dotenv)
    assert s.tables.upstream("a").api_key == "sk-from-dotenv-file"


def test_egress_http1_makes_every_upstream_http1(tmp_path: Path) -> None:
    path = write(tmp_path, '[[upstream]]\nname = "a"\norigin = "https://a.example"\n')
    s = load_file(path, VELOX_EGRESS="http1")
    assert s.tables.upstream("a").protocol == "http1"


def test_replace_keeps_tables_from_a_file(tmp_path: Path) -> None:
    s = load_file(write(tmp_path, '[[upstream]]\nname = "a"\norigin = "https://a.example"\n'))
    assert config.replace(s, batch_max=8).tables is s.tables


# --- every mistake names the file, the table and the key --------------------------------------

UP = '[[upstream]]\nname = "openai"\norigin = "https://api.openai.com"\n'
ROUTE = '[[route]]\nmodel = "gpt-4o"\ntargets = [{ upstream = "openai" }]\n'


@pytest.mark.parametrize(("text", "expected"), [
    # unknown keys, with the closest valid key suggested
    (UP + 'orign = "x"\n',
     '[[upstream]] #1 (name "openai"): orign: unknown key (did you mean "origin"?)'),
    ('[[upstreams]]\nname = "a"\n',
     'top level: upstreams: unknown key (did you mean "upstream"?)'),
    (UP + ROUTE + '[[route]]\nmodel = "b"\ntargets = [{ upstream = "openai", wieght = 2 }]\n',
     '[[route]] #2 (model "b"), target #1 (upstream "openai"): wieght: unknown key '
     '(did you mean "weight"?)'),
    (UP + "[retry]\nattemps = 2\n", '[retry]: attemps: unknown key (did you mean "attempts"?)'),
    (UP + "[breaker]\nfailure = 2\n", '[breaker]: failure: unknown key (did you mean "failures"?)'),
    (UP + ROUTE.replace("targets", "fallback = []\ntargets"),
     '[[route]] #1 (model "gpt-4o"): fallback: unknown key (did you mean "fallbacks"?)'),
    # wrong types
    (UP + 'connections = "4"\n',
     '[[upstream]] #1 (name "openai"): connections: must be an integer from 1 to 256, '
     'got the string "4"'),
    (UP + "request_timeout_ms = 1.5\n",
     '[[upstream]] #1 (name "openai"): request_timeout_ms: must be an integer from 1 to '
     "86400000, got the float 1.5"),
    (UP + "max_in_flight = true\n",
     '[[upstream]] #1 (name "openai"): max_in_flight: must be an integer from 0 to 1000000, '
     "got the boolean true"),
    (UP.replace('"openai"', "42", 1),
     "[[upstream]] #1: name: must be a string, got the integer 42"),
    (UP + '[[route]]\nmodel = "m"\ntargets = "openai"\n',
     '[[route]] #1 (model "m"): targets: must be a non-empty array of inline tables'),
    (UP + '[[route]]\nmodel = "m"\ntargets = ["openai"]\n',
     '[[route]] #1 (model "m"), target #1: targets: each target must be an inline table'),
    (UP + ROUTE + 'fallbacks = "gpt-4o-mini"\n',
     '[[route]] #1 (model "gpt-4o"): fallbacks: must be an array of route models'),
    ('[upstream]\nname = "a"\norigin = "https://a.example"\n',
     "top level: upstream: [upstream] is a single table; write [[upstream]]"),
    ("retry = 3\n" + UP, "top level: retry: must be a table ([retry]), got the integer 3"),
    (UP + 'kind = "cohere"\n',
     '[[upstream]] #1 (name "openai"): kind: must be one of "openai", "azure", "anthropic", '
     'got "cohere"'),
    (UP + 'protocol = "h3"\n', '[[upstream]] #1 (name "openai"): protocol: must be one of '
     '"auto", "h2", "http1", got "h3"'),
    (UP + ROUTE + 'strategy = "random"\n',
     '[[route]] #1 (model "gpt-4o"): strategy: must be one of "weighted", "least_busy", "hash"'),
    # duplicates
    (UP + UP, '[[upstream]] #2 (name "openai"): name: duplicate name "openai": '
     "[[upstream]] #1 has it already"),
    (UP + ROUTE + ROUTE, '[[route]] #2 (model "gpt-4o"): model: duplicate model "gpt-4o": '
     "[[route]] #1 has it already"),
    # references
    (UP + '[[route]]\nmodel = "m"\ntargets = [{ upstream = "opneai" }]\n',
     '[[route]] #1 (model "m"), target #1 (upstream "opneai"): upstream: "opneai" names no '
     '[[upstream]] (did you mean "openai"?); defined: "openai"'),
    (UP + ROUTE + 'fallbacks = ["gpt-4o-mni"]\n' + ROUTE.replace('"gpt-4o"', '"gpt-4o-mini"'),
     '[[route]] #1 (model "gpt-4o"): fallbacks: "gpt-4o-mni" names no [[route]] '
     '(did you mean "gpt-4o-mini"?)'),
    (UP + ROUTE + 'fallbacks = ["b"]\n'
     + ROUTE.replace('"gpt-4o"', '"b"') + 'fallbacks = ["c"]\n'
     + ROUTE.replace('"gpt-4o"', '"c"') + 'fallbacks = ["gpt-4o"]\n',
     '[[route]] #1 (model "gpt-4o"): fallbacks: fallback cycle: "gpt-4o" -> "b" -> "c" -> '
     '"gpt-4o"'),
    (UP + ROUTE + 'fallbacks = ["gpt-4o"]\n',
     '[[route]] #1 (model "gpt-4o"): fallbacks: fallback cycle: "gpt-4o" -> "gpt-4o"'),
    (UP + ROUTE + 'fallbacks = ["*", "*"]\n' + ROUTE.replace('"gpt-4o"', '"*"'),
     '[[route]] #1 (model "gpt-4o"): fallbacks: names a route twice'),
    # values
    (UP + '[[route]]\nmodel = "m"\ntargets = [{ upstream = "openai", weight = 0 }]\n',
     '[[route]] #1 (model "m"), target #1 (upstream "openai"): weight: must be an integer '
     "from 1 to 1000000, got 0"),
    (UP + '[[route]]\nmodel = "m"\ntargets = []\n',
     '[[route]] #1 (model "m"): targets: must be a non-empty array'),
    (UP + '[[route]]\nmodel = "m"\n', '[[route]] #1 (model "m"): targets: missing'),
    (UP + '[[route]]\ntargets = [{ upstream = "openai" }]\n',
     "[[route]] #1: model: missing (required)"),
    (UP + '[[route]]\nmodel = "m"\ntargets = [{ upstream = "openai", model = "" }]\n',
     '[[route]] #1 (model "m"), target #1 (upstream "openai"): model: must not be empty'),
    ('[[upstream]]\nname = "a"\n', '[[upstream]] #1 (name "a"): origin: missing (required)'),
    (UP.replace("https://api.openai.com", "https://api.openai.com/v1"),
     '[[upstream]] #1 (name "openai"): origin: must be an origin like https://api.openai.com '
     'or http://127.0.0.1:8000 (scheme and host, no path), got "https://api.openai.com/v1"'),
    (UP.replace("https://api.openai.com", "ftp://files.example"),
     '[[upstream]] #1 (name "openai"): origin: must be an origin like'),
    (UP.replace("https://api.openai.com", "https://host:99999"),
     '[[upstream]] #1 (name "openai"): origin: must be an origin like'),
    (UP.replace('"openai"', '"open ai"', 1),
     '[[upstream]] #1 (name "open ai"): name: must be 1-64 letters, digits'),
    (UP + 'warmup_path = "v1/models"\n',
     '[[upstream]] #1 (name "openai"): warmup_path: must be a URL path starting with'),
    (UP + UP.replace('"openai"', '"second"', 1),
     'top level: route: 2 upstreams but no [[route]]'),
    (UP + "[breaker]\nopen_s = 60\nmax_open_s = 30\n",
     "[breaker]: max_open_s: must be >= open_s (60), got 30"),
    (UP + "[retry]\nbudget_percent = 150\n",
     "[retry]: budget_percent: must be an integer from 0 to 100, got 150"),
    # azure
    ('[[upstream]]\nname = "az"\nkind = "azure"\norigin = "https://x.openai.azure.com"\n'
     'api_key_env = "AZURE_OPENAI_API_KEY"\n',
     '[[upstream]] #1 (name "az"): api_version: required with kind = "azure"'),
    ('[[upstream]]\nname = "az"\nkind = "azure"\norigin = "https://x.openai.azure.com"\n'
     'api_version = "2024-10-21"\n',
     '[[upstream]] #1 (name "az"): api_key_env: required with kind = "azure"'),
    (UP + 'api_version = "2024-10-21"\n',
     '[[upstream]] #1 (name "openai"): api_version: only used with kind = "azure"'),
    # keys and files
    (UP + 'api_key_env = "NOT_SET_ANYWHERE"\n',
     '[[upstream]] #1 (name "openai"): api_key_env: the environment variable NOT_SET_ANYWHERE '
     "is not set or empty"),
    (UP + 'api_key_env = "sk-oops-a-key"\n',  # never echoed: it looks like the key itself
     '[[upstream]] #1 (name "openai"): api_key_env: this value looks like a key, not the NAME '
     "of an environment variable"),
    (UP + 'api_key_env = "my key"\n',
     '[[upstream]] #1 (name "openai"): api_key_env: must be the NAME of an environment '
     'variable (letters, digits, \'_\'), got "my key"'),
    (UP + 'ca_file = "missing.pem"\n',
     '[[upstream]] #1 (name "openai"): ca_file: "{dir}/missing.pem" is not an existing file'),
    (UP.replace("https://api.openai.com", "http://127.0.0.1:8000") + 'ca_file = "x.pem"\n',
     '[[upstream]] #1 (name "openai"): ca_file: set for the http:// origin'),
])
def test_mistake_is_named_by_file_table_and_key(tmp_path: Path, text: str, expected: str) -> None:
    message = error_for(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'velox.toml'}: {expected.format(dir=tmp_path)}"), \
        message


def test_empty_key_variable_is_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, UP + 'api_key_env = "EMPTY_KEY"\n', EMPTY_KEY="  ")
    assert "api_key_env: the environment variable EMPTY_KEY is not set or empty" in message


def test_a_key_written_in_the_file_is_refused_without_echoing_it(tmp_path: Path) -> None:
    message = error_for(tmp_path, UP + 'api_key = "sk-pasted-by-mistake-123456"\n')
    assert '[[upstream]] #1 (name "openai"): api_key: keys never go in the file' in message
    assert "api_key_env" in message and "sk-pasted" not in message


def test_toml_syntax_error_gives_line_and_column(tmp_path: Path) -> None:
    message = error_for(tmp_path, UP + "\n[[route]\nmodel = 1\n")
    assert re.search(r"TOML syntax error: .*\(at line 5, column \d+\)", message), message


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"{missing}: cannot read the VELOX_CONFIG "
                                                    "file: No such file or directory")):
        load_file(missing)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read the VELOX_CONFIG "
                                                    "file: Is a directory")):
        load_file(tmp_path)
    binary = write(tmp_path, "")
    binary.write_bytes(b"[[upstream]]\nname = \"\xff\"\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_file(binary)


def test_h2_upstream_contradicts_http1_egress(tmp_path: Path) -> None:
    message = error_for(tmp_path, UP + 'protocol = "h2"\n', VELOX_EGRESS="http1")
    assert '[[upstream]] #1 (name "openai"): protocol: "h2" contradicts VELOX_EGRESS=http1' \
        in message


# --- the path mapping and what is printed ---------------------------------------------------


def azure_spec(version: str = "2024-10-21") -> UpstreamSpec:
    return UpstreamSpec(name="az", origin="https://x.openai.azure.com", api_key="k",
                        kind="azure", api_version=version)


def test_openai_paths_are_unchanged() -> None:
    spec = UpstreamSpec(name="o", origin="https://api.openai.com")
    for path in (b"/v1/chat/completions", b"/v1/embeddings?x=1", b"/"):
        assert spec.upstream_path(path, "gpt-4o") is path


@pytest.mark.parametrize(("path", "model", "expected"), [
    (b"/v1/chat/completions", "gpt-4o",
     b"/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"),
    (b"/v1/embeddings", "emb-small",
     b"/openai/deployments/emb-small/embeddings?api-version=2024-10-21"),
    (b"/v1/completions", "inst", b"/openai/deployments/inst/completions?api-version=2024-10-21"),
    (b"/v1/chat/completions?trace=1", "gpt-4o",
     b"/openai/deployments/gpt-4o/chat/completions?trace=1&api-version=2024-10-21"),
    (b"/v1/chat/completions?api-version=2025-01-01", "gpt-4o",
     b"/openai/deployments/gpt-4o/chat/completions?api-version=2025-01-01"),
    (b"/v1/chat/completions", "my deploy/1",
     b"/openai/deployments/my%20deploy%2F1/chat/completions?api-version=2024-10-21"),
    (b"/v1/models", "", b"/openai/models?api-version=2024-10-21"),
    (b"/v1/responses", "gpt-4o", b"/openai/responses?api-version=2024-10-21"),
    (b"/healthz", "gpt-4o", b"/healthz"),
])
def test_azure_paths(path: bytes, model: str, expected: bytes) -> None:
    assert azure_spec().upstream_path(path, model) == expected


def test_azure_deployment_path_needs_a_model() -> None:
    with pytest.raises(ValueError, match="needs a model"):
        azure_path(b"/v1/chat/completions", "", "2024-10-21")


def test_describe_masks_keys_and_round_trips(tmp_path: Path) -> None:
    import tomllib

    (tmp_path / "ca.pem").write_text("x\n")
    s = load_file(write(tmp_path, FULL))
    text = describe(s.tables)
    assert OPENAI_KEY not in text and AZURE_KEY not in text
    assert "# key: OPENAI_API_KEY=sk-…(27 chars)" in text
    assert "# key: AZURE_OPENAI_API_KEY=azu…(29 chars)" in text
    assert "# key: none sent" in text  # vllm
    # What it prints is itself a valid tables file that parses to the same tables.
    again = load_file(write(tmp_path, text, name="printed.toml"))
    assert again.tables.upstreams == s.tables.upstreams
    assert again.tables.routes == s.tables.routes
    assert (again.tables.retry, again.tables.breaker) == (s.tables.retry, s.tables.breaker)
    assert tomllib.loads(text)["route"][0]["model"] == "gpt-4o"


def test_example_file_and_readme_section_agree_and_parse(tmp_path: Path) -> None:
    example = (ROOT / "velox.example.toml").read_text()
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- tables-example:start -->\n```toml\n", 1)[1].split("```", 1)[0]
    assert block == example, "the README's example is velox.example.toml, copied"
    s = load({"VELOX_CONFIG": str(ROOT / "velox.example.toml"), **KEYS}, dotenv=None)
    kinds = {u.kind for u in s.tables.upstreams}
    assert kinds == {"openai", "azure"} and len(s.tables.upstreams) == 3


def test_azure_path_cache_stays_bounded_and_correct() -> None:
    from velox.config import tables

    for n in range(tables._AZURE_PATHS_MAX + 50):
        got = azure_path(b"/v1/embeddings?n=%d" % n, "e", "1")
        assert got == b"/openai/deployments/e/embeddings?n=%d&api-version=1" % n
        assert len(tables._AZURE_PATHS) <= tables._AZURE_PATHS_MAX
