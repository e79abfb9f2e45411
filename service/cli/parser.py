"""The ``lmhead`` parser: each command with its one-line summary, each option with a help text
that names its default.

A summary is shown twice, in ``lmhead --help`` and as the command's own description in
``lmhead COMMAND --help``, so it is written once here. Defaults are written into the help by
hand rather than by ``ArgumentDefaultsHelpFormatter``: many are ``None`` that mean "the
environment" or "the newest version", which that formatter would print as ``None``.

``--version`` means one thing in every command: the version to read. A command that writes a
version takes ``--to-version``; ``import --version`` is its old, deprecated spelling.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service import __version__
from service.cli.arguments import model_name, non_negative, positive, repository_path
from service.heads.quantize import DEFAULT_BLOCK_SIZE
from service.settings import PlaceSettings, Settings
from service.tools.demo import DemoSpec
from service.tools.demo_checkpoints import CheckpointSpec

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]

DTYPES = ("float32", "float16", "bfloat16")
#: The stored dtype when ``--dtype`` is not given (its parsed value is then None).
DEFAULT_DTYPE = "float32"
NEXT_VERSION = "version to write (default: the next free version)"
READ_VERSION = "version to read (default: the newest)"


def build_parser(valid: PlaceSettings | None) -> argparse.ArgumentParser:
    """``valid``: the environment's repository and port, None when they are invalid (then the
    flags default to None and a command that needs them reports the environment)."""
    parser = argparse.ArgumentParser(prog="lmhead", description="Serve language-model heads.")
    parser.add_argument(
        "--version", action="version", version=f"lmhead {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    shared = _Shared(valid)
    for add in (
        _demo,
        _serve,
        _import,
        _quantize,
        _trim,
        _compare,
        _lens,
        _retie,
        _health,
        _inspect,
    ):
        add(commands, shared)
    return parser


def _command(commands: Commands, name: str, summary: str, **extra: Any) -> argparse.ArgumentParser:
    """A command whose summary is both its line in ``lmhead --help`` and its description."""
    return commands.add_parser(name, help=summary, description=summary, **extra)


class _Shared:
    """Options several commands take, worded once."""

    def __init__(self, valid: PlaceSettings | None) -> None:
        self.valid = valid
        self.place = valid or PlaceSettings.model_construct()

    def repository_help(self) -> str:
        return f"the model repository (default: LMHEAD_REPOSITORY, now {self.place.repository})"

    def repository(self, command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--repository",
            type=repository_path,
            # A string default is checked by the type, too; None: the environment is invalid.
            default=None if self.valid is None else str(self.place.repository),
            help=self.repository_help(),
        )

    def dtype(self, command: argparse.ArgumentParser, extra: str = "") -> None:
        command.add_argument(
            "--dtype",
            choices=DTYPES,
            help=f"stored dtype of the matrices (default: {DEFAULT_DTYPE}{extra}): half "
            "precision takes half the bytes, and CUDA runs it natively",
        )

    def quantization(self, command: argparse.ArgumentParser, required: bool) -> None:
        command.add_argument(
            "--quantize",
            choices=("int8", "int4"),
            required=required,
            help="block-quantize the output matrix, the one matrix when tied"
            + ("" if required else " (default: not quantized)"),
        )
        sizes = {DEFAULT_BLOCK_SIZE[8], DEFAULT_BLOCK_SIZE[4]}
        default = (
            f"{DEFAULT_BLOCK_SIZE[8]}"
            if len(sizes) == 1
            else f"{DEFAULT_BLOCK_SIZE[8]} for int8, {DEFAULT_BLOCK_SIZE[4]} for int4"
        )
        command.add_argument(
            "--block-size", type=positive, help=f"values per scale (default: {default})"
        )
        command.add_argument(
            "--quantize-table", action="store_true", help="untied heads: quantize the table too"
        )

    def url(self, command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--url",
            default=None if self.valid is None else f"http://127.0.0.1:{self.place.port}",
            help=f"the running service (default: this machine on LMHEAD_PORT, now "
            f"http://127.0.0.1:{self.place.port})",
        )


def _demo(commands: Commands, shared: _Shared) -> None:
    demo = _command(
        commands,
        "demo",
        "write the demo heads, or checkpoints to import (--checkpoint)",
    )
    demo.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="write Hugging Face style checkpoints (gpt2-tiny, tied; llama-tiny, untied) into "
        "DIR instead of heads into the repository, for `lmhead import` to read",
    )
    shared.repository(demo)
    heads, small = DemoSpec(), CheckpointSpec()
    demo.add_argument(
        "--vocab-size",
        type=positive,
        help=f"tokens (default: {heads.vocab_size}; {small.vocab_size} with --checkpoint)",
    )
    demo.add_argument(
        "--d-model",
        type=positive,
        help=f"width of the hidden states (default: {heads.d_model}; {small.d_model} with "
        "--checkpoint)",
    )
    demo.add_argument(
        "--seed",
        type=non_negative,
        default=heads.seed,
        help=f"random seed: one seed, the same files on every machine (default: {heads.seed})",
    )
    demo.add_argument("--force", action="store_true", help="rewrite what exists")
    shared.dtype(demo, extra="; not with --checkpoint")
    demo.set_defaults(handler="demo")


def _serve(commands: Commands, shared: _Shared) -> None:
    serve = _command(
        commands,
        "serve",
        "serve the model repository over HTTP (and gRPC)",
        epilog="Every other setting is an environment variable: "
        + ", ".join(f"LMHEAD_{name.upper()}" for name in Settings.model_fields)
        + " (docs/settings.md describes each).",
    )
    # Not checked here: Settings reads LMHEAD_REPOSITORY itself and says what is wrong with it.
    serve.add_argument("--repository", type=Path, help=shared.repository_help())
    serve.add_argument("--host", help=_setting("host", "address to listen on"))
    serve.add_argument(
        "--port", type=int, help=f"HTTP port (default: LMHEAD_PORT, now {shared.place.port})"
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        help="also serve V2 over gRPC on this port (default: LMHEAD_GRPC_PORT; unset: no gRPC)",
    )
    serve.add_argument(
        "--model-name",
        help="serve only this model, KServe's name (default: LMHEAD_MODEL_NAME; unset: every "
        "model)",
    )
    serve.add_argument(
        "--ray", action="store_true", help="run as a Ray Serve application (the ray extra)"
    )
    serve.add_argument(
        "--replicas", type=int, help="with --ray: a fixed number of replicas (default: 1)"
    )
    serve.add_argument(
        "--max-models",
        type=int,
        default=0,
        help="with --ray: load models on request, at most this many per replica, i.e. "
        "multiplexing (default: 0, every model loaded by every replica)",
    )
    serve.set_defaults(handler="serve")


def _setting(name: str, what: str) -> str:
    """Help for a flag that overrides a setting: its variable and built-in default."""
    default = Settings.model_fields[name].default
    return f"{what} (default: LMHEAD_{name.upper()}, else {default})"


def _import(commands: Commands, shared: _Shared) -> None:
    importer = _command(
        commands, "import", "make a head from a Hugging Face safetensors checkpoint"
    )
    importer.add_argument(
        "checkpoint", type=Path, help="directory with config.json and *.safetensors"
    )
    importer.add_argument("--name", type=model_name, required=True, help="model name to write")
    shared.repository(importer)
    importer.add_argument("--to-version", type=positive, metavar="N", help=NEXT_VERSION)
    importer.add_argument(
        "--version",
        type=positive,
        metavar="N",
        dest="deprecated_version",
        help="deprecated spelling of --to-version (--version will name the version to read, "
        "as in every other command)",
    )
    importer.add_argument(
        "--embedding-tensor", help="input embedding tensor (default: found by its usual names)"
    )
    importer.add_argument(
        "--head-tensor", help="output head tensor (default: found by its usual names)"
    )
    tying = importer.add_mutually_exclusive_group()
    tying.add_argument("--tie", action="store_true", help="force one shared matrix")
    tying.add_argument("--untie", action="store_true", help="separate copy of W for the head")
    importer.add_argument(
        "--no-norm",
        action="store_true",
        help="leave the model's final norm out: the head then refuses residual states",
    )
    importer.add_argument(
        "--external-data",
        action="store_true",
        help="weights in model.onnx.data (default: only for heads over 256 MiB)",
    )
    shared.dtype(importer, extra=", whatever the checkpoint stores")
    shared.quantization(importer, required=False)
    importer.set_defaults(handler="import_head")


def _quantize(commands: Commands, shared: _Shared) -> None:
    quantize = _command(
        commands, "quantize", "write a block-quantized copy of a head as a new version"
    )
    quantize.add_argument("model", type=model_name, help="model name in the repository")
    shared.repository(quantize)
    quantize.add_argument("--version", type=positive, metavar="N", help=READ_VERSION)
    quantize.add_argument("--to-version", type=positive, metavar="N", help=NEXT_VERSION)
    shared.quantization(quantize, required=True)
    quantize.set_defaults(handler="quantize")


def _trim(commands: Commands, shared: _Shared) -> None:
    trimming = _command(
        commands, "trim", "keep only some tokens in a new head (answers in original ids)"
    )
    trimming.add_argument("model", type=model_name, help="model name in the repository")
    trimming.add_argument("--keep", required=True, help="ids: FILE (.npy or text) or 0-31999,7")
    trimming.add_argument("--name", type=model_name, required=True, help="name of the trimmed head")
    shared.repository(trimming)
    trimming.add_argument("--version", type=positive, metavar="N", help=READ_VERSION)
    trimming.add_argument("--to-version", type=positive, metavar="N", help=NEXT_VERSION)
    trimming.set_defaults(handler="trim")


def _compare(commands: Commands, shared: _Shared) -> None:
    versus = _command(commands, "compare", "contrast two served heads on your hidden states")
    versus.add_argument("model_a", help="the first served model's name")
    versus.add_argument("model_b", help="the second served model's name")
    versus.add_argument("--hidden", type=Path, required=True, help=".npy of (rows, d_model)")
    versus.add_argument(
        "--targets",
        type=Path,
        help=".npy of the real next token ids, to score both heads on (default: none)",
    )
    versus.add_argument(
        "--k", type=positive, default=10, help="top-k compared per row (default: 10)"
    )
    shared.url(versus)
    shared.repository(versus)
    versus.add_argument("--json", action="store_true", help="print one JSON object")
    versus.set_defaults(handler="compare")


def _lens(commands: Commands, shared: _Shared) -> None:
    lens = _command(
        commands, "lens", "read every layer's hidden states through a served head (logit lens)"
    )
    lens.add_argument("model", help="the served model's name")
    lens.add_argument(
        "--hidden",
        type=Path,
        required=True,
        metavar="NPY",
        help=".npy of (layers, tokens, d_model): every layer's hidden states, as "
        "transformers' output_hidden_states gives them (embeddings first)",
    )
    lens.add_argument(
        "--targets",
        type=Path,
        metavar="NPY",
        help=".npy of the real next token ids, one per position: their rank per layer "
        "(default: none)",
    )
    lens.add_argument(
        "--k",
        type=positive,
        help="top tokens per layer and position in the answer; the table shows the first "
        "(default: the model's default k)",
    )
    lens.add_argument(
        "--states",
        choices=("residual", "final"),
        default="residual",
        help="residual: every layer read through the head's final norm first (heads that hold "
        "one); final: the states are post-norm already (default: residual)",
    )
    lens.add_argument(
        "--last-layer",
        choices=("final", "residual"),
        default="final",
        help="the last layer's states: final, post-norm already, as output_hidden_states gives "
        "them; residual, normed like the others (default: final)",
    )
    lens.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="also draw the picture, layers x positions, each cell its top token coloured by "
        "its probability; needs matplotlib: pip install '.[plot]' (default: no picture)",
    )
    lens.add_argument(
        "--version",
        type=positive,
        metavar="N",
        help="served version to read (default: the one the service serves)",
    )
    shared.url(lens)
    lens.add_argument("--json", action="store_true", help="print the answer as one JSON object")
    lens.set_defaults(handler="lens")


def _retie(commands: Commands, shared: _Shared) -> None:
    repair = _command(commands, "retie", "repair a duplicated tied weight")
    repair.add_argument("path", type=Path, help="model.onnx or a version directory")
    where = repair.add_mutually_exclusive_group()
    where.add_argument("-o", "--output", type=Path, help="write the repaired model here")
    where.add_argument("--in-place", action="store_true", help="rewrite the model itself")
    repair.set_defaults(handler="retie_head")


def _health(commands: Commands, shared: _Shared) -> None:
    health = _command(commands, "health", "exit 0 when the service is ready")
    shared.url(health)
    health.set_defaults(handler="health")


def _inspect(commands: Commands, shared: _Shared) -> None:
    inspect = _command(commands, "inspect", "report how an ONNX head's weights are wired")
    inspect.add_argument("path", type=Path, help="model.onnx or a version directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler="inspect")
