"""`python -m velox` with a VELOX_CONFIG file: broken files stop start-up at once, naming the
mistake on stderr; keys never appear in --print-config; a valid file starts a working gateway.

The broken-file runs use subprocess directly, in a fresh session, so that if a file were wrongly
accepted the gateway it started (supervisor and workers) is stopped by its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

from .conftest import CLIENT_KEY, UPSTREAM_KEY, client_for, gateway_env

EXIT_WITHIN_S = 5.0
OPENAI_KEY = "sk-e2e-openai-SECRET-0123456789"
AZURE_KEY = "e2e-azure-SECRET-abcdef0123456789"

GOOD = """
[[upstream]]
name = "openai"
origin = "https://api.openai.com"
api_key_env = "E2E_OPENAI_KEY"

[[upstream]]
name = "azure"
kind = "azure"
origin = "https://example.openai.azure.com"
api_key_env = "E2E_AZURE_KEY"
api_version = "2024-10-21"

[[route]]
model = "gpt-4o"
targets = [{ upstream = "openai", weight = 2 }, { upstream = "azure", model = "gpt4o-prod" }]

[[route]]
model = "*"
targets = [{ upstream = "openai" }]
fallbacks = ["gpt-4o"]
"""


def run_velox(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    """Run `python -m velox ARGS`; it must exit within EXIT_WITHIN_S seconds."""
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin"), "VELOX_WORKERS": "1",
                "VELOX_PORT": str(free_port()), "VELOX_ADMIN_ADDR": "off", **env}
    proc = subprocess.Popen([sys.executable, "-m", "velox", *args], env=full_env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group our child leads: it and its workers
        proc.communicate()
        pytest.fail(f"velox {args} was still running after {EXIT_WITHIN_S} s")
    return proc.returncode, out, err


KEYS = {"E2E_OPENAI_KEY": OPENAI_KEY, "E2E_AZURE_KEY": AZURE_KEY}


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("syntax", GOOD.replace("[[route]]\nmodel = \"*\"", "[[route]\nmodel = \"*\""),
     "TOML syntax error"),
    ("unknown-key", GOOD.replace('api_version = "2024-10-21"', 'api_verison = "2024-10-21"'),
     '[[upstream]] #2 (name "azure"): api_verison: unknown key (did you mean "api_version"?)'),
    ("wrong-type", GOOD.replace("weight = 2", 'weight = "2"'),
     '[[route]] #1 (model "gpt-4o"), target #1 (upstream "openai"): weight: must be an integer'),
    ("weight-zero", GOOD.replace("weight = 2", "weight = 0"),
     "weight: must be an integer from 1 to 1000000, got 0"),
    ("dangling-target", GOOD.replace('{ upstream = "azure"', '{ upstream = "azrue"'),
     'target #2 (upstream "azrue"): upstream: "azrue" names no [[upstream]] '
     '(did you mean "azure"?)'),
    ("dangling-fallback", GOOD.replace('fallbacks = ["gpt-4o"]', 'fallbacks = ["gpt-5"]'),
     '[[route]] #2 (model "*"): fallbacks: "gpt-5" names no [[route]]'),
    ("cycle", GOOD.replace('model = "gpt-4o"\n', 'model = "gpt-4o"\nfallbacks = ["*"]\n'),
     'fallbacks: fallback cycle: "gpt-4o" -> "*" -> "gpt-4o"'),
    ("duplicate", GOOD.replace('name = "azure"', 'name = "openai"'),
     '[[upstream]] #2 (name "openai"): name: duplicate name "openai"'),
    ("origin", GOOD.replace("https://api.openai.com", "https://api.openai.com/v1"),
     '[[upstream]] #1 (name "openai"): origin: must be an origin like'),
    ("azure-version", GOOD.replace('api_version = "2024-10-21"\n', ""),
     '[[upstream]] #2 (name "azure"): api_version: required with kind = "azure"'),
])
def test_broken_file_stops_startup_with_the_mistake_on_stderr(
        tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    code, out, err = run_velox([], {"VELOX_CONFIG": str(path), **KEYS}, tmp_path)
    assert code == 2, (out, err)
    assert err.startswith(f"velox: configuration error: {path}: "), err
    assert expected in err, err
    assert OPENAI_KEY not in out + err and AZURE_KEY not in out + err


def test_unreadable_file_stops_startup(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    code, _, err = run_velox([], {"VELOX_CONFIG": str(missing), **KEYS}, tmp_path)
    assert code == 2
    assert f"{missing}: cannot read the VELOX_CONFIG file: No such file or directory" in err
    unreadable = tmp_path / "locked.toml"
    unreadable.write_text(GOOD)
    unreadable.chmod(0)
    if os.access(unreadable, os.R_OK):
        return  # running as root: permissions do not stop a read; the missing file did
    code, _, err = run_velox([], {"VELOX_CONFIG": str(unreadable), **KEYS}, tmp_path)
    assert code == 2 and "Permission denied" in err


def test_missing_key_variable_is_named(tmp_path: Path) -> None:
    path = tmp_path / "velox.toml"
    path.write_text(GOOD)
    code, _, err = run_velox([], {"VELOX_CONFIG": str(path), "E2E_OPENAI_KEY": OPENAI_KEY},
                             tmp_path)
    assert code == 2
    assert ('[[upstream]] #2 (name "azure"): api_key_env: the environment variable '
            "E2E_AZURE_KEY is not set or empty") in err
    code, _, err = run_velox([], {"VELOX_CONFIG": str(path), "E2E_OPENAI_KEY": "",
                                  "E2E_AZURE_KEY": AZURE_KEY}, tmp_path)
    assert code == 2 and "the environment variable E2E_OPENAI_KEY is not set or empty" in err


def test_print_config_shows_tables_but_never_a_key(tmp_path: Path) -> None:
    path = tmp_path / "velox.toml"
    path.write_text(GOOD)
    code, out, err = run_velox(["--print-config"], {"VELOX_CONFIG": str(path), **KEYS,
                                                    "OPENAI_API_KEY": OPENAI_KEY}, tmp_path)
    assert code == 0, err
    assert f"VELOX_CONFIG={path}" in out and f"# tables from {path}" in out
    assert 'name = "azure"' in out and 'api_version = "2024-10-21"' in out
    assert "# key: E2E_OPENAI_KEY=sk-…(31 chars)" in out
    assert "# key: E2E_AZURE_KEY=e2e…(33 chars)" in out
    assert '{ upstream = "azure", model = "gpt4o-prod", weight = 1, priority = 0 }' in out
    for secret in (OPENAI_KEY, AZURE_KEY, OPENAI_KEY[3:], AZURE_KEY[3:]):
        assert secret not in out and secret not in err


def test_valid_file_starts_a_working_gateway(tmp_path: Path, upstream: MockUpstream) -> None:
    """The file names the mock as its only upstream (its key from a variable) and routes every
    model there; the gateway becomes ready, answers through the SDK, and logs no key."""
    path = tmp_path / "velox.toml"
    path.write_text(f"""
