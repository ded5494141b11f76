"""Keys stage: who the caller is among the `[[key]]` gateway keys, and its own limits.

Runs in the worker after parse and before the gateway's global limiter (worker.process). For
each request of the batch: one dict lookup of the caller's digest (auth.caller_of: the SHA-256
of the credential it presented; ingress computed it already when it checked the key), so the
cost does not grow with the number of keys. A request of no `[[key]]` (VELOX_API_KEYS, or no
client auth) passes untouched with `request.key = -1`. For a keyed request, in order:

  1. `models`: a model call naming a route the key may not use gets 403 model_not_allowed (the
     SDK raises PermissionDeniedError). The route is the model's own `[[route]]`, else `"*"`
     (also for an images/audio call naming no model). A forwarded endpoint (no model read:
     files, batches, fine-tuning, ...) gets 403 endpoint_not_allowed unless the key may
     forward (`forward`, by default only a key without `models` and `tpm`); the gateway's own
     GET /v1/models answer is no forward.
  2. `rpm`: one token of the key's request bucket.
  3. `tpm` (model calls; images and audio reserve 1, settled from the usage they report): the
     request's estimated tokens (velox.relay.usage.estimate), at least 1 (a key in debt is refused
     whatever the request) and at most the key's tpm (one large request can still pass a full
     bucket); the difference to the real usage is settled later
     (the ticket's `settle`), and over-use becomes debt the key's next requests repay first.
  4. `max_parallel`: one place of the key's gauge (every key's gauge counts, so /stats shows
     each key's requests in flight; only keys with max_parallel refuse).
A refusal gives back what the earlier steps took and answers 429 rate_limit_error with
Retry-After from the bucket's own refill time (1 s for max_parallel). Every answer of a keyed
request that reached this stage carries OpenAI's x-ratelimit-limit/remaining-requests/tokens
headers (for the limits the key has), through `request.extra_headers`.

The state is shared: `velox.state.keys.SharedKeys` holds a table of native `Limits` segments of
4,096 keys (made by the supervisor, before the workers fork or handed to them later), two
entries per key: 2k is key k's request bucket and its gauge, 2k+1 its token bucket, k its place
in its segment; buckets hold one minute's worth (burst = the limit). Each `_Key` keeps its
segment's bound methods, so the lookup and the admission cost what one table cost. Each admitted
keyed request holds a ticket (`request.ticket`, a native `Limits.ticket`: see
velox.core.types.KeyTicket) until it ends; the request's one `finish()` releases it, whichever way
it ends. A worker killed with requests in flight cannot release: the supervisor calls
`SharedKeys.forget_slot` for its slot after reaping it.

A reload keeps the keys' buckets and gauges when their names are unchanged (velox.state.keys).

Run-time keys (made through the admin API) join `by_digest` through `use_runtime`
(velox.admission.runtime applies the supervisor's frames): the same _Key, with an index the
supervisor claimed in the shared table, so the lookup and the limits are the file keys' own.
Their `request.key` is their place in `KeyNames` after the file's keys, so the access log and
the ledger's rows name them; the per-route token books, the budgets and the spend series are
sized by the file's keys at start and count them under no key (their own token counts are in
the key table's segment).
"""

from __future__ import annotations

from typing import Any

from velox.config.tables import CATCH_ALL, KeySpec, Tables
from velox.core.errors import EndpointNotAllowed, ModelNotAllowed, RateLimited
from velox.core.fields import KF
from velox.core.types import Kind, Request
from velox.ingress.auth import caller_of
from velox.ingress.classify import is_model_list
from velox.relay.usage import estimate
from velox.state.keys import SharedKeys, rpm_index, tpm_index
from velox.state.limits import Admit, refusal, remaining

# --- per request ----------------------------------------------------------------------------


