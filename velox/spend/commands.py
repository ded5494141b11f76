"""`velox prices` and `velox spend`: the price table in effect, and spend over a period.

`velox prices [--model M] [--upstream U] [--json]`: every entry of the effective table (the
shipped one with VELOX_CONFIG's [[price]] entries over it), most specific first, or with
`--model` the entry that prices M (and the cost of a million input and output tokens).

`velox spend [--since 7d] [--until T] [--by key|team|model|upstream|route|api|day] [--json]
[--all-hosts]`: totals from this host's ledger (VELOX_STATE_DIR), or with `--all-hosts` from
the Redis Stream every host writes (VELOX_REDIS_URL). JSON is the list the admin server's
/spend answers: objects with the grouping field, requests, input_tokens, output_tokens,
cost_usd (null: unknown) and unpriced_requests.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from velox.spend.prices import COLUMNS, PriceTable, describe
from velox.spend.report import (
    GROUPS,
    BadQuery,
    NoLedger,
    check_group,
    format_totals,
    from_stream,
    local_totals,
    parse_time,
    totals,
)
from velox.spend.text import aligned

if TYPE_CHECKING:
    from velox.config.settings import Settings


def add_parsers(sub: Any) -> None:
    """The two subcommands on cli.py's parser."""
    prices = sub.add_parser("prices", help="print the price table in effect (shipped prices "
                            "with the [[price]] entries of VELOX_CONFIG over them)")
    prices.add_argument("--model", help="show the entry that prices this upstream model")
    prices.add_argument("--upstream", default="", help="the [[upstream]] it is sent to")
    prices.add_argument("--json", action="store_true", help="JSON instead of a table")
    spend = sub.add_parser("spend", help="spend and tokens over a period from the usage "
                           "ledger, by key, team, model, upstream, route, api or day")
    spend.add_argument("--since", default="7d", help="7d, 24h, 30m, 2w or a UTC date "
                       "(default 7d)")
    spend.add_argument("--until", default=None, help="end of the period (default: now)")
    spend.add_argument("--by", default="key", choices=GROUPS, help="grouping (default key)")
    spend.add_argument("--json", action="store_true", help="JSON (as the admin /spend)")
    spend.add_argument("--all-hosts", action="store_true", help="read the Redis Stream of "
                       "every host (VELOX_REDIS_URL) instead of this host's ledger")


def prices_main(args: argparse.Namespace, settings: Settings) -> int:
    assert settings.tables is not None
    table = PriceTable(settings.tables.prices)
    if args.model is not None:
        return _one_price(table, args.model, args.upstream, args.json)
    rows = describe(table)
    if args.json:
        print(orjson.dumps({"taken": table.defaults.taken, "prices": rows}).decode())
        return 0
    print(f"# shipped prices taken {table.defaults.taken} ({table.defaults.source}); "
          f"USD per million tokens, image and request in USD; '-' is priced as input "
          f"(cached_input, cache_write) or output (reasoning)")
    print(aligned(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]), end="")
    return 0


def _one_price(table: PriceTable, model: str, upstream: str, as_json: bool) -> int:
    spec = table.price_for(upstream, model)
    if spec is None:
        print(f"velox prices: no entry prices {model!r}"
              + (f" on {upstream!r}" if upstream else "")
              + ": its requests are counted with cost unknown; add a [[price]] table",
              file=sys.stderr)
        return 1
    row = next(r for r, s in zip(describe(table), table.entries, strict=True) if s is spec)
    if as_json:
        print(orjson.dumps(row).decode())
    else:
        print(aligned(COLUMNS, [[row[c] for c in COLUMNS]]), end="")
    return 0


def spend_main(args: argparse.Namespace, settings: Settings) -> int:
    now_ms = int(time.time() * 1000)
    try:
        if args.all_hosts:
            rows = _all_hosts(args, settings, now_ms)
        else:
            rows = local_totals(settings.state_dir, args.since, args.until, args.by, now_ms)
    except (BadQuery, NoLedger) as exc:
        print(f"velox spend: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(rows).decode())
        return 0
    where = "every host (Redis Stream)" if args.all_hosts else settings.state_dir
    until = f" until {args.until}" if args.until else ""
    print(format_totals(rows, args.by, f"# spend since {args.since}{until} by {args.by}, "
                                       f"from {where}; cost '-': unknown (no price)"), end="")
    return 0


def _all_hosts(args: argparse.Namespace, settings: Settings,
               now_ms: int) -> list[dict[str, Any]]:
    if not settings.redis_url:
        raise BadQuery("--all-hosts reads the Redis Stream: set VELOX_REDIS_URL")
    since_ms = parse_time(args.since, now_ms)
    until_ms = now_ms + 1 if args.until is None else parse_time(args.until, now_ms, "until")
    conn = from_stream(settings.redis_url, since_ms)
    try:
        return totals(conn, since_ms, until_ms, check_group(args.by))
    finally:
        conn.close()
