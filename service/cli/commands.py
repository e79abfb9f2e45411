"""The ``lmhead`` commands' work; ``service.cli`` parses the arguments and reports errors."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.cli.arguments import CommandError, UsageError, settings_message
from service.cli.parser import DEFAULT_DTYPE
from service.digits import decimal
from service.heads import MODEL_FILE
from service.heads.graph import FORMAT
from service.heads.inspector import HeadReport, inspect_head
from service.heads.quantize import QuantSpec
from service.tools.demo import TIED_NAME, UNTIED_NAME, DemoSpec, write_demo_models
from service.tools.importer import ImportOptions, import_checkpoint, quantize_version
from service.tools.retie import retie
from service.tools.trim import trim_version


def demo(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        return _demo_checkpoints(args)
    repository: Path = args.repository
    dtype = args.dtype or DEFAULT_DTYPE
    existing = [repository / name / "1" / MODEL_FILE for name in (TIED_NAME, UNTIED_NAME)]
    current = all(_current_demo(path, dtype) for path in existing)
    if current and not args.force:
        print(f"demo models already in {repository} (use --force to rewrite)")
        return 0
    heads = DemoSpec()
    spec = DemoSpec(
        args.vocab_size or heads.vocab_size, args.d_model or heads.d_model, args.seed, dtype
    )
    for version_dir in write_demo_models(repository, spec):
        print(f"wrote {version_dir}")
    return 0


def _current_demo(path: Path, dtype: str) -> bool:
    """A demo head as this version writes it: its format, dtype and final norm (heads written
    before the norm was kept are written again, so residual states and the lens work)."""
    if not path.is_file():
        return False
    report = inspect_head(path)
    return report.format == FORMAT and report.dtype == dtype and report.final_norm is not None


def _demo_checkpoints(args: argparse.Namespace) -> int:
    """``demo --checkpoint DIR``: the checkpoints only (nothing in the repository), then the
    imports that make heads of them."""
    from service.tools import demo_checkpoints as made

    if args.dtype is not None:
        raise UsageError(
            "--dtype is for the demo heads: the checkpoints keep their models' dtypes "
            "(gpt2-tiny float32, llama-tiny float16; `lmhead import --dtype` chooses the head's)"
        )
    small = made.CheckpointSpec()
    try:
        spec = made.CheckpointSpec(
            args.vocab_size or small.vocab_size, args.d_model or small.d_model, args.seed
        )
    except ValueError as error:
        raise UsageError(f"--vocab-size: {error}") from None
    written = made.write_demo_checkpoints(args.checkpoint, spec, replace=args.force)
    for checkpoint in written:
        print(f"wrote {checkpoint.directory}: {checkpoint.summary}, {checkpoint.bytes:,} bytes")
    print("make heads of them in the repository with:")
    for checkpoint in written:
        path, name = shlex.quote(str(checkpoint.directory)), checkpoint.directory.name
        print(f"  lmhead import {path} --name {name}")
    return 0


def serve(args: argparse.Namespace) -> int:
    from service.hosting import server
    from service.settings import Settings, unknown_environment

    flags = {
        "repository": args.repository,
        "host": args.host,
        "port": args.port,
        "grpc_port": args.grpc_port,
        "model_name": args.model_name,
    }
    settings = Settings(**{key: value for key, value in flags.items() if value is not None})
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in unknown_environment(os.environ):  # a typo'd LMHEAD_ADMIN_TOKEN leaves it open
        logging.getLogger("lmhead").warning("%s is no lmhead setting: it is ignored", name[:64])
    if args.ray:
        if settings.grpc_port is not None:  # every replica would bind it; Serve proxies HTTP
            raise UsageError("gRPC is served by single lmhead processes, not under --ray")
        if settings.workers > 1:  # each replica is one process; Serve scales by replicas
            raise UsageError("LMHEAD_WORKERS applies without --ray (use --replicas under Ray)")
        try:
            from service.hosting import rayserve
        except ImportError as error:
            raise CommandError(
                f"--ray needs the ray extra (pip install '.[ray]'): {error}"
            ) from None
        rayserve.run(settings, args.replicas, args.max_models)
        return 0
    if args.replicas is not None or args.max_models:
        raise UsageError("--replicas and --max-models go with --ray")
    if not settings.load_at_start and settings.control_mode == "none":
        raise UsageError(
            "LMHEAD_LOAD_AT_START=false with LMHEAD_CONTROL_MODE=none: no model could ever load "
            "(load them at start, or allow the control API)"
        )
    if not settings.repository.is_dir() and not settings.create_demo_models:
        raise UsageError(
            f"the repository {str(settings.repository)[:200]} (LMHEAD_REPOSITORY or --repository) "
            "is not a directory; make it, or set LMHEAD_CREATE_DEMO_MODELS=true"
        )
    if settings.workers > 1:
        from service.hosting.split.supervisor import supervise

        return supervise(settings)
    server.run(settings)
    return 0


def import_head(args: argparse.Namespace) -> int:
    options = ImportOptions(
        to_version=_to_version(args),
        embedding_tensor=args.embedding_tensor,
        head_tensor=args.head_tensor,
        tie=args.tie,
        untie=args.untie,
        external_data=True if args.external_data else None,
        dtype=args.dtype or DEFAULT_DTYPE,
        quantization=_spec(args),
        quantize_table=args.quantize_table,
        no_norm=args.no_norm,
    )
    result = import_checkpoint(args.checkpoint, args.repository, args.name, options)
    kind = "tied" if result.tied else "untied"
    print(f"wrote {result.directory}: {kind} head, {result.vocab_size} x {result.d_model}")
    if result.final_norm is not None:
        print(f"  final norm: {result.final_norm}")
    for note in result.notes:
        print(f"  note: {note}")
    halves = [dtype for dtype in result.checkpoint_dtypes if dtype != DEFAULT_DTYPE]
    if halves and args.dtype is None and options.quantization is None:
        stored = " and ".join(halves)
        _say(
            f"note: the checkpoint stores {stored}; the head is stored as {DEFAULT_DTYPE} (2x "
            f"its bytes, exact on every provider); --dtype {halves[0]} keeps half precision"
        )
    return 0


def _to_version(args: argparse.Namespace) -> int | None:
    """``--to-version``, or the old ``--version`` of import (which will name the version to
    read, as in quantize and trim): still written, with a note on stderr."""
    old: int | None = args.deprecated_version
    new: int | None = args.to_version
    if old is None:
        return new
    _say(
        "--version of import is deprecated: use --to-version (it will name the version to "
        "read, as everywhere else)"
    )
    if new is not None and new != old:
        raise UsageError(f"--version {old} and --to-version {new} disagree")
    return old


def _say(message: str) -> None:
    """A line for the user beside the command's output (stderr: scripts read stdout)."""
    print(f"lmhead: {message}", file=sys.stderr)


