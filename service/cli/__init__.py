"""``lmhead`` command line: serve, demo, import, inspect, retie, health."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from service.checkpoints import CheckpointError
from service.demo import TIED_NAME, UNTIED_NAME, DemoSpec, write_demo_models
from service.errors import describe_validation_errors
from service.heads import FORMAT
from service.importer import ImportOptions, import_checkpoint
from service.inspect import HeadInspectionError, HeadReport, inspect_head
from service.repository import MODEL_FILE
from service.retie import retie


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (HeadInspectionError, CheckpointError) as error:
        print(f"lmhead: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:
        print(
            f"lmhead: invalid settings: {describe_validation_errors(error.errors())}",
            file=sys.stderr,
        )
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmhead", description="Serve language-model heads.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="write the demo tied and untied heads")
    demo.add_argument("--repository", type=Path, default=Path("models"))
    demo.add_argument("--vocab-size", type=int, default=DemoSpec.vocab_size)
    demo.add_argument("--d-model", type=int, default=DemoSpec.d_model)
    demo.add_argument("--seed", type=int, default=DemoSpec.seed)
    demo.add_argument("--force", action="store_true", help="rewrite models that exist")
    demo.set_defaults(handler=_demo)

    serve = commands.add_parser("serve", help="serve the model repository over HTTP")
    serve.add_argument("--repository", type=Path, help="overrides LMHEAD_REPOSITORY")
    serve.add_argument("--host", help="overrides LMHEAD_HOST")
    serve.add_argument("--port", type=int, help="overrides LMHEAD_PORT")
    serve.set_defaults(handler=_serve)

    importer = commands.add_parser("import", help="make a head from a HF safetensors checkpoint")
    importer.add_argument("checkpoint", type=Path, help="directory with config.json, *.safetensors")
    importer.add_argument("--name", required=True, help="model name in the repository")
    importer.add_argument("--repository", type=Path, default=Path("models"))
    importer.add_argument("--version", type=int, help="default: the next free version")
    importer.add_argument("--embedding-tensor", help="override the input embedding tensor name")
    importer.add_argument("--head-tensor", help="override the output head tensor name")
    tying = importer.add_mutually_exclusive_group()
    tying.add_argument("--tie", action="store_true", help="force one shared matrix")
    tying.add_argument("--untie", action="store_true", help="separate copy of W for the head")
    importer.add_argument("--external-data", action="store_true", help="weights in model.onnx.data")
    importer.set_defaults(handler=_import)

    versus = commands.add_parser("compare", help="contrast two served heads on your hidden states")
    versus.add_argument("model_a")
    versus.add_argument("model_b")
    versus.add_argument("--hidden", type=Path, required=True, help=".npy of (rows, d_model)")
    versus.add_argument("--targets", type=Path, help=".npy of the real next token ids")
    versus.add_argument("--k", type=int, default=10)
    versus.add_argument("--url", default="http://127.0.0.1:8000", help="the running service")
    versus.add_argument(
        "--repository",
        type=Path,
        default=Path("models"),
        help="where the model files are, to measure resident memory",
    )
    versus.add_argument("--json", action="store_true")
    versus.set_defaults(handler=_compare)

    repair = commands.add_parser("retie", help="repair a duplicated tied weight in place or to -o")
    repair.add_argument("path", type=Path, help="model.onnx or a version directory")
    repair.add_argument("-o", "--output", type=Path, help="write here instead of in place")
    repair.set_defaults(handler=_retie)

    health = commands.add_parser("health", help="exit 0 when the local service is ready")
    health.add_argument("--port", type=int, help="overrides LMHEAD_PORT")
    health.set_defaults(handler=_health)

    inspect = commands.add_parser("inspect", help="report how an ONNX head's weights are wired")
    inspect.add_argument("path", type=Path, help="model.onnx or a version directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)
    return parser


def _demo(args: argparse.Namespace) -> int:
    repository: Path = args.repository
    existing = [repository / name / "1" / MODEL_FILE for name in (TIED_NAME, UNTIED_NAME)]
    current = all(path.is_file() and inspect_head(path).format == FORMAT for path in existing)
    if current and not args.force:
        print(f"demo models already in {repository} (use --force to rewrite)")
        return 0
    spec = DemoSpec(vocab_size=args.vocab_size, d_model=args.d_model, seed=args.seed)
    for version_dir in write_demo_models(repository, spec):
        print(f"wrote {version_dir}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    flags = {"repository": args.repository, "host": args.host, "port": args.port}
    settings = Settings(**{key: value for key, value in flags.items() if value is not None})
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=10,
        # X-Forwarded-* would only rewrite the client address that access logs show; the
        # middleware that reads them wraps every request (~3% of a one-row request's CPU).
        proxy_headers=settings.access_log,
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    options = ImportOptions(
        version=args.version,
        embedding_tensor=args.embedding_tensor,
        head_tensor=args.head_tensor,
        tie=args.tie,
        untie=args.untie,
        external_data=True if args.external_data else None,
    )
    result = import_checkpoint(args.checkpoint, args.repository, args.name, options)
    kind = "tied" if result.tied else "untied"
    print(f"wrote {result.directory}: {kind} head, {result.vocab_size} x {result.d_model}")
    for note in result.notes:
        print(f"  note: {note}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from service.cli.compare import compare_served, format_comparison

    report = compare_served(
        args.url, args.model_a, args.model_b, args.hidden, args.targets, args.k, args.repository
    )
    print(json.dumps(report, indent=2) if args.json else format_comparison(report))
    return 0


def _retie(args: argparse.Namespace) -> int:
    result = retie(args.path, args.output)
    print(
        f"wrote {result.output}: tied, {result.bytes_saved:,} bytes saved, outputs unchanged "
        f"(max |difference| {result.max_abs_difference:.2g} on random inputs)"
    )
    return 0


def _health(args: argparse.Namespace) -> int:
    """For container health checks: GET /health/ready on this machine's port."""
    import httpx

    from service.settings import Settings

    port = args.port or Settings(host="127.0.0.1").port
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=3)
    except httpx.TransportError as error:
        print(f"lmhead: not reachable on port {port}: {error}", file=sys.stderr)
        return 1
    print(response.text)
    return 0 if response.status_code == 200 else 1


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_head(args.path)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def format_report(report: HeadReport) -> str:
    """A readable summary: the tie first, then sizes."""
    if report.tied:
        wiring = "tied: one initializer feeds the Gather and the projection"
    elif report.duplicate:
        wiring = (
            f"untied, DUPLICATED ({report.duplicate}): a broken tie, the projection weight "
            f"repeats the embedding; re-tying saves {report.duplicate_bytes:,} bytes"
        )
    else:
        wiring = "untied: separate embedding and projection initializers"
    layout = " (stored transposed)" if report.projection_transposed else ""
    rows = [
        ("head", wiring),
        ("embedding", f"{report.embedding_initializer} -> {report.gather_node}"),
        ("projection", f"{report.projection_initializer}{layout} -> {report.projection_node}"),
        ("vocab x d_model", f"{report.vocab_size} x {report.d_model} {report.dtype}"),
        ("parameters", f"{report.parameters:,}"),
        ("weight bytes", f"{report.weight_bytes:,}"),
        ("saved by tying", f"{report.bytes_saved_by_tying:,}"),
        (
            "file bytes",
            f"{report.file_bytes:,}"
            + (" (external data)" if report.external_data else " (inline)"),
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join([report.path] + [f"  {name:<{width}}  {value}" for name, value in rows])
