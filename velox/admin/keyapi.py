"""The admin API of gateway keys: `/keys` on the admin server (JSON in and out).

* `POST /keys` {name, models?, rpm?, tpm?, max_parallel?, budget_usd?, team?, expires_at?}:
  201 with the key's fields and its secret, once, as `key`.
* `GET /keys`: every key, the configuration file's (`"source": "config"`, read-only) and the
  run-time ones (`"source": "runtime"`), each with its live usage where the gateway counts it.
* `GET /keys/{name}`: one of them.
* `PATCH /keys/{name}` {models?, rpm?, ...}: changes a run-time key's fields.
* `POST /keys/{name}/rotate` {overlap_s? (default 60)}: a new secret as `key`; the old one
  keeps working until the overlap ends.
* `DELETE /keys/{name}`: revokes a run-time key (204).
* `GET /audit?limit=N`: the last N changes (default 100), newest first.

Bad input (an unknown field, a negative limit, a duplicate name, a body that is no JSON
object or larger than the transport takes) gets 400 with a message naming the field, and
changes nothing. No answer but the creation's and the rotation's carries a secret, and none
carries a hash.

Usage: every key's buckets and gauges are in shared memory (`SharedKeys`, as /stats shows
the file's keys); a run-time key's are those of the index it was given in the key table
(velox.admin.keyfeed), null until it has one.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

import orjson

from velox.admin.keystore import DEFAULT_OVERLAP_S, KeyError_, KeyRecord, KeyStore
from velox.admin.transport import Answer, Request, error

_JSON = "application/json"
_ONE = re.compile(r"/keys/([^/]+)")
_ROTATE = re.compile(r"/keys/([^/]+)/rotate")

def methods(path: str) -> tuple[str, ...] | None:
    """The methods `path` takes, or None when it is no key API path."""
    if path == "/keys":
        return ("GET", "HEAD", "POST")
    if path == "/audit":
        return ("GET", "HEAD")
    if _ROTATE.fullmatch(path):
        return ("POST",)
    if _ONE.fullmatch(path):
        return ("GET", "HEAD", "PATCH", "DELETE")
    return None


class KeyAPI:
    def __init__(self, store: KeyStore, shared_keys: Any) -> None:
        self.store = store
        self.shared_keys = shared_keys  # velox.keys.SharedKeys of the running configuration

    def handle(self, request: Request, who: str) -> Answer:
        path, method = request.path, request.method
        try:
            if path == "/audit":
                return _ok(200, {"entries": self.store.audit(_limit(request.query))})
            if path == "/keys":
                if method == "POST":
                    record, secret = self.store.create(who, _body(request))
                    return _ok(201, {**self._runtime(record), "key": secret})
                return _ok(200, {"keys": self.rows()})
            match = _ROTATE.fullmatch(path)
            if match:
                body = _body(request, allow_empty=True)
                unknown = sorted(set(body) - {"overlap_s"})
                if unknown:
                    raise KeyError_(f"unknown field(s) {', '.join(map(repr, unknown))}; "
                                    "accepted: overlap_s")
                record, secret = self.store.rotate(who, unquote(match[1]),
                                                   body.get("overlap_s", DEFAULT_OVERLAP_S))
                return _ok(200, {**self._runtime(record), "key": secret})
            name = unquote(_ONE.fullmatch(path)[1])  # type: ignore[index]
            if method == "PATCH":
                return _ok(200, self._runtime(self.store.update(who, name, _body(request))))
            if method == "DELETE":
                self.store.revoke(who, name)
                return Answer(204, _JSON, b"")
            row = self._row(name)
            if row is None:
                raise KeyError_(f"no key named {name!r}", 404)
            return _ok(200, row)
        except KeyError_ as exc:
            return error(exc.status, str(exc))

    def rows(self) -> list[dict[str, Any]]:
        usage = self._usage()
        out = [{**self._config_row(row), "usage": _usage_of(row)} for row in usage.values()]
        return out + [self._runtime(r) for r in self.store.records()]

    def _runtime(self, record: KeyRecord) -> dict[str, Any]:
        shared = self.shared_keys
        index = shared.runtime.get(record.name)
        usage = None if index is None else \
            _usage_of(shared.usage(index, record.rpm, record.tpm))
        return {**record.public(self.store.clock()), "usage": usage}

    def _row(self, name: str) -> dict[str, Any] | None:
        record = self.store.get(name)
        if record is not None:
            return self._runtime(record)
        row = self._usage().get(name)
        return None if row is None else {**self._config_row(row), "usage": _usage_of(row)}

    def _usage(self) -> dict[str, dict[str, Any]]:
        return {row["name"]: row for row in self.shared_keys.snapshot()}

    @staticmethod
    def _config_row(row: dict[str, Any]) -> dict[str, Any]:
        return {"name": row["name"], "source": "config", "read_only": True,
                "models": row["models"], "rpm": row["rpm"], "tpm": row["tpm"],
                "max_parallel": row["max_parallel"]}


def _usage_of(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("remaining_requests", "remaining_tokens", "tokens_taken",
                                "active", "requests", "refused", "tokens_in", "tokens_out")}


def _ok(status: int, doc: Any) -> Answer:
    return Answer(status, _JSON, orjson.dumps(doc))


def _body(request: Request, allow_empty: bool = False) -> dict[str, Any]:
    if not request.body.strip():
        if allow_empty:
            return {}
        raise KeyError_("the request needs a JSON object body")
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise KeyError_(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise KeyError_("the body must be a JSON object")
    return body


def _limit(query: dict[str, list[str]]) -> int:
    raw = (query.get("limit") or ["100"])[-1]
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise KeyError_(f"limit must be an integer from 1 to 10000, got {raw!r}")
    return int(raw)
