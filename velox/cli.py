"""Command line: `velox` (serve), `velox demo`, `velox --print-config`, `velox key ...`,
`velox prices`, `velox spend` (velox.spend.commands).

`velox key hash [KEY]` prints the SHA-256 of a gateway key (the `sha256` of a `[[key]]`
table), read from its argument or, without one, from stdin (an argument lands in the shell's
history: stdin is the safer way); `velox key new` prints a fresh random key and its hash.
Neither reads the configuration. `velox key create|list|revoke|rotate` manage run-time keys
through the admin API of a running gateway (`velox.admin.keyapi`), at VELOX_ADMIN_ADDR with
VELOX_ADMIN_TOKEN, read from the environment and `.env` like the gateway's own settings.

`velox demo` runs the lab (velox_lab: the mock upstream and the launcher), which is not part
of the gateway and comes with the development install; without it the command says how to
get it. The supervisor and the doctor are imported when their command runs, so
`--print-config` works without the native extension.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from velox import __version__
from velox.config.settings import ConfigError, load
from velox.config.tables import describe
from velox.spend import commands as spend_commands

LAB_MISSING = ("velox demo runs the lab (the mock upstream and the gateway launcher), which "
               "comes with the development install: from a checkout of the repository, "
               "pip install -e '.[dev]'")


def _demo() -> int:
    try:
        from velox_lab.demo import main as demo
    except ImportError as exc:
        print(f"{LAB_MISSING} (missing: {exc.name or exc})", file=sys.stderr)
        return 2
    return demo()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="velox",
        description="Low-latency OpenAI-compatible LLM API gateway. "
        "Configured with VELOX_* environment variables (see .env.example).",
    )
    parser.add_argument("--version", action="version", version=f"velox {__version__}")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective settings and tables (secrets masked) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="run the gateway (the default)")
    sub.add_parser("demo", help="run the mock upstream and the gateway in front of it")
    sub.add_parser("doctor", help="check the configuration, the ports and the path to every "
                   "upstream (DNS, TLS, h2, key); exit 1 if a check fails")
    _key_parser(sub)
    spend_commands.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo()
    if args.command == "doctor":
        from velox.admin.doctor import main as doctor

        return doctor()
    if args.command == "key":
        return _key(args)
    try:
        settings = load()
    except ConfigError as exc:
        print(f"velox: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command in ("prices", "spend"):
        run = spend_commands.prices_main if args.command == "prices" else spend_commands.spend_main
        return run(args, settings)
    if args.print_config:
        for warning in settings.warnings:
            print(f"velox: warning: {warning}", file=sys.stderr)
        for name, value in settings.redacted().items():
            shown: object = value
            if isinstance(value, tuple):
                shown = ",".join(value)
            elif isinstance(value, bool):
                shown = int(value)
            print(f"{name}={shown}")
        print()
        assert settings.tables is not None  # Settings.__post_init__ synthesises them
        print(describe(settings.tables), end="")  # upstreams and routes, keys masked
        return 0
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s velox[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for warning in settings.warnings:  # a misspelt VELOX_* variable, with a did-you-mean
        logging.getLogger("velox.config").warning("%s", warning)
    from velox.supervisor import serve

    return serve(settings)


def _key_parser(sub: Any) -> None:
    key = sub.add_parser("key", help="gateway keys: hash, new (offline); create, list, revoke, "
                         "rotate (run-time keys, through the running gateway's admin API)")
    actions = key.add_subparsers(dest="action", metavar="ACTION", required=True)
    hash_ = actions.add_parser("hash", help="print a key's sha256 (for a [[key]] table); the "
                               "key from the argument, else from stdin")
    hash_.add_argument("key", nargs="?", help="the key (omit it to read stdin)")
    actions.add_parser("new", help="print a fresh random key and its sha256")
    create = actions.add_parser("create", help="make a run-time key; prints its secret once")
    create.add_argument("name")
    for flag, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute"),
                       ("--max-parallel", "requests in flight at once")):
        create.add_argument(flag, type=int, help=f"{what} (0 or absent: no limit)")
    create.add_argument("--models", help="comma-separated route models it may use (absent: all)")
    create.add_argument("--expires-at", help="ISO 8601 time with a zone, e.g. 2027-01-31T00:00:00Z")
    create.add_argument("--budget-usd", type=float, help="reserved for the governance tables")
    create.add_argument("--team", help="reserved for the governance tables")
    actions.add_parser("list", help="list the keys (the file's and the run-time ones)")
    revoke = actions.add_parser("revoke", help="revoke a run-time key")
    revoke.add_argument("name")
    rotate = actions.add_parser("rotate", help="a new secret for a run-time key (printed once)")
    rotate.add_argument("name")
    rotate.add_argument("--overlap-s", type=float, default=60,
                        help="seconds the old secret keeps working (default 60)")
    for p in (create, revoke, rotate, actions.choices["list"]):
        p.add_argument("--json", action="store_true", help="print the API's JSON answer")


def _key(args: argparse.Namespace) -> int:
    from velox.admin.keystore import new_secret, sha256_hex

    if args.action == "new":
        key = new_secret()
        print(key)
        print(f'sha256 = "{sha256_hex(key)}"')
        return 0
    if args.action == "hash":
        return _hash(args.key)
    return _key_api(args)


def _hash(argument: str | None) -> int:
    from velox.admin.keystore import sha256_hex

    text = argument.encode() if argument is not None else sys.stdin.buffer.read()
    # The same stripping as the gateway applies to what a client presents (auth.caller_of).
    key_bytes = text.strip()
    if not key_bytes:
        where = "the argument is empty" if argument is not None else "no key on stdin"
        print(f"velox key hash: {where} (try: velox key hash \"$KEY\", or printf %s \"$KEY\" "
              "| velox key hash)", file=sys.stderr)
        return 2
    if len(key_bytes.split()) != 1:
        print("velox key hash: the input holds more than one word or line; pass one key",
              file=sys.stderr)
        return 2
    print(sha256_hex(key_bytes))
    return 0


def _key_api(args: argparse.Namespace) -> int:
    """create, list, revoke, rotate: one request to the admin API."""
    from urllib.parse import quote

    action, name = args.action, quote(getattr(args, "name", "") or "", safe="")
    if action == "create":
        body: dict[str, Any] = {"name": args.name}
        for field in ("rpm", "tpm", "max_parallel", "expires_at", "budget_usd", "team"):
            value = getattr(args, field)
            if value is not None:
                body[field] = value
        if args.models is not None:
            body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
        request: tuple[str, str, dict[str, Any] | None] = ("POST", "/keys", body)
    elif action == "list":
        request = ("GET", "/keys", None)
    elif action == "revoke":
        request = ("DELETE", f"/keys/{name}", None)
    else:
        request = ("POST", f"/keys/{name}/rotate", {"overlap_s": args.overlap_s})
    try:
        status, doc = _admin_call(*request)
    except (ConfigError, OSError) as exc:
        print(f"velox key {action}: {exc}", file=sys.stderr)
        return 2
    if status >= 400:
        message = doc.get("error", {}).get("message", doc) if isinstance(doc, dict) else doc
        print(f"velox key {action}: {status}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2) if doc is not None else "{}")
    elif action == "list":
        _print_keys(doc["keys"])
    elif action == "revoke":
        print(f"revoked {args.name}")
    else:
        # The secret alone on stdout (for a pipe); what it is on stderr.
        print(f"{'created' if action == 'create' else 'rotated'} {args.name}; its secret, shown "
              "this once:", file=sys.stderr)
        print(doc["key"])
    return 0


def _admin_call(method: str, path: str, body: Any) -> tuple[int, Any]:
    import http.client

    settings = load()
    endpoint = settings.admin_endpoint
    if endpoint is None:
        raise ConfigError("VELOX_ADMIN_ADDR is off: the key commands talk to the admin server")
    host, port = endpoint
    if host in ("0.0.0.0", "::"):  # a wildcard bind is reached over loopback
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if settings.admin_token:
        headers["Authorization"] = f"Bearer {settings.admin_token}"
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, headers)
            response = conn.getresponse()
            raw = response.read()
        except OSError as exc:
            raise OSError(f"cannot reach the admin server at {settings.admin_addr} "
                          f"(VELOX_ADMIN_ADDR): {exc.strerror or exc}") from None
    finally:
        conn.close()
    return response.status, json.loads(raw) if raw else None


def _print_keys(keys: list[dict[str, Any]]) -> None:
    rows = [("NAME", "SOURCE", "RPM", "TPM", "PARALLEL", "MODELS", "EXPIRES")]
    rows += [(k["name"], k["source"], str(k["rpm"] or "-"), str(k["tpm"] or "-"),
              str(k["max_parallel"] or "-"), ",".join(k["models"]) if k["models"] else "all",
              k.get("expires_at") or "-") for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
