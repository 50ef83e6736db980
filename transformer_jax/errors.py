"""The project's error type for user mistakes.

``UserError`` is raised for everything a user can fix: a bad config value, flag, input
shape or token id, a workdir or file that is missing, corrupt or of the wrong kind. Its
message names the problem and what to do about it. The CLI prints it as one ``error:``
line (exit status 2); any other exception is a bug and shows its traceback.

It subclasses ``ValueError``, so code that caught ``ValueError`` keeps working.
"""
from __future__ import annotations


class UserError(ValueError):
    """A mistake in what was asked (config, flags, inputs, files); the message says how to fix it."""
