"""A griffe extension (mkdocs.yml, mkdocstrings ``extensions:``): the docstrings' Sphinx roles
as code.

The docstrings cite objects Sphinx-style (``:func:`~transformer_jax.train.loop.train```),
which Markdown would show with the role and the tilde. This writes each as inline code
(``train``; the full path where there is no ``~``) before mkdocstrings renders the page.
Whether the cited objects exist is checked by ``tests/test_docs.py``.
"""
import re

import griffe

ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRolesAsCode(griffe.Extension):
    """Rewrites ``:role:`target``` as inline code in every docstring griffe loads."""

    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_as_code, obj.docstring.value)
