"""Examples in the docs that cannot go stale: `python -m velox_lab.docs_examples`.

Starts the mock upstream (HTTP/2 + TLS) and a real gateway in front of it with a small tables
file (one upstream, two routes, one `[[key]]`), makes the requests the docs show (the OpenAI
SDK, a refused key, /stats, /metrics, an access-log line, `velox doctor`,
`velox --print-config`) and writes what came back into README.md and docs/ between markers:

    <!-- example:NAME:start -->
    ...
    <!-- example:NAME:end -->

Run-dependent text (free ports, temporary paths) is replaced by the documented defaults, so the
docs show `127.0.0.1:8080` and no path of the machine that made them. `capture()` is also what
tests/e2e/test_docs_examples.py runs: it compares the shape of each block in the docs (JSON
keys, line layouts with the digits masked) with a fresh run, so a renamed field, a new doctor
check or a changed output format fails `make test` until this script is run again.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs")
CLIENT_KEY = "vx-docs-example-key"
UPSTREAM_KEY = "sk-mock-upstream-key"
MARKER = re.compile(r"(<!-- example:([a-z0-9-]+):start -->\n)(.*?)(<!-- example:\2:end -->)",
                    re.S)

TABLES = """\
[[upstream]]
name = "openai"
origin = "{origin}"
api_key_env = "OPENAI_API_KEY"
ca_file = "{ca_file}"
max_in_flight = 500

[[route]]
model = "gpt-4o-mini"
targets = [{{ upstream = "openai" }}]

[[route]]
model = "*"
targets = [{{ upstream = "openai" }}]

[[key]]
name = "support-bot"
sha256 = "{sha256}"
rpm = 600
tpm = 60000
"""


@contextmanager
def gateway(workdir: Path) -> Iterator[tuple[GatewayProcess, MockUpstream]]:
    """The mock and a one-worker gateway reading a tables file, both stopped on exit."""
    import hashlib

    mock = MockUpstream(tls=True, certdir=str(workdir), chunks=4).start()
    try:
        tables = workdir / "velox.toml"
        tables.write_text(TABLES.format(
            origin=mock.origin, ca_file=mock.ca_file,
            sha256=hashlib.sha256(CLIENT_KEY.encode()).hexdigest()))
        gw = GatewayProcess({"VELOX_CONFIG": str(tables), "VELOX_WORKERS": "1",
                             "OPENAI_API_KEY": UPSTREAM_KEY},
                            log_path=workdir / "velox.log")
        with gw:
            yield gw, mock
    finally:
        mock.stop()


def _sdk_examples(gw: GatewayProcess) -> dict[str, str]:
    from openai import AuthenticationError, OpenAI

    with OpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Hello"}])
        reply = raw.parse()
        headers = {h: raw.headers.get(h) for h in ("x-velox-upstream", "x-velox-attempts",
                                                   "x-ratelimit-limit-requests",
                                                   "x-ratelimit-remaining-requests")}
        chat = "\n".join([
            f"reply.choices[0].message.content == {reply.choices[0].message.content!r}",
            f"reply.usage.prompt_tokens, reply.usage.completion_tokens == "
            f"{reply.usage.prompt_tokens}, {reply.usage.completion_tokens}" if reply.usage
            else "reply.usage is None",
            *(f"{name}: {value}" for name, value in headers.items()),
        ])
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Count"}], stream=True)
        pieces = [c.choices[0].delta.content for c in stream
                  if c.choices and c.choices[0].delta.content]
        streamed = f"{len(pieces)} chunks: {''.join(pieces)!r}"
    with OpenAI(base_url=gw.base_url + "/v1", api_key="not-a-key", max_retries=0) as bad:
        try:
            bad.models.list()
            refused = "(no error)"
        except AuthenticationError as exc:
            refused = f"openai.AuthenticationError: {exc}"
    return {"sdk-chat": chat, "sdk-stream": streamed, "sdk-refused": refused}


def _admin_json(gw: GatewayProcess, path: str) -> Any:
    status, body = gw.admin_get(path)
    if status != 200:
        raise RuntimeError(f"{path} answered {status}: {body[:200]!r}")
    return json.loads(body) if path != "/metrics" else body.decode()


def compact_json(value: Any, indent: str = "") -> str:
    """JSON indented by level, with an object or list of plain values kept on one line (a
    latency summary or a counter group reads as one row)."""
    flat = json.dumps(value)
    inner = indent + "  "
    members = value.values() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list)) or (
            len(flat) + len(indent) <= 110 and not any(isinstance(v, (dict, list))
                                                       for v in members)):
        return flat
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    items = [inner + compact_json(v, inner) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + indent + "]"


def _metrics_table(text: str) -> str:
    """Every metric family the gateway exports, from /metrics' HELP and TYPE lines."""
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    rows = ["| Metric | Type | What it counts |", "|---|---|---|"]
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        rows.append(f"| `{name}` | {kind} | {helps.get(name, '').replace('|', '/')} |")
    return "\n".join(rows)


