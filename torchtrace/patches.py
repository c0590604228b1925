"""The attributes torchtrace replaces on torch's modules and classes while it is configured (the
clip functions, GradScaler's methods, the schedulers' ``step``, ``init_process_group``), and
putting them back at ``shutdown()``.

Each replacement is remembered as made, and undone only where the attribute still holds
torchtrace's wrapper. A wrapper the application put over it since stays where the application
put it (``functools.wraps`` copies torchtrace's marker onto it, which once made shutdown put
back that wrapper's ``__wrapped__``: torchtrace's own); torchtrace's inside it does nothing
while torchtrace is not configured.
"""

from __future__ import annotations

from typing import Any

MARK = "__torchtrace_wrapped__"


def marked(value: object) -> bool:
    """torchtrace's wrapper, or a wrapper put over it (which carries its marker): nothing to wrap."""
    return bool(getattr(value, MARK, False))


class Patches:
    """Replacements made on modules and classes, undone in reverse order."""

    def __init__(self) -> None:
        self._made: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, wrapper)

    def replace(self, owner: Any, name: str, wrapper: Any) -> None:
        """Set ``owner.name`` to ``wrapper`` (marked as torchtrace's), remembering what it held."""
        setattr(wrapper, MARK, True)
        self._made.append((owner, name, vars(owner).get(name), wrapper))
        setattr(owner, name, wrapper)

    def undo(self) -> None:
        """Put back each original where torchtrace's wrapper still is (idempotent)."""
        for owner, name, original, wrapper in reversed(self._made):
            if vars(owner).get(name) is wrapper:
                setattr(owner, name, original)
        self._made.clear()


__all__ = ["MARK", "Patches", "marked"]