class _Key:
    """One key as the stage uses it (per worker)."""

    __slots__ = ("index", "local", "book", "name", "rpm", "tpm", "max_parallel", "allowed",
                 "rpm_i", "tpm_i", "rpm_value", "tpm_value", "req_i", "tok_i", "headers",
                 "limits", "admit", "ticket", "count", "tokens_in", "tokens_out", "slot",
                 "limit_requests", "limit_tokens", "forward")

    def __init__(self, index: int, spec: KeySpec, shared: SharedKeys, slot: int,
                 book: int | None = None) -> None:
        # The key's segment of the growing table (velox.state.keys) and its place in it; the
        # segment's bound methods are kept so admitting costs what one table cost.
        segment, local = shared.table.locate(index)
        limits = self.limits = segment.limits
        self.admit = limits.admit
        self.ticket: Any = limits.ticket  # a KeyTicket as the request holds it
        self.count = tuple(c.add for c in segment.counters)
        self.tokens_in = segment.counters[KF.TOKENS_IN].add
        self.tokens_out = segment.counters[KF.TOKENS_OUT].add
        self.slot = slot
        self.index = index
        self.local = local
        self.book = index if book is None else book  # request.key: the token books' row
        self.name = spec.name
        self.rpm = spec.rpm
        self.tpm = spec.tpm
        self.max_parallel = spec.max_parallel
        self.allowed = frozenset(spec.models) if spec.models is not None else None
        self.forward = spec.may_forward
        self.rpm_i = rpm_index(local)
        self.tpm_i = tpm_index(local)
        self.rpm_value = b"%d" % spec.rpm
        self.tpm_value = b"%d" % spec.tpm
        # Limits.admit's indexes: -1 skips a bucket the key does not have.
        self.req_i = self.rpm_i if spec.rpm else -1
        self.tok_i = self.tpm_i if spec.tpm else -1
        self.headers = bool(spec.rpm or spec.tpm)
        self.limit_requests = (_LIMIT_REQUESTS, self.rpm_value)
        self.limit_tokens = (_LIMIT_TOKENS, self.tpm_value)


    def used(self, inp: int, out: int) -> None:
        """Book the tokens one of its requests used under the key itself (the relay's meter
        and the batcher call it through the request's ticket: `ticket.key.used`)."""
        if inp:
            self.tokens_in(self.slot, self.local, inp)
        if out:
            self.tokens_out(self.slot, self.local, out)


_LIMIT_REQUESTS = b"x-ratelimit-limit-requests"
_REMAINING_REQUESTS = b"x-ratelimit-remaining-requests"
_LIMIT_TOKENS = b"x-ratelimit-limit-tokens"
_REMAINING_TOKENS = b"x-ratelimit-remaining-tokens"


class KeyNames:
    """request.key -> the key's name: the file's keys first (their places are their rows in the
    token books), then each run-time key from the first time this worker makes it. A place is
    never reused or freed, so an access-log line formatted after its key was revoked still
    names it, and the same name keeps its place when its key is changed or rotated."""

    __slots__ = ("_at", "_names", "file", "names")

    def __init__(self, file_names: tuple[str, ...]) -> None:
        self.file = len(file_names)
        self._names = list(file_names)
        self._at = {name: i for i, name in enumerate(file_names)}
        self.names = file_names  # what the readers hold (velox.pipeline.worker.Worker)

    def book(self, name: str) -> int:
        at = self._at.get(name)
        if at is None:
            at = self._at[name] = len(self._names)
            self._names.append(name)
        return at

    def publish(self) -> tuple[str, ...]:
        """The names as a tuple (the native access line's form), made again only when some
        were added: once per frame of changes, not per key."""
        if len(self.names) != len(self._names):
            self.names = tuple(self._names)
        return self.names


