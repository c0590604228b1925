"""The debug HTTP API beside ``/metrics``: summaries, the event timeline, the live page,
and two changes (debug level, clear history) applied by the training thread.

Routes (all served by the runtime's :class:`~torchtrace.export.server.TelemetryServer`):

=========================  ======================================================================
``GET /``                  the live page (one self-contained HTML file, no network needed)
``GET /healthz``           ``{"status": "ok"}`` while the process serves
``GET /debug/summary``     :meth:`Runtime.summary` plus the pending-change count
``GET /debug/training/summary``  steps, anomaly steps and rates by kind (:func:`history_training_summary`)
``GET /debug/steps``       recent step summaries, newest page first (``?limit=``, default 500;
                           ``?before=`` the ``next_before`` of the previous page)
``GET /debug/events``      timeline events with ``seq > since``, oldest first (``?since=``,
                           ``?limit=``, default 500); ``more`` says whether another page waits
``POST /debug/level/{l}``  queue a debug-level change (off, basic, advanced, extreme)
``POST /debug/clear``      queue clearing the history
=========================  ======================================================================

Safety rules, in the order they are checked:

1. Only the methods above; others get 405 (the server's routing does this), or 501 for a
   method the server does not implement at all (``TRACE``, a made-up one).
2. The ``Host`` header must name a loopback address (or the address the server was told to
   bind): a DNS-rebinding page cannot reach the API through a name it controls. 403.
3. A browser ``Origin`` header is refused on every POST, and on a GET unless it is the
   page's own origin. 403.
4. A POST needs ``Authorization: Bearer <token>``; missing: 401, wrong: 403. The token is the
   ``debug_token`` setting, else random per process, compared with :func:`hmac.compare_digest`.
5. Bodies are at most :data:`MAX_BODY_BYTES` (413) and chunked bodies are refused (411).
6. Arguments are validated (400).

A change is never applied on the server thread: it is queued with :meth:`Runtime.request`
and the training thread applies it when the next step starts. Changes of one kind in a row
collapse into one (the last level asked for; one clear), and at most
:data:`MAX_PENDING_CHANGES` wait: a POST beyond that gets 429.

Every response is bounded in bytes, whatever the model: every list in a response keeps
:data:`MAX_LIST_ITEMS` entries and states how many it left out (``<key>_omitted``); one step
or event is at most :data:`MAX_ITEM_BYTES`; a page stops at
:data:`MAX_RESPONSE_BYTES` (``omitted_by_size`` counts what the limit left for the next page).
Each step and event is serialised once and the bytes reused by later polls, so a client
polling the live page costs the training thread next to nothing.
"""

from __future__ import annotations

import hmac
import operator
import secrets
import threading
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from torchtrace import files
from torchtrace.errors import get_logger
from torchtrace.export.bounded_json import (
    MAX_ITEM_BYTES,
    MAX_LIST_ITEMS,
    MAX_RESPONSE_BYTES,
    MAX_STRING_CHARS,
    ItemCache,
    bounded_json,
    page_json,
    shrink,
)
from torchtrace.export.debug_summary import history_training_summary, retry_copy, seed_debug_summary
from torchtrace.levels import DebugLevel

__all__ = ["DebugAPI", "LOOPBACK_HOSTS", "MAX_BODY_BYTES", "MAX_ITEM_BYTES", "MAX_LIST_ITEMS", "MAX_RESPONSE_BYTES",
           "MAX_STEPS_RETURNED", "MAX_STRING_CHARS", "bounded_json", "history_training_summary", "install_debug_api",
           "shrink"]

logger = get_logger("torchtrace")

