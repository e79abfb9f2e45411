"""Service configuration: one ``Settings`` object, read from ``LMHEAD_*`` environment variables.

Nothing reads the environment at import time: ``create_app(Settings())`` does, once. Each field
has a docstring; ``settings_table()`` renders them for the README (a test keeps the two equal).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ControlMode = Literal["none", "explicit", "poll"]
MemoryMode = Literal["shared", "fast"]
ProviderChoice = Literal["auto", "cpu", "cuda"]
#: The Host names of a loopback service: its names, and an IPv6 literal as Host writes it.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
HOUR_S = 3600.0
DAY_S = 86400.0


class PlaceSettings(BaseSettings):
    """Where the repository is and which port serves: what every ``lmhead`` command reads
    (``demo`` and ``import`` write to the same repository that ``serve`` serves)."""

    model_config = SettingsConfigDict(
        env_prefix="LMHEAD_",
        use_attribute_docstrings=True,
        extra="ignore",
        frozen=True,
        protected_namespaces=("settings_",),  # model_name: pydantic<2.10 warns on model_*
    )

    repository: Path = Path("models")
    """Model repository: `<name>/<version>/model.onnx` (+ optional `<name>/config.json`)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    model_name: str | None = None
    """Serve only this model; start-up fails without it (KServe passes its service's name)."""

    @field_validator("model_name", mode="before")
    @classmethod
    def _empty_name_is_unset(cls, value: object) -> object:
        """`LMHEAD_MODEL_NAME=` (compose's default substitution) means every model."""
        return None if value in ("", None) else value

    @field_validator("repository", mode="before")
    @classmethod
    def _a_directory(cls, value: object) -> object:
        """Never "" (it served the working directory), never a file."""
        if value == "":
            raise ValueError("must name a directory, got an empty value")
        path = str(value)
        if os.path.exists(path) and not os.path.isdir(path):  # False where it cannot look
            raise ValueError(f"{path[:200]} is not a directory")
        return value


