"""``lmhead`` command line: serve, demo, import, quantize, trim, inspect, retie, compare, health.

Every command takes the repository and port from ``LMHEAD_REPOSITORY`` and ``LMHEAD_PORT``
when not given (so ``demo`` and ``import`` write where ``serve`` serves); ``serve`` reads every
other ``LMHEAD_*`` setting too.

Layer: the top one. It may import every layer below (``service.hosting``, ``service.api``,
``service.tools``, ...), the client and the shared basics; nothing imports it but
``python -m service`` (``make layers`` checks the order). Commands import what they need when
they run, so ``lmhead --help`` loads no onnxruntime.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path

from pydantic import ValidationError

from service import __version__
from service.cli.arguments import (
    CommandError,
    UsageError,
    model_name,
    non_negative,
    positive,
    repository_path,
    settings_message,
)
from service.heads.quantize import DEFAULT_BLOCK_SIZE
from service.settings import PlaceSettings, Settings
from service.tools.demo import DemoSpec


def main(argv: Sequence[str] | None = None) -> int:
    """Commands (and onnx, onnxruntime, safetensors) are imported once one is chosen: every
    front process of ``LMHEAD_WORKERS`` imports this module again (multiprocessing's spawn
    runs the ``lmhead`` script), and a front holds no head."""
    try:
        parser = _parser(_place())
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


def _parser(valid: PlaceSettings | None) -> argparse.ArgumentParser:
    place = valid or PlaceSettings.model_construct()
    parser = argparse.ArgumentParser(prog="lmhead", description="Serve language-model heads.")
    parser.add_argument("--version", action="version", version=f"lmhead {__version__}")
    subcommands = parser.add_subparsers(dest="command")

    def repository(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--repository",
            type=repository_path,
            # A string default is checked by the type, too; None: the environment is invalid.
            default=None if valid is None else str(place.repository),
            help=f"model repository (default: LMHEAD_REPOSITORY, now {place.repository})",
        )

    def dtype(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--dtype",
            choices=("float32", "float16", "bfloat16"),
            default="float32",
            help="stored dtype of the matrices (half: half the bytes; CUDA runs them natively)",
        )

    def quantization(command: argparse.ArgumentParser, required: bool) -> None:
        command.add_argument(
            "--quantize",
            choices=("int8", "int4"),
            required=required,
            help="block-quantize the output matrix (the one matrix when tied)",
        )
        command.add_argument(
            "--block-size",
            type=positive,
            help=f"values per scale (default: {DEFAULT_BLOCK_SIZE[8]} for int8, "
            f"{DEFAULT_BLOCK_SIZE[4]} for int4)",
        )
        command.add_argument(
            "--quantize-table", action="store_true", help="untied heads: the table too"
        )

    def url(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--url",
            default=None if valid is None else f"http://127.0.0.1:{place.port}",
            help="the running service (default: this machine on LMHEAD_PORT)",
        )

    demo = subcommands.add_parser("demo", help="write the demo tied and untied heads")
    repository(demo)
    demo.add_argument("--vocab-size", type=positive, default=DemoSpec.vocab_size)
    demo.add_argument("--d-model", type=positive, default=DemoSpec.d_model)
    demo.add_argument("--seed", type=non_negative, default=DemoSpec.seed)
    demo.add_argument("--force", action="store_true", help="rewrite models that exist")
    dtype(demo)
    demo.set_defaults(handler="demo")

    serve = subcommands.add_parser(
        "serve",
        help="serve the model repository over HTTP",
        epilog="Every other setting is an environment variable: "
        + ", ".join(f"LMHEAD_{name.upper()}" for name in Settings.model_fields)
        + " (see the README's configuration table).",
    )
    serve.add_argument("--repository", type=Path, help="overrides LMHEAD_REPOSITORY")
    serve.add_argument("--host", help="overrides LMHEAD_HOST")
    serve.add_argument("--port", type=int, help="overrides LMHEAD_PORT")
    serve.add_argument(
        "--grpc-port", type=int, help="also serve V2 over gRPC here (overrides LMHEAD_GRPC_PORT)"
    )
    serve.add_argument(
        "--model-name", help="serve only this model (overrides LMHEAD_MODEL_NAME; KServe's name)"
    )
    serve.add_argument(
        "--ray", action="store_true", help="run as a Ray Serve application (the ray extra)"
    )
    serve.add_argument("--replicas", type=int, help="with --ray: fixed replicas (default 1)")
    serve.add_argument(
        "--max-models",
        type=int,
        default=0,
        help="with --ray: load models on request, at most this many per replica (multiplexing)",
    )
    serve.set_defaults(handler="serve")

    importer = subcommands.add_parser("import", help="make a head from a HF safetensors checkpoint")
    importer.add_argument("checkpoint", type=Path, help="directory with config.json, *.safetensors")
    importer.add_argument("--name", type=model_name, required=True, help="model name to write")
    repository(importer)
    importer.add_argument("--version", type=positive, help="default: the next free version")
    importer.add_argument("--embedding-tensor", help="override the input embedding tensor name")
    importer.add_argument("--head-tensor", help="override the output head tensor name")
    tying = importer.add_mutually_exclusive_group()
    tying.add_argument("--tie", action="store_true", help="force one shared matrix")
    tying.add_argument("--untie", action="store_true", help="separate copy of W for the head")
    importer.add_argument("--external-data", action="store_true", help="weights in model.onnx.data")
    dtype(importer)
    quantization(importer, required=False)
    importer.set_defaults(handler="import_head")

    quantize = subcommands.add_parser(
        "quantize", help="write a block-quantized copy of a head as a new version"
    )
    quantize.add_argument("model", type=model_name, help="model name in the repository")
    repository(quantize)
    quantize.add_argument("--version", type=positive, help="version to read (default: the newest)")
    quantize.add_argument("--to-version", type=positive, help="default: the next free version")
    quantization(quantize, required=True)
    quantize.set_defaults(handler="quantize")

    trimming = subcommands.add_parser(
        "trim", help="write a head that keeps only some tokens (answers in original ids)"
    )
    trimming.add_argument("model", type=model_name, help="model name in the repository")
    trimming.add_argument("--keep", required=True, help="ids: FILE (.npy or text) or 0-31999,7")
    trimming.add_argument("--name", type=model_name, required=True, help="name of the trimmed head")
    repository(trimming)
    trimming.add_argument("--version", type=positive, help="version to read (default: the newest)")
    trimming.add_argument("--to-version", type=positive, help="default: the next free version")
    trimming.set_defaults(handler="trim")

    versus = subcommands.add_parser(
        "compare", help="contrast two served heads on your hidden states"
    )
    versus.add_argument("model_a")
    versus.add_argument("model_b")
    versus.add_argument("--hidden", type=Path, required=True, help=".npy of (rows, d_model)")
    versus.add_argument("--targets", type=Path, help=".npy of the real next token ids")
    versus.add_argument("--k", type=positive, default=10)
    url(versus)
    repository(versus)
    versus.add_argument("--json", action="store_true")
    versus.set_defaults(handler="compare")

    repair = subcommands.add_parser("retie", help="repair a duplicated tied weight")
    repair.add_argument("path", type=Path, help="model.onnx or a version directory")
    where = repair.add_mutually_exclusive_group()
    where.add_argument("-o", "--output", type=Path, help="write the repaired model here")
    where.add_argument("--in-place", action="store_true", help="rewrite the model itself")
    repair.set_defaults(handler="retie_head")

    health = subcommands.add_parser("health", help="exit 0 when the service is ready")
    url(health)
    health.set_defaults(handler="health")

    inspect = subcommands.add_parser("inspect", help="report how an ONNX head's weights are wired")
    inspect.add_argument("path", type=Path, help="model.onnx or a version directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler="inspect")
    return parser
