"""LiteLLM's proxy as a comparison target: its own virtual environment, config and process.

LiteLLM is installed from PyPI into `.bench/litellm-venv` (gitignored), never into the project's
venv, from `litellm-requirements.txt`: every package pinned to an exact version with the sha256
of its file, installed with `--require-hashes --no-deps`, so nothing unpinned or altered can
slip in. Releases known to have been compromised (1.82.7, 1.82.8, every 1.107.x) are refused,
and the install is checked for start-up hooks (`.pth` files) that a clean LiteLLM does not ship.

The proxy runs with one worker, no database, a master key (the benchmark's client key, which
LiteLLM requires to start) and a scrubbed environment (no
inherited credentials, HOME in a scratch directory), pointed at the mock upstream as an
OpenAI-compatible provider.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benches.e2e import workload
from benches.e2e.machine import ROOT

VENV = ROOT / ".bench" / "litellm-venv"
LOCK = Path(__file__).with_name("litellm-requirements.txt")
VERSION = "1.106.2"
_COMPROMISED = re.compile(r"^1\.(82\.[78]|107\.\d+)$")
_ALLOWED_PTH = {"distutils-precedence.pth"}


def _check_version(version: str) -> None:
    if _COMPROMISED.match(version):
        raise SystemExit(f"refusing LiteLLM {version}: a release known to be compromised")


def pinned_version() -> str:
    for line in LOCK.read_text().splitlines():
        if line.lower().startswith("litellm=="):
            return line.split("==", 1)[1].split()[0]
    raise SystemExit(f"{LOCK} does not pin litellm")


def installed() -> bool:
    return (VENV / "bin" / "litellm").exists() and (VENV / ".installed").exists()


def install() -> None:
    """Build .bench/litellm-venv from the hashed lock (idempotent)."""
    version = pinned_version()
    _check_version(version)
    if installed() and (VENV / ".installed").read_text().strip() == LOCK.read_text().strip():
        return
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--require-hashes", "-r", str(LOCK)],
                   check=True)
    site = next((VENV / "lib").glob("python3*/site-packages"))
    hooks = sorted(p.name for p in site.glob("*.pth") if p.name not in _ALLOWED_PTH)
    if hooks:
        raise SystemExit(f"unexpected start-up hooks in the LiteLLM venv: {hooks}; not using it")
    (VENV / ".installed").write_text(LOCK.read_text())


def lock(version: str = VERSION) -> None:
    """Rewrite the lock: resolve `litellm[proxy]==version` with pip and record each file's hash."""
    _check_version(version)
    report = ROOT / ".bench" / "litellm-report.json"
    report.parent.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                    "--ignore-installed", "--report", str(report), f"litellm[proxy]=={version}"],
                   check=True)
    items = json.loads(report.read_text())["install"]
    lines = [
        f"# LiteLLM proxy {version} and every dependency, exact versions and the sha256 of the",
        "# files pip picked (CPython 3.11, x86_64 Linux). Installed with --no-deps "
        "--require-hashes.",
        "# Regenerate: `python -m benches.e2e lock-litellm` (never 1.82.7, 1.82.8 or any 1.107.x).",
        "",
    ]
    for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{item['metadata']['name']}=={item['metadata']['version']} \\\n"
                     f"    --hash=sha256:{sha}")
    LOCK.write_text("\n".join(lines) + "\n")


def config_yaml(api_base: str, slow_chunks: int, slow_delay_ms: int) -> str:
    """Proxy config: the benchmark's model names routed to the mock (JSON is valid YAML)."""
    params = {"model": f"openai/{workload.MODEL}", "api_base": api_base,
              "api_key": workload.API_KEY}
    slow = {**params, "extra_headers": workload.slow_stream_headers(slow_chunks, slow_delay_ms)}
    doc = {
        "model_list": [
            {"model_name": workload.MODEL, "litellm_params": params},
            {"model_name": workload.STREAM_SLOW_MODEL, "litellm_params": slow},
        ],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        # LiteLLM refuses to start without a master key; the clients send this one.
        "general_settings": {"disable_spend_logs": True, "master_key": workload.API_KEY},
    }
    return json.dumps(doc, indent=2)


def command(config: Path, port: int) -> list[str]:
    return [str(VENV / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1"]


def environment(home: Path) -> dict[str, str]:
    """A scrubbed environment: nothing inherited that could carry a credential."""
    return {
        "PATH": f"{VENV / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the cost map at start-up
        "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR", "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(home),
    }