class Settings(PlaceSettings):
    """All knobs of the service; environment variables are ``LMHEAD_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix="LMHEAD_", use_attribute_docstrings=True, extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    """Address to bind (all it resolves to; empty: every interface); 0.0.0.0 in a container."""
    allowed_hosts: str | None = None
    """Host names the HTTP API answers to, comma-separated (`*.example.com`; `*`: any). Unset:
    on a loopback bind the loopback names (a web page whose name is made to resolve to
    127.0.0.1 is refused: DNS rebinding); elsewhere any (a token guards the control API)."""
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    """Also serve the V2 protocol over gRPC on this port (the image uses 8001); off if unset."""
    workers: int = Field(default=1, ge=1, le=64)
    """Front processes (HTTP, gRPC) feeding one engine holding each head once (`lmhead serve`)."""
    front_nice: int = Field(default=0, ge=0, le=19)
    """Nice levels the fronts run below the engine (19: 64-row loads on 2 cores; see workers.md)."""
    default_k: int = Field(default=5, ge=1)
    """Top-k when a request does not say (a model's config.json may override it)."""
    max_k: int = Field(default=1000, ge=1)
    """Largest k a request may ask for."""
    max_rows: int = Field(default=4096, ge=1)
    """Most hidden-state rows (or input ids) in one request; more is refused with 413."""
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Largest request body; larger is refused with 413 before it is read."""
    max_logits_bytes: int = Field(default=256 * 2**20, ge=1024)
    """Largest (rows x vocab) float32 tensor a request may make: full logits are refused (413)
    above it, top-k runs in chunks below it."""
    max_inflight_bytes: int = Field(default=2**30, ge=2**20)
    """Memory all requests in flight may hold (bodies as decoded, full logits); past it 503."""
    max_connections: int = Field(default=1000, ge=1)
    """Open connections at once; more are answered 503 and closed (`lmhead serve` only)."""
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    """Request line and headers; more is answered 431 and the connection closed."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=HOUR_S, allow_inf_nan=False)
    """A request head (or a new connection's first one) must arrive within this; else 408."""
    body_timeout_s: float = Field(default=30.0, gt=0, le=HOUR_S, allow_inf_nan=False)
    """A request body must bring 1 KiB per this many seconds (else 408), and a client must
    read some of its answer in this time (else it is dropped)."""
    keep_alive_s: float = Field(default=5.0, gt=0, le=HOUR_S, allow_inf_nan=False)
    """An idle keep-alive connection is closed after this."""
    batching: bool = True
    """Merge concurrent requests for one model into one onnxruntime run."""
    max_batch_rows: int = Field(default=128, ge=1)
    """Most rows of one run: requests merge up to it, a larger one is cut into runs of it."""
    max_wait_ms: float = Field(default=2.0, ge=0, le=10_000, allow_inf_nan=False)
    """How long a batch waits for more requests once the first has arrived."""
    max_queue_rows: int = Field(default=16384, ge=1)
    """Rows waiting per model before new requests get 503 with Retry-After; at least max_rows."""
    inference_threads: int = Field(default=1, ge=1, le=256)
    """Threads that run onnxruntime sessions (keep x intra_op_threads <= cores)."""
    intra_op_threads: int = Field(default=0, ge=0, le=1024)
    """onnxruntime threads per run; 0 means one per physical core (one for a tiny head)."""
    memory_mode: MemoryMode = "shared"
    """shared: a tied head holds its matrix once (~1.0x W, full speed); fast: ~2x W."""
    provider: ProviderChoice = "auto"
    """Execution provider: auto (CUDA when present, else CPU), cuda (falls back to CPU), cpu."""
    cuda_tf32: bool = False
    """CUDA: TensorFloat-32 matmuls for float32 heads (1.38x faster at 64 rows on an H200,
    logits off by ~1e-3); off, float32 means float32. For speed, serve a half-precision head."""
    scratch_dir: Path | None = None
    """Where a version is copied while it loads (default: the system's temp directory)."""
    create_demo_models: bool = False
    """Write the demo heads at start when the repository has no models, unless
    LMHEAD_MODEL_NAME is set or LMHEAD_LOAD_AT_START is false (the image sets it)."""
    load_at_start: bool = True
    """false: start with no model loaded; each loads when asked (control API, Ray Serve)."""
    shadow_max_pending: int = Field(default=8, ge=1)
    """Shadow runs in flight before further samples are dropped (and counted)."""
    log_level: LogLevel = "info"
    """Log level of the service and uvicorn."""
    access_log: bool = False
    """Log every HTTP request (uvicorn's access log); off by default at inference rates."""
    control_mode: ControlMode = "explicit"
    """none: models fixed at start; explicit: load/unload API; poll: rescan the repository too."""
    poll_interval_s: float = Field(default=5.0, ge=0.05, le=DAY_S, allow_inf_nan=False)
    """Seconds between repository scans in poll mode."""
    admin_token: SecretStr | None = None
    """When set, the repository API needs `Authorization: Bearer <token>`."""
    read_only: bool = False
    """Refuse repository load/unload calls with 403 (poll mode still follows the disk)."""
    drain_timeout_s: float = Field(default=30.0, ge=0, le=HOUR_S, allow_inf_nan=False)
    """How long admitted requests may finish: of a replaced or unloaded version before it is
    released, and of the whole service when it stops (SIGTERM; 10 s at least, then 5 s for
    the rest before the process exits whatever still runs)."""
    warmup_timeout_s: float = Field(default=60.0, ge=0.1, le=HOUR_S, allow_inf_nan=False)
    """A loading version's warm-up (one row through its head) must end within this, else its
    run is ended and the version fails: a graph whose run takes longer is not a head's."""

    @field_validator("admin_token", "scratch_dir", "grpc_port", "allowed_hosts", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """`LMHEAD_ADMIN_TOKEN=` (compose's default substitution) means no token, never "";
        `LMHEAD_SCRATCH_DIR=` the system's temp directory, never the working directory;
        `LMHEAD_GRPC_PORT=` no gRPC (the image sets 8001); `LMHEAD_ALLOWED_HOSTS=` the default."""
        return None if value in ("", None) else value

    @field_validator("admin_token")
    @classmethod
    def _real_token(cls, value: SecretStr | None) -> SecretStr | None:
        """A token of spaces guards nothing a client cannot guess (and a stray space in a
        file of variables is no token). A token HTTP cannot carry would lock everyone out:
        a header value is ASCII (non-ASCII bytes are read as Latin-1, never as the UTF-8 the
        variable held) and its surrounding spaces are dropped by every parser."""
        if value is None:
            return None
        token = value.get_secret_value()
        if not token.strip():
            raise ValueError("LMHEAD_ADMIN_TOKEN is only whitespace: set a real token, or none")
        if token != token.strip():
            raise ValueError(
                "LMHEAD_ADMIN_TOKEN starts or ends with whitespace, which an HTTP header "
                "cannot carry (a client's 'Authorization: Bearer <token>' loses it): remove it"
            )
        if not (token.isascii() and token.isprintable()):
            raise ValueError(
                "LMHEAD_ADMIN_TOKEN must be printable ASCII (letters, digits, punctuation, "
                "inner spaces): an HTTP header cannot carry other characters, so no client "
                "could send it"
            )
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: str | None) -> str | None:
        """Names, `*.domain` or `*`, as Starlette's TrustedHostMiddleware takes them."""
        if value is None:
            return None
        for pattern in _patterns(value):
            wildcard = pattern.startswith("*.") and "*" not in pattern[1:]
            if not pattern or ("*" in pattern and pattern != "*" and not wildcard):
                raise ValueError(
                    f"{pattern[:64]!r} is no host pattern: a name, '*.example.com' or '*'"
                )
        return value

    @field_validator("scratch_dir")
    @classmethod
    def _writable_directory(cls, value: Path | None) -> Path | None:
        """Every version is copied there as it loads: a wrong path would fail them all."""
        if value is not None and not (value.is_dir() and os.access(value, os.W_OK | os.X_OK)):
            raise ValueError(f"{str(value)[:200]} is not a writable directory")
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.default_k > self.max_k:
            raise ValueError(
                f"LMHEAD_DEFAULT_K ({self.default_k}) must be <= LMHEAD_MAX_K ({self.max_k})"
            )
        if self.max_queue_rows < self.max_rows:  # such a request would get 503 forever
            raise ValueError(
                f"LMHEAD_MAX_QUEUE_ROWS ({self.max_queue_rows}) must be >= LMHEAD_MAX_ROWS "
                f"({self.max_rows}): a request of max_rows rows must fit in a model's queue"
            )
        if self.grpc_port is not None and self.grpc_port == self.port != 0:
            raise ValueError(
                f"LMHEAD_GRPC_PORT and LMHEAD_PORT are both {self.port}: give gRPC its own port"
            )
        if self.admin_api_writable and self.admin_token is None and not self.loopback:
            raise ValueError(
                f"host {self.host!r} exposes the repository load/unload API without a token: "
                "set LMHEAD_ADMIN_TOKEN, LMHEAD_READ_ONLY=true or LMHEAD_CONTROL_MODE=none"
            )
        return self

    @property
    def loopback(self) -> bool:
        """Bound to loopback addresses only, however the host is spelled (``127.0.0.2``,
        ``LOCALHOST``, ``0:0:0:0:0:0:0:1``, a name that resolves only to loopback)."""
        return is_loopback(self.host)

    @property
    def trusted_hosts(self) -> list[str]:
        """The Host names requests may carry (``allowed_hosts``, or its default)."""
        if self.allowed_hosts is not None:
            return _patterns(self.allowed_hosts)
        if not self.loopback:
            return ["*"]
        return sorted(LOOPBACK_NAMES | _host_spellings(self.host))

    @property
    def admin_api_writable(self) -> bool:
        return self.control_mode != "none" and not self.read_only


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one: 127.0.0.0/8 and ::1 in any
    spelling (bracketed, zero-padded, IPv4-mapped), ``localhost`` in any case or with its
    trailing dot, or a name that resolves to loopback addresses alone. An empty host (every
    interface) and names that do not resolve are not."""
    name = _bare(host)
    if not name:
        return False
    if name == "localhost":
        return True
    address = _address(name)
    if address is not None:
        return _loopback_address(address)
    return _resolves_to_loopback(name)


def _bare(host: str) -> str:
    """A host as written, lower-cased, without brackets or a trailing dot."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name.removesuffix(".") if name != "." else ""


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.split("%", 1)[0])  # an IPv6 zone id is no address
    except ValueError:
        return None