def _cli(gw: GatewayProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "velox", *args], env=gw.env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    return (out.stdout + out.stderr).rstrip("\n")


def _access_line(gw: GatewayProcess) -> str:
    """The chat request's line from the gateway's stdout (the log thread flushes it soon)."""
    for line in gw.log().splitlines():
        if line.startswith("{") and '"path":"/v1/chat/completions"' in line:
            return compact_json(json.loads(line))
    raise RuntimeError("no access-log line for the chat request yet")


def capture(workdir: Path, wait: Callable[[Callable[[], Any]], Any]) -> dict[str, str]:
    """Every example's text, keyed by marker name. `wait(fn)` retries fn until it returns
    without raising (the access log is written by a thread of the worker, a moment later)."""
    with gateway(workdir) as (gw, mock):
        out = _sdk_examples(gw)
        out["access-log"] = wait(lambda: _access_line(gw))
        out["stats"] = compact_json(wait(lambda: _steady_stats(gw)))
        out["metrics"] = _metrics_table(_admin_json(gw, "/metrics"))
        out["doctor"] = "$ velox doctor\n" + _cli(gw, "doctor")
        out["print-config"] = "$ velox --print-config\n" + _cli(gw, "--print-config")
        return {name: scrub(text, gw, mock, workdir) for name, text in out.items()}


def scrub(text: str, gw: GatewayProcess, mock: MockUpstream, workdir: Path) -> str:
    """Run-dependent text as the docs show it: the default ports, no machine paths."""
    admin = (gw.admin_url or "").removeprefix("http://")
    for actual, shown in ((str(workdir), "/etc/velox"), (admin, "127.0.0.1:6060"),
                          (f"127.0.0.1:{gw.port}", "127.0.0.1:8080"),
                          (f"port {gw.port}", "port 8080"),
                          (f"VELOX_PORT={gw.port}", "VELOX_PORT=8080"),
                          (f"127.0.0.1:{mock.port}", "127.0.0.1:9443")):
        if actual:
            text = text.replace(actual, shown)
    return re.sub(r"/tmp/velox-state-\w+", "/var/lib/velox", text)


def fence(name: str, text: str) -> str:
    if name == "metrics":
        return text + "\n"
    lang = "json" if text.startswith("{") else "text"
    return f"```{lang}\n{text}\n```\n"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return files


def blocks(text: str) -> dict[str, str]:
    """The examples in one doc, by name: the fenced text between their markers."""
    found = {}
    for m in MARKER.finditer(text):
        body = m.group(3)
        if body.startswith("```"):
            body = body.split("\n", 1)[1].rsplit("```", 1)[0]
        found[m.group(2)] = body.rstrip("\n")
    return found


def write(examples: dict[str, str]) -> list[str]:
    """Replace every marked block in the docs; returns 'file: name' for each one written."""
    written = []
    for path in doc_files():
        text = path.read_text()

        def fill(m: re.Match[str], path: Path = path) -> str:
            name = m.group(2)
            if name not in examples:
                raise SystemExit(f"{path}: no example named {name!r}")
            written.append(f"{path.relative_to(ROOT)}: {name}")
            return m.group(1) + fence(name, examples[name]) + m.group(4)

        new = MARKER.sub(fill, text)
        if new != text:
            path.write_text(new)
    return written


def static_blocks() -> None:
    """The README's blocks that need no gateway: the short variable table (from the settings
    table) and the tables example (velox.example.toml, copied)."""
    from velox.config.reference import README_VARIABLES
    from velox.config.settings import markdown_table

    readme = ROOT / "README.md"
    text = readme.read_text()
    for name, body in (("config", markdown_table(README_VARIABLES)),
                       ("tables-example",
                        "```toml\n" + (ROOT / "velox.example.toml").read_text() + "```\n")):
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        text = head + start + body + end + rest.split(end, 1)[1]
    readme.write_text(text)


def _retry(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _steady_stats(gw: GatewayProcess) -> Any:
    """/stats once every worker has beaten its first heartbeat (before that, its
    `heartbeat_age_ms` is null: a fresh gateway's answer, not the documented one)."""
    stats = _admin_json(gw, "/stats")
    if any(w.get("heartbeat_age_ms") is None for w in stats["workers"]):
        raise RuntimeError("a worker has not beaten its first heartbeat yet")
    return stats


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m velox_lab.docs_examples",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    static_blocks()
    with tempfile.TemporaryDirectory(prefix="velox-docs-") as tmp:
        examples = capture(Path(tmp), _retry)
    for line in write(examples):
        print(f"wrote {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