MAX_BODY_BYTES = 4096
"""Largest request body accepted; the API's POSTs need no body at all."""
MAX_STEPS_RETURNED = 2000
MAX_PENDING_CHANGES = 32
"""Changes (level, clear) waiting for the next step at most; more are refused with 429."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "localhost.localdomain"})
_JSON = "application/json"
_EVENT_DICT = operator.methodcaller("as_dict")
_TEXT = "text/plain; charset=utf-8"


def _host_name(host_header: str) -> str:
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else ""
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


class DebugAPI:
    """The debug routes of one runtime. Built by :func:`install_debug_api` at configure.

    Attributes:
        token: the bearer token mutating requests need.
        training_summary: ``fn(runtime) -> dict`` serving ``/debug/training/summary``;
            replace it to serve another monitor's summary.
    """

    def __init__(self, runtime, server, token: str | None = None) -> None:
        self.runtime = runtime
        self.server = server
        self.token = token or secrets.token_urlsafe(32)
        self.token_from_settings = token is not None
        self.training_summary: Callable[[Any], dict[str, Any]] = history_training_summary
        self.refused = 0
        self._cache = ItemCache()
        self._queue_lock = threading.Lock()
        self._last_queued: dict[str, Any] | None = None  # the newest change still waiting (see _queue)

    # ------------------------------------------------------------ set-up
    def install(self) -> "DebugAPI":
        add = self.server.add_route
        add("GET", "/", self._guarded(self._page))
        add("GET", "/healthz", self._healthz)
        add("GET", "/debug/summary", self._guarded(self._summary))
        add("GET", "/debug/training/summary", self._guarded(self._training))
        add("GET", "/debug/steps", self._guarded(self._steps))
        add("GET", "/debug/events", self._guarded(self._events))
        add("GET", "/debug/hang", self._guarded(self._hang))
        add("POST", "/debug/level/", self._guarded(self._level, mutating=True))
        add("POST", "/debug/clear", self._guarded(self._clear, mutating=True))
        # Seed 001's routes (/training-logs/debug/...): aliases of the four above, same handlers
        # and the same safety checks; the handlers see the path without the prefix.
        seed_prefix = "/training-logs"

        class _Unprefixed:
            def __init__(self, request) -> None:
                self._request = request
                self.path = request.path[len(seed_prefix):]

            def __getattr__(self, name: str):
                return getattr(self._request, name)

        for method, path, handler, mutating in (("GET", "/debug/summary", self._seed_summary, False),
                                                ("GET", "/debug/training/summary", self._training, False),
                                                ("POST", "/debug/level/", self._level, True),
                                                ("POST", "/debug/clear", self._clear, True)):
            add(method, seed_prefix + path,
                self._guarded(lambda request, h=handler: h(_Unprefixed(request)), mutating=mutating))
        return self

    def announce(self) -> None:
        """Log where the page is and, once and only locally, the token (never to telemetry)."""
        url = self.server.url
        if self.token_from_settings:
            logger.info("torchtrace live page: %s/ (debug API token from the debug_token setting)", url)
        else:
            logger.info("torchtrace live page: %s/ ; debug API token: %s", url, self.token)

    # ------------------------------------------------------------ checks
    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None):
        self.refused += 1
        out = {"Connection": "close"}
        out.update(headers or {})
        return status, _JSON, files.dumps({"error": message}).encode(), out

    def _allowed_host(self, request) -> bool:
        header = request.headers.get("Host")
        if not header:
            return False
        name = _host_name(header)
        if name in LOOPBACK_HOSTS:
            return True
        bound = (self.server.host or "").lower()
        return bool(bound) and bound not in ("0.0.0.0", "::") and name == bound

    def _check(self, request, mutating: bool):
        if not self._allowed_host(request):
            return self._refuse(403, "Host must name a loopback address")
        origin = request.headers.get("Origin")
        if origin is not None:
            own = "http://" + request.headers.get("Host", "").strip().lower()
            if mutating or origin.strip().lower() != own:
                return self._refuse(403, "browser cross-origin requests are refused")
        if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
            return self._refuse(403, "browser cross-origin requests are refused")
        if not mutating:
            return None
        auth = request.headers.get("Authorization")
        if not auth:
            return self._refuse(401, "missing token: send 'Authorization: Bearer <token>'",
                                {"WWW-Authenticate": 'Bearer realm="torchtrace"'})
        scheme, _, given = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return self._refuse(403, "wrong token")
        if request.headers.get("Transfer-Encoding"):
            return self._refuse(411, "send a Content-Length, not a chunked body")
        raw = request.headers.get("Content-Length", "0").strip() or "0"
        if not raw.isdigit():
            return self._refuse(400, "bad Content-Length")
        length = int(raw)
        if length > MAX_BODY_BYTES:
            return self._refuse(413, f"body over {MAX_BODY_BYTES} bytes")
        if length:
            request.rfile.read(length)  # bounded above; the API takes no body
        return None

    def _guarded(self, handler, mutating: bool = False):
        def route(request):
            refusal = self._check(request, mutating)
            if refusal is not None:
                return refusal
            return handler(request)

        return route

    # ------------------------------------------------------------ GET handlers
    def _json(self, value: object, status: int = 200):
        return status, _JSON, bounded_json(value), {}

    def _healthz(self, request):
        return self._json({"status": "ok", "run_id": self.runtime.settings.run_id})

    def _summary(self, request):
        rt = self.runtime
        out = retry_copy(rt.summary)
        out["pending_changes"] = rt.pending_changes
        return self._json(out)

    def _seed_summary(self, request):
        """Seed 001's summary: ours plus its three debugger sections (:func:`seed_debug_summary`)."""
        rt = self.runtime
        out = seed_debug_summary(rt)
        out["pending_changes"] = rt.pending_changes
        return self._json(out)

    def _training(self, request):
        return self._json(self.training_summary(self.runtime))

    def _steps(self, request):
        query = parse_qs(urlsplit(request.path).query, keep_blank_values=True)
        limit = _int_arg(query, "limit", 500)
        if limit is None or not 1 <= limit <= MAX_STEPS_RETURNED:
            return self._refuse(400, f"limit must be an integer 1-{MAX_STEPS_RETURNED}")
        before = _int_arg(query, "before", 0)
        if before is None or before < 0:
            return self._refuse(400, "before must be a non-negative integer (0: the newest steps)")
        steps, first = self._numbered_steps()
        # Step i of the list is the (first + i)-th step recorded since the history began.
        end = len(steps) if not before else max(0, min(len(steps), before - first))
        items: list[bytes] = []
        size = 0
        i = end - 1
        while i >= 0 and len(items) < limit:
            item = self._cache.item(("step", first + i), steps[i])
            if size + len(item) + 2 > MAX_RESPONSE_BYTES - 256:
                break
            items.append(item)
            size += len(item) + 2
            i -= 1
        start = i + 1
        omitted = min(limit, end) - len(items)
        tail = {"next_before": first + start if start > 0 else None, "total": first + len(steps) - 1,
                "omitted_by_size": omitted}
        self._cache.prune("step", first)
        return 200, _JSON, page_json("steps", reversed(items), tail), {}

    def _numbered_steps(self) -> tuple[list[dict[str, Any]], int]:
        """The retained steps and the number of the first (1 = the first step ever recorded)."""
        h = self.runtime.history
        for _ in range(5):
            total = h.totals.get("steps", 0)
            steps = h.steps()
            if h.totals.get("steps", 0) == total:
                break
        return steps, total - len(steps) + 1

    def _events(self, request):
        query = parse_qs(urlsplit(request.path).query, keep_blank_values=True)
        since = _int_arg(query, "since", 0)
        if since is None or since < 0:
            return self._refuse(400, "since must be a non-negative integer")
        limit = _int_arg(query, "limit", 500)
        if limit is None or not 1 <= limit <= MAX_STEPS_RETURNED:
            return self._refuse(400, f"limit must be an integer 1-{MAX_STEPS_RETURNED}")
        events = self.runtime.history.events(since)
        items: list[bytes] = []
        size = 0
        last = since
        for event in events[:limit]:
            item = self._cache.item(("event", event.seq), event, _EVENT_DICT)
            if size + len(item) + 2 > MAX_RESPONSE_BYTES - 256:
                break
            items.append(item)
            size += len(item) + 2
            last = event.seq
        if events:
            self._cache.prune("event", events[0].seq)
        return 200, _JSON, page_json("events", items, {"last_seq": last, "more": len(items) < len(events)}), {}

    def _hang(self, request):
        """The watchdog now: phase, stall, timeout, hangs; the last finding with the training
        thread's stack (every thread's stack is in the run directory's stacks file)."""
        watchdog = self.runtime.watchdog
        if watchdog is None:
            return self._json({"enabled": False})
        out = watchdog.summary()
        last = watchdog.findings[-1] if watchdog.findings else None
        if last is not None:
            out["finding"] = {k: v for k, v in last.items() if k != "threads"}
        return self._json(out)

    def _page(self, request):
        from torchtrace.reporting.page import live_page

        return 200, "text/html; charset=utf-8", live_page().encode("utf-8"), {
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; connect-src 'self'; img-src data:"}

    # ------------------------------------------------------------ POST handlers (queued)
    def _level(self, request):
        raw = unquote(urlsplit(request.path).path[len("/debug/level/"):])
        try:
            level = DebugLevel.parse(raw, "level")
        except ValueError as exc:
            return self._refuse(400, str(exc)[:200])
        rt = self.runtime
        if not self._queue("level", level, rt.set_level):
            return self._too_many()
        return self._json({"accepted": True, "level": level.value, "applies": "at the next step"}, 202)

    def _clear(self, request):
        rt = self.runtime

        def clear(_: object) -> None:
            rt.history.clear()
            rt.history.add_event("history_cleared", "debug history cleared through the HTTP API")

        if not self._queue("clear", None, clear):
            return self._too_many()
        return self._json({"accepted": True, "applies": "at the next step"}, 202)

    def _too_many(self):
        return self._refuse(429, f"{MAX_PENDING_CHANGES} changes wait for the next step already; "
                                 "send this one after it", {"Retry-After": "1"})

    def _queue(self, kind: str, value: Any, apply: Callable[[Any], None]) -> bool:
        """Queue ``apply(value)`` for the training thread's next step boundary, unless the newest
        change still waiting is of the same kind: that one then applies ``value`` instead (two
        level changes in a row leave the last level; two clears in a row are one clear). The
        queue stays as short as the alternations between kinds, and at most
        :data:`MAX_PENDING_CHANGES` long (False: refused, the queue is full)."""
        with self._queue_lock:
            last = self._last_queued
            if last is not None and last["kind"] == kind:
                last["value"] = value
                return True
            if self.runtime.pending_changes >= MAX_PENDING_CHANGES:
                return False
            entry = {"kind": kind, "value": value}
            self._last_queued = entry

        def change() -> None:
            with self._queue_lock:
                if self._last_queued is entry:
                    self._last_queued = None
                chosen = entry["value"]
            apply(chosen)

        self.runtime.request(change)
        return True


def _int_arg(query: dict[str, list[str]], name: str, default: int) -> int | None:
    values = query.get(name)
    if not values:
        return default
    raw = values[-1].strip()
    # ASCII digits only: str.isdigit() is also true of "²", which int() refuses (a 500).
    if not (raw.isascii() and raw.lstrip("-").isdigit()) or len(raw) > 18:
        return None
    return int(raw)


def install_debug_api(runtime, server) -> DebugAPI:
    """Add the debug routes to ``server`` for ``runtime`` (called by the runtime at configure)."""
    return DebugAPI(runtime, server, runtime.settings.debug_token).install()