def _spec(args: argparse.Namespace) -> QuantSpec | None:
    if args.quantize is None:
        if args.block_size is not None or args.quantize_table:
            raise UsageError("--block-size and --quantize-table need --quantize int8|int4")
        return None
    try:
        return QuantSpec.parse(args.quantize, args.block_size)
    except ValueError as error:
        raise UsageError(str(error)) from None


def quantize(args: argparse.Namespace) -> int:
    spec = _spec(args)
    assert spec is not None  # --quantize is required here
    written = quantize_version(
        args.repository, args.model, args.version, args.to_version, spec, args.quantize_table
    )
    report = inspect_head(written / MODEL_FILE)
    quantized = report.quantization or {}
    print(
        f"wrote {written}: {spec.describe()}, {report.weight_bytes:,} bytes of weights "
        f"({'one tensor set shared by both sides' if quantized.get('shared') else 'untied'})"
    )
    return 0


def trim(args: argparse.Namespace) -> int:
    def keep(size: int) -> npt.NDArray[np.int64]:  # checked against the version's ids
        return _token_ids(args.keep, size)

    written = trim_version(
        args.repository, args.model, args.version, keep, args.name, args.to_version
    )
    report = inspect_head(written / MODEL_FILE)
    print(
        f"wrote {written}: {report.vocab_size:,} tokens kept, {report.weight_bytes:,} bytes of "
        f"weights ({'tied: one matrix' if report.tied else 'untied'}); answers use original ids"
    )
    return 0


def _token_ids(keep: str, size: int) -> npt.NDArray[np.int64]:
    """``--keep``: a .npy of ids, a text file of ids, or ``0-31999,50256`` inline; ranges are
    checked against the head's ``size`` ids before any is made (a typo must not fill memory)."""
    path = Path(keep)
    if path.suffix == ".npy" and path.is_file():
        try:
            ids = np.asarray(np.load(path, allow_pickle=False)).reshape(-1)
        except ValueError as error:  # object arrays, a file that is no .npy
            raise UsageError(f"--keep: {keep[:200]} is no .npy of ids ({error})") from None
        if ids.dtype.kind not in "iu":  # 1.5 would become 1 silently
            raise UsageError(f"--keep: {keep[:200]} holds {ids.dtype}, not integer token ids")
        return ids.astype(np.int64)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else keep
    except UnicodeDecodeError:
        raise UsageError(f"--keep: {keep[:200]} is no .npy and no text of ids") from None
    kept = np.zeros(size, bool)
    for part in text.replace(",", " ").split():
        low, _, high = part.partition("-")
        first, last = decimal(low), decimal(high or low)
        if first is None or last is None or last < first:
            raise UsageError(f"--keep: {part[:32]!r} is neither an id nor a range like 0-31999")
        if last >= size:
            raise UsageError(f"--keep: {last} is past the head's ids, [0, {size})")
        kept[first : last + 1] = True
    return np.flatnonzero(kept).astype(np.int64)


