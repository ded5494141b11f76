from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from velox.config import settings as config
from velox.config.settings import FIELDS, ConfigError, load

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_without_environment() -> None:
    s = load({}, dotenv=None)
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert s.ring_depth == 16_384 and s.batch_max == 64 and s.arena_bytes == 262_144
    assert s.rate_limit_rpm == 10_000 and s.rate_limit_burst == 500
    assert s.upstream_origin == "https://api.openai.com"
    assert s.upstream_request_path == "/v1/responses" and s.upstream_warmup_path == "/v1/models"
    assert s.workers == config.usable_cores() == s.egress_pool_connections
    assert s.max_body_bytes == 16 * 1024 * 1024
    assert s.request_timeout_ms == 600_000 and s.connect_timeout_ms == 5_000
    assert s.stream_idle_timeout_ms == 300_000 and s.shutdown_grace_s == 30
    assert s.egress_protocol == "h2" and s.egress == "auto" and s.native


@pytest.mark.parametrize(
    ("name", "value", "form"),
    [
        ("VELOX_PORT", "http", "an integer from 0 to 65535"),
        ("VELOX_PORT", "70000", "an integer from 0 to 65535"),
        ("VELOX_RING_DEPTH", "1000", "a power of two"),
        ("VELOX_BATCH_MAX", "0", "an integer from 1 to"),
        ("VELOX_PIN_WORKERS", "maybe", "one of 1/0"),
        ("VELOX_EGRESS", "curl", "one of auto, http1"),
        ("VELOX_NATIVE", "yes please", "one of 1/0"),
        ("VELOX_UPSTREAM_ORIGIN", "ftp://example.com", "an origin like"),
        ("VELOX_UPSTREAM_ORIGIN", "https://api.openai.com/v1", "an origin like"),
        ("VELOX_UPSTREAM_PROTOCOL", "h3", "one of auto, h2, http1"),
        ("VELOX_UPSTREAM_WARMUP_PATH", "v1/models", "a URL path starting with '/'"),
        ("VELOX_UPSTREAM_CA_FILE", "/nonexistent/ca.pem", "an existing PEM file"),
        ("VELOX_RATE_LIMIT_BURST", "-5", "an integer from 1 to"),
        ("VELOX_LOG_LEVEL", "loud", "one of debug"),
    ],
)
def test_invalid_value_names_the_variable_and_the_form(name: str, value: str, form: str) -> None:
    with pytest.raises(ConfigError) as err:
        load({name: value}, dotenv=None)
    message = str(err.value)
    assert message.startswith(f"{name}={value!r} is invalid: expected ")
    assert form in message


def test_contradictory_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="VELOX_EGRESS=http1 contradicts"):
        load({"VELOX_EGRESS": "http1", "VELOX_UPSTREAM_PROTOCOL": "h2"}, dotenv=None)


def test_protocol_resolution() -> None:
    assert load({"VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9"},
                dotenv=None).egress_protocol == "http1"
    h2c = load({"VELOX_UPSTREAM_ORIGIN": "http://127.0.0.1:9", "VELOX_UPSTREAM_PROTOCOL": "h2"},
               dotenv=None)
    assert h2c.egress_protocol == "h2"
    assert load({"VELOX_EGRESS": "http1"}, dotenv=None).egress_protocol == "http1"


def test_openai_api_key_is_the_fallback_upstream_key() -> None:
    assert load({"OPENAI_API_KEY": "sk-a"}, dotenv=None).upstream_api_key == "sk-a"
    both = load({"OPENAI_API_KEY": "sk-a", "VELOX_UPSTREAM_API_KEY": "sk-b"}, dotenv=None)
    assert both.upstream_api_key == "sk-b"


def test_dotenv_is_read_and_environment_wins(tmp_path: Path) -> None:
    dotenv = tmp_path / ".env"
    dotenv.write_text("VELOX_PORT=9001\nVELOX_BATCH_MAX=8\n")
    s = load({"VELOX_BATCH_MAX": "16"}, dotenv=dotenv)
    assert (s.port, s.batch_max) == (9001, 16)


