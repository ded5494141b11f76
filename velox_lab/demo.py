"""`velox demo` (and `make demo`): the bundled mock upstream, Velox in front of it, one real call.

Starts the mock OpenAI upstream over HTTP/2 + TLS with a fresh CA, starts the gateway on
127.0.0.1:8080 (or VELOX_PORT) trusting that CA, makes one ordinary and one streaming call with
the OpenAI SDK to show the path works, prints what to give your own client and where its admin
server is (a free port of its own), and stays in the foreground until Ctrl-C, when it stops
everything it started. A taken port (another gateway would answer in its place) is said, and
the demo exits 1.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import threading

from velox.config.settings import load
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

# The mock upstream mints its TLS certificates with trustme (in its own process): without it
# the demo could not start, so importing this module says so (velox demo reports it).
importlib.import_module("trustme")

DEMO_CLIENT_KEY = "sk-velox-demo"
DEMO_UPSTREAM_KEY = "sk-mock-upstream-key"


def _try_the_sdk(base_url: str) -> None:
    try:
        from openai import OpenAI
    except ImportError:
        print("(install the openai package to see a sample call here)")
        return
    client = OpenAI(base_url=base_url, api_key=DEMO_CLIENT_KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hello"}])
    print(f"  chat.completions  → {reply.choices[0].message.content!r}")
    stream = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Count"}], stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream
              if chunk.choices and chunk.choices[0].delta.content]
    print(f"  streamed {len(pieces)} chunks → {''.join(pieces)!r}")


def main() -> int:
    port = load().port  # VELOX_PORT, from the environment or .env like every other setting
    certdir = tempfile.mkdtemp(prefix="velox-demo-")
    mock = MockUpstream(tls=True, certdir=certdir, chunks=8, chunk_delay_ms=30).start()
    gateway = GatewayProcess(
        {
            "VELOX_UPSTREAM_ORIGIN": mock.origin,
            "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
            "VELOX_UPSTREAM_API_KEY": DEMO_UPSTREAM_KEY,
            "VELOX_API_KEYS": DEMO_CLIENT_KEY,
        },
        port=port,
        log_path=os.path.join(certdir, "velox.log"),
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        try:
            gateway.start()
        except RuntimeError as exc:  # the port is taken, or the gateway did not start
            print(f"velox demo: the gateway did not start: {exc}", file=sys.stderr)
            return 1
        base_url = gateway.base_url + "/v1"
        print(f"Velox is listening on {gateway.base_url} (pid {gateway.pid}), forwarding over "
              f"HTTP/2 + TLS to the mock upstream at {mock.origin} (pid {mock.pid}).")
        print(f"Its admin server (/stats, /metrics, /debug/pprof/) is on {gateway.admin_url}.")
        _try_the_sdk(base_url)
        print()
        print("Point any OpenAI client at it:")
        print(f'    OpenAI(base_url="{base_url}", api_key="{DEMO_CLIENT_KEY}")')
        print(f"    curl {base_url}/chat/completions -H 'Authorization: Bearer "
              f"{DEMO_CLIENT_KEY}' -H 'Content-Type: application/json' "
              "-d '{\"model\": \"gpt-4o-mini\", \"messages\": [{\"role\": \"user\", "
              "\"content\": \"hi\"}]}'")
        print(f"Gateway log: {gateway.log_path}. Press Ctrl-C to stop.")
        sys.stdout.flush()
        while not stop.wait(0.5):
            if gateway.proc is not None and gateway.proc.poll() is not None:
                print(f"velox exited unexpectedly:\n{gateway.log()}", file=sys.stderr)
                return 1
    finally:
        print("\nstopping…")
        gateway.stop()
        mock.stop()
    return 0
