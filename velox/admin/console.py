"""The operator's console at `/ui`: static files shipped in the package, and its few JSON reads.

Everything the page needs is in `velox/admin/console/` (HTML, CSS, the script, and uPlot with
its licence in `vendor/`): no CDN, no external font, so it works offline. The files are read
once at start and served from memory without the token (they hold no data); every number
comes from token-protected JSON paths: the key API (`keyapi.py`), /stats, the profiler, and
these two:

* `GET /ui/api/series?after=T`: the samples (`sampler.py`) taken after unix time T.
* `GET /ui/api/upstreams`: each upstream's breaker, in-flight and counts now, its state
  transitions, and the routes' shares (the /stats parts, without asking the workers).

Sign-in: the page asks for the admin token once, keeps it in the tab's sessionStorage (gone
when the tab closes) and sends it as `Authorization: Bearer` on every request. No cookie is
ever set, so a request another site makes the browser send carries no credential; beyond
that, a changing request (POST, PATCH, DELETE) is refused unless it is JSON and same-origin
(`csrf_problem`), which also stops a form post to an admin server bound without a token.

Headers on the console's files: a strict Content-Security-Policy (only this origin's scripts,
styles and connections; no inline script or style, no frames, no plugins), X-Frame-Options
DENY, nosniff and no referrer.

Charts: uPlot 1.6.32 (MIT, 51 KB minified, 22 KB gzipped), drawing on canvas. The page polls
numbers (a few hundred bytes a second) and draws them itself; server-rendered SVG would have
the admin server build and send every chart again at each poll (tens of KB a second per
page, and the supervisor's CPU), which is what the console must not cost.
"""

from __future__ import annotations

import mimetypes
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import orjson

from velox.admin import snapshot
from velox.admin.sampler import Sampler
from velox.admin.transport import Answer, Request, error

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; font-src 'none'; object-src 'none'; frame-src 'none'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
PAGE_HEADERS = (("Content-Security-Policy", CSP), ("X-Frame-Options", "DENY"),
                ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"))
API_HEADERS = (("X-Content-Type-Options", "nosniff"), ("X-Frame-Options", "DENY"))
CHANGING = frozenset(("POST", "PATCH", "PUT", "DELETE"))
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".html": "text/html; charset=utf-8", ".svg": "image/svg+xml",
          ".txt": "text/plain; charset=utf-8"}


def load_files() -> dict[str, Answer]:
    """/ui paths -> their answers, read from the package once."""
    root = resources.files("velox.admin") / "console"
    out: dict[str, Answer] = {}

    def walk(node: Any, prefix: str) -> None:
        for item in node.iterdir():
            if item.is_dir():
                walk(item, f"{prefix}{item.name}/")
            elif not item.name.startswith("."):
                suffix = "." + item.name.rpartition(".")[2]
                kind = _TYPES.get(suffix) or mimetypes.guess_type(item.name)[0] or \
                    "application/octet-stream"
                out[f"/ui/{prefix}{item.name}"] = Answer(200, kind, item.read_bytes(),
                                                         PAGE_HEADERS)

    walk(root, "")
    index = out["/ui/index.html"]
    out["/ui"] = out["/ui/"] = index
    return out


def csrf_problem(request: Request) -> str | None:
    """Why a changing request looks cross-site (None: it does not). Browsers send Origin and
    Sec-Fetch-Site on every such request; a form can only send a form's content type."""
    if request.method not in CHANGING:
        return None
    headers = request.headers
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"a {site} request may not change anything here (Sec-Fetch-Site)"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if parts.netloc != headers.get("host") or parts.scheme != "http":
            return "a request from another origin may not change anything here (Origin)"
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if request.body_length and kind != "application/json":
        return "a changing request must be JSON (Content-Type: application/json)"
    if not request.body_length and kind and kind != "application/json":
        return "a changing request must be JSON (Content-Type: application/json)"
    return None


def loopback_host(request: Request) -> bool:
    """Whether the Host header names this machine (an admin server bound without a token
    refuses other names: a DNS rebinding page would be 'same-origin' on it)."""
    host = request.headers.get("host", "")
    name = host.rpartition(":")[0] if not host.endswith("]") else host
    name = name.strip("[]") or host
    return name in ("localhost", "127.0.0.1", "::1") or name.startswith("127.")


class Console:
    def __init__(self, sampler: Sampler) -> None:
        self.files = load_files()
        self.sampler = sampler

    def static(self, path: str) -> Answer | None:
        return self.files.get(path)

    def api(self, request: Request, shared: Any) -> Answer:
        if request.path == "/ui/api/series":
            raw = (request.query.get("after") or ["0"])[-1]
            try:
                after = float(raw)
            except ValueError:
                return error(400, f"after must be unix seconds, got {raw!r}")
            doc: dict[str, Any] = {"interval_s": 1.0, "samples": self.sampler.since(after),
                                   "workers": shared.workers}
            return Answer(200, "application/json", orjson.dumps(doc), API_HEADERS)
        if request.path == "/ui/api/upstreams":
            with self.sampler.lock:
                transitions = list(self.sampler.transitions)
            doc = {"upstreams": snapshot.upstreams(shared), "routes": snapshot.routes_doc(shared),
                   "transitions": transitions}
            return Answer(200, "application/json", orjson.dumps(doc), API_HEADERS)
        return error(404, f"unknown console path {request.path}")
