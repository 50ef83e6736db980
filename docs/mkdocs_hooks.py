"""MkDocs hooks (mkdocs.yml ``hooks:``): keep ``--strict`` strict about references, not prose.

The docstrings are prose with command-line usage (``[--workdir DIR] [--steps N]``), token
names (``[CLS] [SEP]``) and matrices (``[1 0 0]``). Markdown reads two bracketed spans in a
row as a reference link, so mkdocs-autorefs warns that it found no object named
``--steps N``, and ``--strict`` would fail the build on text that is not a reference at all.
This filter drops exactly those warnings: the ones whose target is not a dotted Python path.
An unresolved dotted path (``transformer_jax.train.loop.train``: an object that moved or was
renamed) still warns, and so still fails the strict build.
"""
import logging
import re

UNRESOLVED = re.compile(r"Could not find cross-reference target '(?P<target>.*)'$")
DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


class NotAReference(logging.Filter):
    """Drops autorefs' 'Could not find cross-reference target' for targets that are no path."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = UNRESOLVED.search(record.getMessage())
        return match is None or bool(DOTTED_PATH.match(match["target"]))


def on_startup(command, dirty) -> None:
    """Installs the filter on autorefs' logger once per build."""
    logger = logging.getLogger("mkdocs.plugins.mkdocs_autorefs._internal.plugin")
    if not any(isinstance(f, NotAReference) for f in logger.filters):
        logger.addFilter(NotAReference())