def test_api_keys_are_a_list_and_redacted() -> None:
    s = load({"VELOX_API_KEYS": "sk-first-key-123, sk-second-key-456",
              "VELOX_UPSTREAM_API_KEY": "sk-upstream-secret"}, dotenv=None)
    assert s.api_keys == ("sk-first-key-123", "sk-second-key-456")
    shown = repr(s.redacted())
    for secret in ("sk-first-key-123", "sk-second-key-456", "sk-upstream-secret"):
        assert secret not in shown


def test_env_example_lists_every_setting_with_its_default() -> None:
    text = (ROOT / ".env.example").read_text()
    assert text == config.env_example(), \
        "regenerate .env.example from velox.config.settings.env_example()"
    names = set(re.findall(r"^(VELOX_[A-Z_]+)=", text, flags=re.M))
    assert names == {f.env for f in FIELDS}
    fields = {f.attr for f in FIELDS}
    assert fields <= set(config.Settings.__dataclass_fields__)


def test_environment_is_read_only_in_config() -> None:
    offenders = []
    for path in (ROOT / "velox").rglob("*.py"):
        if path == ROOT / "velox" / "config" / "settings.py":
            continue
        text = path.read_text()
        if "os.environ" in text or "getenv" in text:
            offenders.append(path.name)
    assert offenders == []


def _velox(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "velox", *args], env={"PATH": "/usr/bin", **env},
                          capture_output=True, text=True, timeout=30, cwd=ROOT / "tests",
                          check=False)


def test_print_config_masks_secrets() -> None:
    out = _velox(["--print-config"], {"VELOX_UPSTREAM_API_KEY": "sk-live-very-secret-key",
                                      "VELOX_API_KEYS": "client-key-number-one"})
    assert out.returncode == 0, out.stderr
    assert "VELOX_PORT=8080" in out.stdout
    assert "VELOX_UPSTREAM_API_KEY=sk-…(23 chars)" in out.stdout
    assert "sk-live-very-secret-key" not in out.stdout
    assert "client-key-number-one" not in out.stdout


def test_invalid_setting_stops_startup_with_a_clear_message() -> None:
    out = _velox([], {"VELOX_RING_DEPTH": "100"})
    assert out.returncode == 2
    assert "VELOX_RING_DEPTH='100' is invalid: expected a power of two" in out.stderr


def test_readme_configuration_table_is_generated_from_the_settings() -> None:
    from velox.config.reference import README_VARIABLES

    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- config:start -->\n", 1)[1].split("<!-- config:end -->", 1)[0]
    assert section == config.markdown_table(README_VARIABLES), (
        "regenerate the README table: python -m velox_lab.docs_examples")
    assert section.count("| `VELOX_") == len(README_VARIABLES)  # each name is a real setting


# --- an open relay: beyond loopback, no client key, an upstream key --------------------------

UPSTREAM = {"VELOX_UPSTREAM_API_KEY": "sk-operator-0123456789abcdef"}
KEY_TABLE = """
[[upstream]]
name = "a"
origin = "https://a.example"
api_key_env = "KEY_A"

[[key]]
name = "team"
sha256 = "{digest}"
"""


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_an_open_relay_is_refused_unless_allowed_by_name(host: str) -> None:
    with pytest.raises(ConfigError) as err:
        load({"VELOX_HOST": host, **UPSTREAM}, dotenv=None)
    message = str(err.value)
    assert message.startswith(f"VELOX_HOST={host} is not a loopback address")
    assert "VELOX_UPSTREAM_API_KEY" in message and "VELOX_ALLOW_OPEN=1" in message
    assert "VELOX_API_KEYS" in message and "VELOX_HOST=127.0.0.1" in message
    assert UPSTREAM["VELOX_UPSTREAM_API_KEY"] not in message
    allowed = load({"VELOX_HOST": host, "VELOX_ALLOW_OPEN": "1", **UPSTREAM}, dotenv=None)
    assert allowed.allow_open and config.relayed_keys(allowed)