class KeyStage:
    """The stage, per worker: `run(batch)` returns the requests that go on."""

    __slots__ = ("by_digest", "file_digest", "keys", "shared", "slot", "named_routes", "names")

    def __init__(self, tables: Tables, shared: SharedKeys, slot: int) -> None:
        self.keys = tuple(_Key(i, spec, shared, slot) for i, spec in enumerate(tables.keys))
        self.names = KeyNames(tuple(spec.name for spec in tables.keys))
        self.file_digest = {spec.digest: self.keys[i] for i, spec in enumerate(tables.keys)}
        self.by_digest = self.file_digest
        self.shared = shared
        self.slot = slot
        self.named_routes = frozenset(r.model for r in tables.routes if r.model != CATCH_ALL)

    def runtime_key(self, index: int, spec: KeySpec) -> _Key:
        """A run-time key at table `index` (velox.state.keys.SharedKeys.claim); its segment
        must be mapped in this worker (IndexError otherwise)."""
        return _Key(index, spec, self.shared, self.slot, book=self.names.book(spec.name))

    def use_runtime(self, keys: dict[bytes, _Key]) -> None:
        """The run-time keys now valid, by digest, replacing the last set in one assignment:
        a batch sees the old set or the new one, never half of one."""
        self.by_digest = {**keys, **self.file_digest} if keys else self.file_digest

    def run(self, requests: list[Request]) -> list[Request]:
        """Decide every request of the batch; answer the refused ones (403/429) here."""
        by_digest = self.by_digest
        named = self.named_routes
        slot = self.slot
        model_call = Kind.MODEL_CALL
        forward = Kind.FORWARD
        out: list[Request] = []
        for request in requests:
            caller = request.caller
            key = by_digest.get(caller if caller is not None else caller_of(request))
            if key is None:
                out.append(request)
                continue
            request.key = key.book
            allowed = request.allowed = key.allowed
            model = request.model
            kind = request.kind
            if kind is forward:
                # Nothing of such a request can be checked against models or tpm: only keys
                # that allow it explicitly (or have neither) reach it. The gateway's own
                # answer to GET /v1/models is no forward.
                if not key.forward and not is_model_list(request.method, request.path):
                    self._refuse_forward(request, key)
                    continue
            elif allowed is not None and (model if model in named else CATCH_ALL) not in allowed:
                # A model call; one without a model (an endpoint's default) takes "*".
                self._refuse_model(request, key, model or "(the endpoint's default)")
                continue
            reserved = 0
            tok_i = key.tok_i
            if tok_i >= 0:
                if kind is model_call:
                    # At least one token, so a key in debt is refused however small the
                    # request; at most the tpm, so a large one can still pass a full bucket.
                    reserved = estimate(request)
                    reserved = key.tpm if reserved > key.tpm else reserved if reserved > 0 else 1
                elif kind is forward:
                    tok_i = -1  # forwarded calls (GET /v1/models, files...) carry no tokens
                else:
                    reserved = 1  # images, audio: settled from the usage they report
            # rpm, tpm, max_parallel in one native call, all or nothing (see Limits.admit).
            code = key.admit(key.req_i, tok_i, reserved, key.rpm_i, key.max_parallel, slot)
            if code >= 0:
                self._refuse_limit(request, key, code)
                continue
            request.ticket = key.ticket(key, key.rpm_i, key.tok_i, slot, reserved)
            if key.headers:
                # One list display per shape, the limits' header pairs made once per key:
                # about 1 us less per request than growing a list (benches/bench_keys.py).
                requests_left, tokens_left = remaining(code)
                if key.rpm:
                    if tok_i >= 0:
                        request.extra_headers = [
                            key.limit_requests, (_REMAINING_REQUESTS, b"%d" % requests_left),
                            key.limit_tokens, (_REMAINING_TOKENS, b"%d" % tokens_left)]
                    else:
                        request.extra_headers = [
                            key.limit_requests, (_REMAINING_REQUESTS, b"%d" % requests_left)]
                elif tok_i >= 0:
                    request.extra_headers = [
                        key.limit_tokens, (_REMAINING_TOKENS, b"%d" % tokens_left)]
                else:
                    request.extra_headers = []
            out.append(request)
        return out

    def _refuse_model(self, request: Request, key: _Key, model: str) -> None:
        self._headers(request, key)
        key.count[KF.REFUSED_MODEL](self.slot, key.local, 1)
        request.conn.respond_error(request, ModelNotAllowed(
            f"The gateway key {key.name!r} may not use the model {model!r}.", param="model"))

    def _refuse_forward(self, request: Request, key: _Key) -> None:
        self._headers(request, key)
        key.count[KF.REFUSED_FORWARD](self.slot, key.local, 1)
        path = request.path.split(b"?", 1)[0]
        what = f"{request.method.decode('latin-1')} {path.decode('latin-1')}"
        request.conn.respond_error(request, EndpointNotAllowed(
            f"The gateway key {key.name!r} may not use {what}: the gateway forwards this "
            "endpoint without reading a model from it, so the key's models and tpm cannot "
            "hold there (its [[key]] table may allow it with forward = true)."))

    def _refuse_limit(self, request: Request, key: _Key, code: int) -> None:
        reason, wait = refusal(code)
        if reason is Admit.REQUESTS:
            self._refuse(request, key, KF.REFUSED_RPM, wait, "requests per minute (rpm)",
                         key.rpm)
        elif reason is Admit.TOKENS:
            self._refuse(request, key, KF.REFUSED_TPM, wait, "tokens per minute (tpm)", key.tpm)
        else:
            assert reason is Admit.PARALLEL
            self._refuse(request, key, KF.REFUSED_PARALLEL, wait,
                         "requests in flight (max_parallel)", key.max_parallel)

    def _headers(self, request: Request, key: _Key) -> None:
        """The x-ratelimit-* headers of a refused request (read from the buckets)."""
        level = key.limits.level
        extra = request.extra_headers
        if extra is None:
            extra = request.extra_headers = []
        if key.rpm:
            remaining = level(key.rpm_i)
            extra += ((_LIMIT_REQUESTS, key.rpm_value),
                      (_REMAINING_REQUESTS, b"%d" % remaining if remaining > 0 else b"0"))
        if key.tpm:
            remaining = level(key.tpm_i)
            extra += ((_LIMIT_TOKENS, key.tpm_value),
                      (_REMAINING_TOKENS, b"%d" % remaining if remaining > 0 else b"0"))

    def _refuse(self, request: Request, key: _Key, field: KF, wait_us: int, what: str,
                limit: int) -> None:
        self._headers(request, key)
        key.count[field](self.slot, key.local, 1)
        retry_after = max(1, -(-wait_us // 1_000_000)) if wait_us > 0 else 60
        request.conn.respond_error(request, RateLimited(
            f"Rate limit reached for gateway key {key.name!r} on {what}: limit {limit}. "
            f"Please try again in {retry_after}s.", retry_after_s=retry_after))
