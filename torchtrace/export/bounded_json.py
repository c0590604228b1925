"""Bounded JSON for the debug API: every list and string cut, every document capped in bytes.

Steps and events are serialised once (:class:`ItemCache`) and their bytes reused by later
polls. Re-exported by :mod:`torchtrace.export.debug_api`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torchtrace import files

MAX_RESPONSE_BYTES = 1024 * 1024
"""Largest body of any debug API response."""
MAX_ITEM_BYTES = 16 * 1024
"""Largest serialised step summary or event; a larger one is replaced by a stub naming it."""
MAX_LIST_ITEMS = 20
"""Entries kept of any list in a served document (parameter names, ...); the rest are counted."""
MAX_STRING_CHARS = 1024


class ItemCache:
    """Serialised steps and events by number: each is shrunk and encoded once, then its bytes
    are reused by every later poll. Entries older than the history's window are pruned.

    >>> cache = ItemCache()
    >>> cache.item(("step", 1), {"step": 1})
    b'{"step": 1}'
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[tuple[str, int], tuple[Any, bytes]] = {}

    def item(self, key: tuple[str, int], obj: object, convert: Callable[[Any], object] | None = None) -> bytes:
        hit = self._items.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        data = bounded_json(convert(obj) if convert else obj, MAX_ITEM_BYTES)
        with self._lock:
            self._items[key] = (obj, data)
        return data

    def prune(self, kind: str, first: int) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == kind and k[1] < first]:
                del self._items[key]


def shrink(value: object, depth: int = 0) -> object:
    """``value`` with every list cut to :data:`MAX_LIST_ITEMS` entries (a ``<key>_omitted``
    count beside it in a dict) and every string to :data:`MAX_STRING_CHARS` characters.

    >>> shrink({"names": [str(i) for i in range(25)]})["names_omitted"]
    5
    """
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            key = str(key)[:MAX_STRING_CHARS]
            if isinstance(item, (list, tuple)) and len(item) > MAX_LIST_ITEMS and depth < 8:
                out[key] = [shrink(v, depth + 1) for v in item[:MAX_LIST_ITEMS]]
                # A list the record already capped says how many it left out: add to that.
                earlier = value.get(key + "_omitted")
                out[key + "_omitted"] = len(item) - MAX_LIST_ITEMS + (earlier if isinstance(earlier, int) else 0)
            elif key.endswith("_omitted") and key in out:
                continue  # already summed with its list
            else:
                out[key] = shrink(item, depth + 1) if depth < 8 else None
        return out
    if isinstance(value, (list, tuple)):
        return [shrink(v, depth + 1) for v in value[:MAX_LIST_ITEMS]] if depth < 8 else None
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        return value[:MAX_STRING_CHARS]
    return value


def bounded_json(value: object, max_bytes: int = MAX_RESPONSE_BYTES) -> bytes:
    """Strict JSON of ``value`` with lists and strings shrunk (:func:`shrink`), in at most
    ``max_bytes``; a document still too large becomes a stub that says how large it was.

    >>> bounded_json({"step": 3, "note": "x" * 100}, 60)
    b'{"truncated": true, "bytes": 123, "step": 3}'
    """
    data = files.dumps(shrink(value)).encode()
    if len(data) <= max_bytes:
        return data
    stub: dict[str, Any] = {"truncated": True, "bytes": len(data)}
    if isinstance(value, dict):
        stub.update({k: value[k] for k in ("seq", "step", "operation", "type") if isinstance(value.get(k), (int, str))})
    for doc in (stub, {"truncated": True}, {}):
        out = files.dumps(shrink(doc)).encode()
        if len(out) <= max_bytes:
            return out
    return b"{}"


def page_json(key: str, items, tail: dict[str, Any]) -> bytes:
    """One page: ``{"<key>": [items...], <tail's fields>}``, the items already serialised.

    >>> page_json("steps", [b'{"step": 1}'], {"total": 1})
    b'{"steps": [{"step": 1}], "total": 1}'
    """
    return b'{"' + key.encode() + b'": [' + b", ".join(items) + b"], " + files.dumps(tail).encode()[1:]