[[upstream]]
name = "mock"
origin = "{upstream.origin}"
api_key_env = "E2E_MOCK_KEY"
{f'ca_file = "{upstream.ca_file}"' if upstream.ca_file else ""}

[[route]]
model = "*"
targets = [{{ upstream = "mock" }}]
""")
    env = gateway_env(upstream, VELOX_CONFIG=str(path), E2E_MOCK_KEY=UPSTREAM_KEY,
                      VELOX_API_KEYS=CLIENT_KEY)
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw:
        reply = client_for(gw).chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        seen = [r for r in upstream.requests(20) if r["path"] == "/v1/chat/completions"][-1]
        assert dict(seen["headers"])["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert UPSTREAM_KEY not in gw.log_path.read_text()


# --- what a newcomer trips over: a pasted key, a misspelt variable, doctor on a bad file ------

PASTED = {"openai": "sk-proj-PASTED0123456789abcdefSECRET", "azure": "0123456789abcdef" * 2}


@pytest.mark.parametrize("upstream", ["openai", "azure"])
def test_a_key_pasted_into_api_key_env_is_never_printed(tmp_path: Path, upstream: str) -> None:
    key = PASTED[upstream]
    var = "E2E_OPENAI_KEY" if upstream == "openai" else "E2E_AZURE_KEY"
    config = tmp_path / "velox.toml"
    config.write_text(GOOD.replace(f'api_key_env = "{var}"', f'api_key_env = "{key}"'))
    env = {"VELOX_CONFIG": str(config), **KEYS}
    code, out, err = run_velox([], env, tmp_path)
    index = 1 if upstream == "openai" else 2
    assert code == 2 and key not in out + err, err
    assert (f'[[upstream]] #{index} (name "{upstream}"): api_key_env: this value looks like a '
            "key") in err
    assert "NAME of an environment variable" in err and str(config) in err
    code, out, err = run_velox(["doctor"], env, tmp_path)
    assert code == 1 and key not in out + err, out
    assert f'fix api_key_env of [[upstream]] #{index} (name "{upstream}") in {config}' in out


def test_doctor_names_file_table_and_key_of_a_mistake(tmp_path: Path) -> None:
    config = tmp_path / "velox.toml"
    config.write_text(GOOD.replace('api_version = "2024-10-21"', 'api_verison = "2024-10-21"'))
    code, out, _ = run_velox(["doctor"], {"VELOX_CONFIG": str(config), **KEYS}, tmp_path)
    assert code == 1
    assert f'FAIL  config            {config}: [[upstream]] #2 (name "azure"): api_verison' in out
    assert f'→ fix api_verison of [[upstream]] #2 (name "azure") in {config}' in out
    assert "fix that variable" not in out
    config.write_text("[[upstream]\nname = ")
    code, out, _ = run_velox(["doctor"], {"VELOX_CONFIG": str(config)}, tmp_path)
    assert code == 1 and "TOML syntax error" in out
    assert f"→ fix the TOML syntax of {config} where the error says" in out
    code, out, _ = run_velox(["doctor"], {"VELOX_PORT": "http"}, tmp_path)
    assert "→ fix that variable (see .env.example)" in out  # a variable's mistake: as before


def test_a_misspelt_variable_is_warned_about_with_the_setting_meant(
        tmp_path: Path, upstream: MockUpstream) -> None:
    env = {**gateway_env(upstream), "VELOX_WORKER": "1", "VELOX_UPSTREAM_KEY": UPSTREAM_KEY,
           "VELOX_NOTHING_LIKE_IT": "1"}
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw:
        log = gw.log()
    assert "WARNING velox" in log
    assert "VELOX_WORKER is not a Velox setting and is ignored; did you mean VELOX_WORKERS?" in log
    assert ("VELOX_UPSTREAM_KEY is not a Velox setting and is ignored; did you mean "
            "VELOX_UPSTREAM_API_KEY?") in log
    assert "VELOX_NOTHING_LIKE_IT is not a Velox setting and is ignored; see .env.example" in log
    assert UPSTREAM_KEY not in log
    local = {"VELOX_WORKER": "1", "VELOX_UPSTREAM_ORIGIN": f"http://127.0.0.1:{free_port()}"}
    _code, out, _ = run_velox(["doctor"], local, tmp_path)
    assert "WARN  config            VELOX_WORKER is not a Velox setting" in out
