"""Command line: `velox` (serve), `velox demo`, `velox --print-config`, `velox key hash|new`,
`velox prices`, `velox spend` (velox.spend.commands) and `velox bench report`.

`velox key hash` reads a gateway key on stdin and prints its SHA-256 (the `sha256` of a
`[[key]]` table); `velox key new` prints a fresh random key and its hash. Neither reads the
configuration.

`velox bench report` runs the developer tool benches/report.py, which is not part of the
package: it works from the repository root of a source checkout and says so elsewhere.

Imports: config, tables, spend.commands, supervisor (lazily, so --print-config works without
the native extension), admin.doctor (lazily, for `velox doctor`), demo (lazily), benches.report
(lazily, from a checkout).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import secrets
import sys

from velox import __version__
from velox.config import ConfigError, load
from velox.spend import commands as spend_commands
from velox.tables import describe


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
    key = sub.add_parser("key", help="gateway keys: `velox key hash` (a key on stdin → its "
                         "sha256 for a [[key]] table), `velox key new` (a fresh key and its hash)")
    key.add_argument("action", choices=["hash", "new"])
    spend_commands.add_parsers(sub)
    bench = sub.add_parser("bench", help="benchmark tools: `velox bench report [--help]`")
    bench.add_argument("action", choices=["report"])
    bench.add_argument("options", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from velox.demo import main as demo

        return demo()
    if args.command == "doctor":
        from velox.admin.doctor import main as doctor

        return doctor()
    if args.command == "key":
        return _key(args.action)
    if args.command == "bench":
        try:
            from benches.report import main as report
        except ImportError as exc:
            print(f"velox bench report: the report generator is benches/report.py in the source "
                  f"checkout, not part of the installed package ({exc}); run it from the "
                  f"repository root: python -m benches.report (or make bench-report)",
                  file=sys.stderr)
            return 2
        return report(args.options)
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
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = int(value)
            print(f"{name}={value}")
        print()
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


# 32 random bytes: 256 bits, as many as the hash keeps; the prefix makes a key recognisable
# in a secret scanner or a leaked log.
_KEY_PREFIX = "vx-"


def _key(action: str) -> int:
    if action == "new":
        key = _KEY_PREFIX + secrets.token_urlsafe(32)
        print(key)
        print(f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"')
        return 0
    text = sys.stdin.buffer.read()
    # The same stripping as the gateway applies to what a client presents (route.caller_of).
    key_bytes = text.strip()
    if not key_bytes:
        print("velox key hash: no key on stdin (try: printf %s \"$KEY\" | velox key hash)",
              file=sys.stderr)
        return 2
    if len(key_bytes.split()) != 1:
        print("velox key hash: the input holds more than one word or line; pass one key",
              file=sys.stderr)
        return 2
    print(hashlib.sha256(key_bytes).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
