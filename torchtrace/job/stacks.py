"""Every thread's stack, the user's frames first: taken live, or read from a faulthandler dump.

A frame is the user's when its file lies outside Python's standard library, PyTorch,
torchtrace and installed packages (``site-packages``). A stack is listed innermost first
with the user's frames ahead of the rest, so its first line is the line of the user's code
the thread is in (``where``).

>>> import threading
>>> is_user_file("/home/me/train.py"), is_user_file(threading.__file__), is_user_file(__file__)
(True, False, False)
>>> threads = capture(threading.get_ident())
>>> threads[0]["training"], [t for t in threads if t["training"]] == threads[:1]
(True, True)
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
from importlib.util import find_spec
from types import FrameType
from typing import Any

# PyTorch's directory without importing it (``torchtrace why`` needs no torch).
_TORCH = find_spec("torch")
_LIBRARY_DIRS = tuple(os.path.normcase(os.path.realpath(p)) + os.sep for p in {
    sysconfig.get_paths().get("stdlib", ""), sysconfig.get_paths().get("platstdlib", ""),
    os.path.dirname(_TORCH.origin) if _TORCH is not None and _TORCH.origin else "",
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # torchtrace
} if p)
_MAX_FRAMES = 64
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\]")


def is_user_file(filename: str) -> bool:
    """True for a file of the user's code: not the standard library, PyTorch, torchtrace or an installed package."""
    if not filename or filename.startswith("<"):
        return filename in ("<stdin>", "<string>")
    path = os.path.normcase(os.path.realpath(filename))
    # Installed packages, and any Python's standard library (a dump read on another machine).
    if "site-packages" in path or "dist-packages" in path or _STDLIB.search(path):
        return False
    return not path.startswith(_LIBRARY_DIRS)


def _frame(filename: str, line: int | None, function: str) -> dict[str, Any]:
    return {"file": filename, "line": line, "function": function, "user": is_user_file(filename)}


def user_first(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``frames`` (innermost first) with the user's frames moved ahead, each group in its order."""
    return [f for f in frames if f["user"]] + [f for f in frames if not f["user"]]


def _from_frame(frame: FrameType | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while frame is not None and len(out) < _MAX_FRAMES:
        out.append(_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def _thread(ident: int, name: str, frames: list[dict[str, Any]], training: int | None) -> dict[str, Any]:
    ordered = user_first(frames)
    return {"ident": ident, "name": name, "training": ident == training, "where": ordered[0] if ordered else None,
            "stack": ordered}


def capture(training: int | None, skip: int | None = None) -> list[dict[str, Any]]:
    """Every thread's stack now (``sys._current_frames``), the training thread's first.

    Args:
        training: the ident of the thread that runs the steps.
        skip: a thread to leave out (the watchdog's own).
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = [_thread(ident, names.get(ident, "?"), _from_frame(frame), training)
               for ident, frame in sys._current_frames().items() if ident != skip]
    threads.sort(key=lambda t: not t["training"])
    return threads


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*)\])? \(most recent call first\):")
_FILE = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


FATAL = "Fatal Python error: "
"""How faulthandler begins the dump of a crash (``faulthandler.enable``): ``Fatal Python error:
Segmentation fault``; a hang's dump (``dump_traceback_later``) begins ``Timeout (``."""


def _last_dump(text: str) -> int:
    """Where the last dump in ``text`` begins, a hang's or a crash's (-1: none)."""
    return max(text.rfind("Timeout ("), text.rfind(FATAL))


def fatal_error(text: str) -> str | None:
    """``Fatal Python error: Segmentation fault`` when the last dump in ``text`` is a crash's,
    else None."""
    start = _last_dump(text)
    if start < 0 or not text.startswith(FATAL, start):
        return None
    return text[start:].split("\n", 1)[0].strip()


def parse_faulthandler(text: str, training: int | None) -> list[dict[str, Any]]:
    """The threads of the last faulthandler dump in ``text``: a hang's (``dump_traceback_later``)
    or a crash's (``faulthandler.enable``)."""
    start = _last_dump(text)
    threads: list[dict[str, Any]] = []
    frames: list[dict[str, Any]] | None = None
    ident = 0
    name = ""
    for line in text[max(start, 0):].splitlines():
        head = _THREAD.match(line)
        if head is not None:
            if frames is not None:
                threads.append(_thread(ident, name, frames, training))
            ident, name, frames = int(head.group(1), 16), head.group(2) or "?", []
            continue
        entry = _FILE.match(line)
        if entry is not None and frames is not None:
            number = entry.group(2)
            frames.append(_frame(entry.group(1), int(number) if number.isdigit() else None, entry.group(3)))
    if frames is not None:
        threads.append(_thread(ident, name, frames, training))
    if threads and not any(t["training"] for t in threads):
        # The training thread unknown: the first with a frame of the user's code.
        first = next((t for t in threads if t["where"] and t["where"]["user"]), None)
        if first is not None:
            first["training"] = True
    threads.sort(key=lambda t: not t["training"])
    return threads


def format_threads(threads: list[dict[str, Any]]) -> str:
    """Readable text: one block per thread, the user's frames first."""
    lines: list[str] = []
    for t in threads:
        role = " (training thread)" if t["training"] else ""
        lines.append(f"Thread {t['ident']:#x} {t['name']}{role}, the user's frames first:")
        for f in t["stack"]:
            mark = "" if f["user"] else "  [library]"
            lines.append(f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}{mark}')
        lines.append("")
    return "\n".join(lines)


def where(frame: dict[str, Any] | None) -> str:
    """``file:line in function`` of a frame, or ``unknown``."""
    if not frame:
        return "unknown"
    return f"{frame['file']}:{frame['line']} in {frame['function']}"