def test_client_keys_loopback_or_no_upstream_key_are_not_a_relay(tmp_path: Path) -> None:
    public = {"VELOX_HOST": "0.0.0.0", **UPSTREAM}
    assert config.unprotected(load({**public, "VELOX_API_KEYS": "k1"}, dotenv=None)) is None
    assert config.unprotected(load({**UPSTREAM, "VELOX_HOST": "127.0.0.2"}, dotenv=None)) is None
    passthrough = load({"VELOX_HOST": "0.0.0.0"}, dotenv=None)  # clients bring their own key
    assert config.unprotected(passthrough) and config.relayed_keys(passthrough) is None
    table = tmp_path / "velox.toml"
    table.write_text(KEY_TABLE.format(digest="ab" * 32))
    env = {"VELOX_HOST": "0.0.0.0", "VELOX_CONFIG": str(table), "KEY_A": "sk-a-0123456789"}
    assert config.unprotected(load(env, dotenv=None)) is None  # [[key]] tables protect it
    table.write_text(KEY_TABLE.split("[[key]]")[0])
    with pytest.raises(ConfigError, match=f"the key of upstream\\(s\\) a of {table}"):
        load(env, dotenv=None)


@pytest.mark.parametrize(("value", "secret"), [
    ("sk-proj-abc", True), ("sk-ant-api03-x", True), ("AIzaSyA0123456789", True),
    ("0123456789abcdef0123456789abcdef", True), ("0123456789ABCDEF0123456789ABCDEF", True),
    ("gsk_abcdefghij", True), ("OPENAI_API_KEY", False), ("KEY_A", False),
    ("AZURE_OPENAI_KEY_2024_10_21", False), ("my_openai_key", False)])
def test_what_looks_like_a_key_instead_of_a_variable_name(value: str, secret: bool) -> None:
    from velox.config.tables import looks_like_a_key

    assert looks_like_a_key(value) is secret


def test_misspelt_variables_get_a_did_you_mean_and_never_their_value() -> None:
    settings = load({"VELOX_PROT": "8080", "VELOX_API_KEY": "sk-secret-0123", "VELOX_PORT": "1",
                     "VELOX_ZZZ": "1", "OTHER": "x"}, dotenv=None)
    assert settings.warnings == (
        "VELOX_API_KEY is not a Velox setting and is ignored; did you mean VELOX_API_KEYS?",
        "VELOX_PROT is not a Velox setting and is ignored; did you mean VELOX_PORT?",
        "VELOX_ZZZ is not a Velox setting and is ignored; see .env.example for the settings")
    assert load({f.env: f.default for f in FIELDS if f.default}, dotenv=None).warnings == ()


def test_a_removed_setting_starts_with_a_warning_saying_what_became_of_it() -> None:
    # What an .env copied from an earlier .env.example holds: each removed variable and each
    # removed VELOX_EGRESS value is named in a start-up warning, and the gateway runs with
    # the defaults in their place.
    old = {"VELOX_QUEUE": "asyncio", "VELOX_ARENA": "0", "VELOX_INGRESS_PARSER": "httptools",
           "VELOX_EGRESS": "jh2"}
    settings = load(old, dotenv=None)
    assert settings.egress == "auto" and settings.native
    assert settings.warnings == (
        "VELOX_ARENA was removed in this version and is ignored: request bodies always go "
        "through the arena (VELOX_ARENA_BYTES=0 keeps each body in its own buffer)",
        "VELOX_INGRESS_PARSER was removed in this version and is ignored: VELOX_NATIVE=0 "
        "selects httptools alone for request heads",
        "VELOX_QUEUE was removed in this version and is ignored: the native ring is the only "
        "ingress queue",
        "VELOX_EGRESS=jh2 was removed in this version and is read as auto: the h2 and jh2 "
        "codecs were comparison baselines and are gone")
    for value in ("native", "framer", "h2", "httpx"):
        warnings = load({"VELOX_EGRESS": value}, dotenv=None).warnings
        assert len(warnings) == 1 and warnings[0].startswith(f"VELOX_EGRESS={value} was removed")


def test_python_twins_need_an_hpack_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not load({"VELOX_NATIVE": "0"}, dotenv=None).native  # jh2 and hpack: the dev extra
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="VELOX_NATIVE=0 runs the Python HTTP/2 framer"):
        load({"VELOX_NATIVE": "0"}, dotenv=None)
    assert load({}, dotenv=None).native  # the native codec needs neither
