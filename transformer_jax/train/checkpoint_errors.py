"""How a checkpoint fails: the errors a user sees, and which file of a step broke a restore.

:class:`CheckpointWriteError`: a save could not be written (a full or read-only disk; the
OS reason is dug out of orbax's wrapped errors by :func:`os_reason`).
:class:`UnreadableCheckpoint`: no step reads. :func:`describe_unreadable` names the broken
file of a step (a JSON file that is missing or does not parse, an array tensorstore cannot
read), and says None when nothing is broken (a mismatch, not corruption). Used by
``train/checkpoint.py``.
"""
from __future__ import annotations

import json
import os
import re

from etils import epath

from .. import storage
from ..errors import UserError


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, read-only, no permission); the previous
    checkpoints are intact."""


class UnreadableCheckpoint(UserError):
    """Every candidate checkpoint failed to read; the message names each step and its file."""


# Files of a step that are JSON: a missing or unparsable one is a broken checkpoint.
_JSON_FILES = ("config/metadata", "data/metadata", "state/_METADATA", "state/_sharding")
_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_READING = re.compile(r'Error reading "([^"/]+)[^"]*" in OCDBT')


def _json_problem(p: epath.Path) -> str | None:
    if not p.exists():
        return "missing"
    try:
        json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"not valid JSON ({e})"
    return None


def describe_unreadable(step_dir: os.PathLike | str, exc: BaseException) -> str | None:
    """Which file of the checkpoint ``step_dir`` broke ``exc`` (a failed restore), as
    ``"<file>: <reason>"``; None when nothing points at a broken file (the failure is then
    a mismatch or a bug, not corruption, and the checkpoint must not be moved aside)."""
    step_dir = storage.path(step_dir)
    files = list(_JSON_FILES)
    meta = step_dir / "state" / "array_metadatas"
    if meta.is_dir():
        files += [f"state/array_metadatas/{p.name}" for p in meta.iterdir()]
    for name in files:
        if name == "state/_sharding" and not (step_dir / "state").is_dir():
            continue
        problem = _json_problem(step_dir / name)
        if problem is not None:
            return f"{name}: {problem}"
    chain, seen = [], exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        text = str(e)
        match = _READING.search(text)
        if match:
            reason = text.rsplit(": ", 1)[-1].strip()
            return f"state/ (the array {match.group(1)}): {reason[:160]}"
        if isinstance(e, (FileNotFoundError, json.JSONDecodeError)) or "DATA_LOSS" in text:
            filename = getattr(e, "filename", None)
            return f"{filename or 'a file'}: {text.splitlines()[0][:160]}"
    return None


def os_reason(exc: BaseException) -> str:
    """The OS error inside a failed write (orbax/tensorstore wrap it in text), e.g.
    "No space left on device"."""
    seen, depth = exc, 0
    while seen is not None and depth < 8:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        match = _OS_ERROR.search(str(seen))
        if match:
            return os.strerror(int(match.group(1)))
        seen, depth = seen.__cause__ or seen.__context__, depth + 1
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