def compare(args: argparse.Namespace) -> int:
    from service.cli.compare import compare_served, format_comparison

    url = args.url or _local_url()
    report = compare_served(
        url, args.model_a, args.model_b, args.hidden, args.targets, args.k, args.repository
    )
    print(json.dumps(report, indent=2) if args.json else format_comparison(report))
    return 0


def lens(args: argparse.Namespace) -> int:
    from service.cli.logit_lens import lens_command

    return lens_command(args, args.url or _local_url())


def retie_head(args: argparse.Namespace) -> int:
    if args.output is None and not args.in_place:
        raise UsageError("say where: -o OUTPUT, or --in-place to rewrite the model itself")
    result = retie(args.path, args.output)
    print(
        f"wrote {result.output}: tied, {result.bytes_saved:,} bytes saved, outputs unchanged "
        f"(max |difference| {result.max_abs_difference:.2g} on random inputs)"
    )
    return 0


def health(args: argparse.Namespace) -> int:
    """For container health checks: GET /health/ready; exit 0 when ready."""
    import httpx

    url = (args.url or _local_url()).rstrip("/")
    try:  # not ``Client.ready``: it is False for a service it cannot reach, said apart here
        # No proxy: a container's health check asks its own service, never through one.
        ready = httpx.get(f"{url}/health/ready", timeout=3, trust_env=False).status_code == 200
    except httpx.TransportError as error:
        raise CommandError(f"{url} is not reachable: {error}") from None
    print(f"{url}: {'ready' if ready else 'not ready'}")
    return 0 if ready else 1


def _local_url() -> str:
    """This machine on LMHEAD_PORT (reached when that is invalid: says so, exit 1: Docker
    reserves a health check's 2)."""
    from pydantic import ValidationError

    from service.settings import PlaceSettings

    try:
        return f"http://127.0.0.1:{PlaceSettings().port}"
    except ValidationError as error:
        raise CommandError(f"invalid settings: {settings_message(error)} (or give --url)") from None


def inspect(args: argparse.Namespace) -> int:
    report = inspect_head(args.path)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def _saved(report: HeadReport) -> str:
    """What tying saves: none for an untied head; for a broken tie, what re-tying would."""
    if report.duplicate and not report.untied_on_purpose:
        return f"none yet ({report.duplicate_bytes:,} once re-tied)"
    return f"{report.bytes_saved_by_tying:,}"


def format_report(report: HeadReport) -> str:
    """A readable summary: the tie first, then sizes."""
    if report.tied:
        wiring = "tied: one initializer feeds the Gather and the projection"
    elif report.duplicate and report.untied_on_purpose:
        wiring = (
            "untied twin: the projection weight starts as a copy of the embedding, written on "
            "purpose (lmhead import --untie), to diverge when fine-tuned"
        )
    elif report.duplicate:
        wiring = (
            f"untied, DUPLICATED ({report.duplicate}): a broken tie, the projection weight "
            f"repeats the embedding; `lmhead retie` would save {report.duplicate_bytes:,} bytes"
        )
    else:
        wiring = "untied: separate embedding and projection initializers"
    layout = " (stored transposed)" if report.projection_transposed else ""
    quantized = report.quantization
    if quantized:
        sharing = (
            "one set of codes, scales and zero points feeds both sides"
            if quantized["shared"]
            else ("table quantized separately" if quantized["table"] else "table in float")
        )
        layout += (
            f" ({quantized['dtype']}, blocks of {quantized['block_size']}, "
            f"{quantized['bytes']:,} bytes; {sharing})"
        )
    rows = [
        ("head", wiring),
        ("embedding", f"{report.embedding_initializer} -> {report.gather_node}"),
        ("projection", f"{report.projection_initializer}{layout} -> {report.projection_node}"),
        ("vocab x d_model", f"{report.vocab_size} x {report.d_model} {report.dtype}"),
        ("parameters", f"{report.parameters:,}"),
        ("final norm", report.norm_text()),
        ("weight bytes", f"{report.weight_bytes:,}"),
        ("saved by tying", _saved(report)),
        (
            "file bytes",
            f"{report.file_bytes:,}"
            + (" (external data)" if report.external_data else " (inline)"),
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join([report.path] + [f"  {name:<{width}}  {value}" for name, value in rows])
