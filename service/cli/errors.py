"""The one error a command raises on purpose: printed as ``lmhead: message``, exit 1."""


class CommandError(Exception):
    """A command could not do its job for a reason the user can act on (no traceback)."""
