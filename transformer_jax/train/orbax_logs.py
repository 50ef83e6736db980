"""Which of orbax's log records a user sees.

Orbax logs through absl, and its background coroutines through asyncio. Two kinds say
nothing a user acts on, and are hidden with one filter (:class:`HideRecords`):

* the "Given directory is read only" notice of every read-only checkpoint manager
  (reading a run's checkpoints read-only is deliberate: eval, generate, the resume check),
  hidden as soon as ``train/checkpoint.py`` is imported (:func:`hide_read_only_notices`);
* orbax's ERROR records of a failed checkpoint write or read, with their tracebacks, and
  asyncio's "Task exception was never retrieved" for the sibling reads or writes that
  failed with it: the CLI reports the failure once, as an ``error:`` or ``warning:`` line,
  and hides these (:func:`hide_orbax_errors`). Orbax's warnings still show.
"""
from __future__ import annotations

import logging
from typing import Callable


class HideRecords(logging.Filter):
    """A logging filter that drops the records ``hide(record)`` is true for."""

    def __init__(self, hide: Callable[[logging.LogRecord], bool]):
        super().__init__()
        self.hide = hide

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.hide(record)


def is_read_only_notice(record: logging.LogRecord) -> bool:
    return "Given directory is read only" in record.getMessage()


def is_orbax_error(record: logging.LogRecord) -> bool:
    """An ERROR (or worse) record from orbax's code, or one whose message names orbax."""
    return record.levelno >= logging.ERROR and (
        "orbax" in record.pathname or "orbax" in record.getMessage())


def hide_read_only_notices() -> None:
    logging.getLogger("absl").addFilter(HideRecords(is_read_only_notice))


def hide_orbax_errors() -> None:
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(HideRecords(is_orbax_error))
