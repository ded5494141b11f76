"""Command line: `velox` (serve), `velox demo`, `velox doctor`, `velox --print-config` and
`velox key hash|new`.

`velox key hash` reads a gateway key on stdin and prints its SHA-256 (the `sha256` of a
`[[key]]` table); `velox key new` prints a fresh random key and its hash. Neither reads the
configuration.

`velox demo` runs the lab (velox_lab: the mock upstream and the launcher), which is not part
of the gateway and comes with the development install; without it the command says how to
get it. The supervisor and the doctor are imported when their command runs, so
`--print-config` works without the native extension.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import secrets
import sys

from velox import __version__
from velox.config.settings import ConfigError, load
from velox.config.tables import describe

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
    key = sub.add_parser("key", help="gateway keys: `velox key hash` (a key on stdin → its "
                         "sha256 for a [[key]] table), `velox key new` (a fresh key and its hash)")
    key.add_argument("action", choices=["hash", "new"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo()
    if args.command == "doctor":
        from velox.admin.doctor import main as doctor

        return doctor()
    if args.command == "key":
        return _key(args.action)
    try:
        settings = load()
    except ConfigError as exc:
        print(f"velox: configuration error: {exc}", file=sys.stderr)
        return 2
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
