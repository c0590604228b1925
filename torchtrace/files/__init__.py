"""Run-directory files: strict JSON, atomic writes, mode 0600, size caps, no symlinks followed.

Every file torchtrace opens for writing is opened with ``O_NOFOLLOW`` (a symlink planted at
its name is refused, never written through) and created with mode 0600. The run directory is
0700: an existing one with looser permissions is tightened, with a warning, and one that is a
symlink or belongs to another user is refused. :func:`claim_file` gives a second process with
the same run id its own file names instead of letting both write the same files.

The code lives in four modules, re-exported here: :mod:`torchtrace.files.strict_json` (strict JSON
text), :mod:`torchtrace.files.private` (directories, atomic whole files),
:mod:`torchtrace.files.claims` (one writer per file name) and :mod:`torchtrace.files.json_lines`
(the capped JSON-lines file).
"""

from __future__ import annotations

from torchtrace.files.claims import claim_file, release_file
from torchtrace.files.json_lines import JsonLinesFile, read_json_lines
from torchtrace.files.private import (
    O_CLOEXEC,
    O_NOFOLLOW,
    ensure_parent_dir,
    ensure_private_dir,
    open_private,
    write_bytes_atomic,
    write_json_atomic,
)
from torchtrace.files.strict_json import dumps, from_strict, to_strict

__all__ = [
    "O_CLOEXEC", "O_NOFOLLOW", "JsonLinesFile", "claim_file", "dumps", "ensure_parent_dir", "ensure_private_dir",
    "from_strict", "open_private", "read_json_lines", "release_file", "to_strict", "write_bytes_atomic",
    "write_json_atomic",
]