def _loopback_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@lru_cache(maxsize=16)
def _resolves_to_loopback(name: str) -> bool:
    """A name binds every address it resolves to (``service.hosting.listeners``): loopback
    only when all of them are."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = [_address(str(entry[4][0])) for entry in found]
    return bool(addresses) and all(a is not None and _loopback_address(a) for a in addresses)


def _host_spellings(host: str) -> frozenset[str]:
    """What a client of a loopback bind puts in Host: the bind as written and, for an
    address, its canonical form (bracketed for IPv6, as Host writes it)."""
    name = _bare(host)
    address = _address(name)
    if address is None:
        return frozenset({name})
    if isinstance(address, ipaddress.IPv6Address):
        return frozenset({f"[{name}]", f"[{address.compressed}]"})
    return frozenset({name, address.compressed})


def _patterns(value: str) -> list[str]:
    return [pattern.strip().lower() for pattern in value.split(",")]


def settings_table() -> str:
    """docs/settings.md's table, generated from the fields above (a test keeps them equal)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = default.as_posix() if isinstance(default, Path) else default
        shown = "unset" if default is None else shown
        meaning = " ".join((field.description or "").split())  # a row is one line of markdown
        lines.append(f"| `LMHEAD_{name.upper()}` | `{shown}` | {meaning} |")
    return "\n".join(lines)


#: ``LMHEAD_`` variables that are no setting but are read on purpose (the CLI's tracebacks).
TOOLING_VARIABLES = frozenset({"LMHEAD_DEBUG"})


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """``LMHEAD_`` variables that name no setting: pydantic-settings ignores them silently, so
    ``LMHEAD_ADMINTOKEN=...`` would leave the control API without a token, unnoticed."""
    known = {f"LMHEAD_{name.upper()}" for name in Settings.model_fields} | TOOLING_VARIABLES
    return sorted(
        name for name in environ if name.upper().startswith("LMHEAD_") and name.upper() not in known
    )
