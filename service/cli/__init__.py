"""``lmhead`` command line: serve, demo, import, quantize, trim, inspect, retie, compare, lens,
health.

Every command takes the repository and port from ``LMHEAD_REPOSITORY`` and ``LMHEAD_PORT``
when not given (so ``demo`` and ``import`` write where ``serve`` serves); ``serve`` reads every
other ``LMHEAD_*`` setting too.

Layer: the top one. It may import every layer below (``service.hosting``, ``service.api``,
``service.tools``, ...), the client and the shared basics; nothing imports it but
``python -m service`` (``make layers`` checks the order). Commands import what they need when
they run, so ``lmhead --help`` loads no onnxruntime.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence
from importlib import import_module

from pydantic import ValidationError

from service.cli.arguments import CommandError, UsageError, settings_message
from service.cli.parser import build_parser
from service.settings import PlaceSettings


def main(argv: Sequence[str] | None = None) -> int:
    """Commands (and onnx, onnxruntime, safetensors) are imported once one is chosen: every
    front process of ``LMHEAD_WORKERS`` imports this module again (multiprocessing's spawn
    runs the ``lmhead`` script), and a front holds no head."""
    try:
        parser = build_parser(_place())
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        if args.command != "serve" and getattr(args, "repository", "") is None:
            PlaceSettings()  # no flag, and LMHEAD_REPOSITORY or LMHEAD_PORT invalid: says why
        return int(getattr(import_module("service.cli.commands"), args.handler)(args))
    except BrokenPipeError:  # `lmhead ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (Exception, KeyboardInterrupt) as error:  # one line; the traceback only when asked
        known = _known_failure(error)
        if os.environ.get("LMHEAD_DEBUG") and not isinstance(error, UsageError | ValidationError):
            raise
        message, status = known or (
            f"{type(error).__name__}: {error} (LMHEAD_DEBUG=1 shows where)",
            1,
        )
        print(f"lmhead: {message}", file=sys.stderr)
        return status


def _known_failure(error: BaseException) -> tuple[str, int] | None:
    """The line and exit status of an error whose message is the whole story: 2 for input the
    command refuses (options, settings, checkpoints, heads), 1 for a failure, 130 for
    Ctrl-C (nothing half-written is published); None for anything else (a bug)."""
    if isinstance(error, (UsageError, ValidationError, *_reported())):
        if isinstance(error, ValidationError):
            return f"invalid settings: {settings_message(error)}", 2
        return str(error), 2
    if isinstance(error, CommandError):
        return str(error), 1
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
        return _os_error(error), 1  # the machine's state, not a bug: no space, permissions
    return None


#: OSErrors that say what is wrong with the machine or the paths given (anything else: a bug).
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.EEXIST,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOTEMPTY,
        errno.EMFILE,
        errno.ENAMETOOLONG,
    }
)


def _os_error(error: OSError) -> str:
    """``No space left on device: /repo/m/.writing-x/model.onnx.data`` (the path is the story)."""
    paths = [str(name)[:200] for name in (error.filename, error.filename2) if name is not None]
    return f"{error.strerror}: {' -> '.join(paths)}" if paths else str(error.strerror)


def _reported() -> tuple[type[Exception], ...]:
    """Errors whose message is the whole story (a head or checkpoint that cannot be read)."""
    from service.heads.inspector import HeadInspectionError
    from service.tools.checkpoints import CheckpointError

    return (HeadInspectionError, CheckpointError)


def _place() -> PlaceSettings | None:
    """The environment's repository and port for the flags' defaults; None when it is
    invalid, so that ``--version``, ``--help`` and a flag that overrides it still work (a
    command that uses the invalid value reports it)."""
    try:
        return PlaceSettings()
    except ValidationError:
        return None
