"""uvicorn's internals that lmhead's connection limits stand on, checked against the uvicorn
installed: an upgrade that renames, drops or reshapes one fails here, naming it, not in
production (where a hook no longer called would silently drop a limit).

``service.hosting.connection.LimitedHttp`` subclasses uvicorn's ``HttpToolsProtocol``: it
overrides private methods (``_start_asgi_task``), calls others (``_unset_keepalive_if_required``),
replaces ``data_received`` whole, reads and rebuilds the ``pipeline`` of requests read ahead, and
reads request cycles' and flow control's state; ``CoalescedWrites`` holds back uvicorn's writes;
``service.hosting.server`` overrides ``Server.handle_exit``. None of it is uvicorn's public API,
so pyproject.toml bounds uvicorn below its next minor release, and raising the bound means
running these tests against it. A use of a uvicorn name the lists below do not hold fails too
(``test_every_uvicorn_name_the_connection_uses_is_listed_here``), so the lists stay whole.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.hosting import connection, server
from service.hosting.coalesced_writes import CoalescedWrites
from service.hosting.connection import LimitedHttp

ROOT = Path(__file__).resolve().parents[3]
UVICORN = f"uvicorn {uvicorn.__version__}"

#: ``HttpToolsProtocol`` methods that ``LimitedHttp`` overrides (calling uvicorn's) or calls,
#: with their parameters as lmhead calls them.
METHODS: dict[str, tuple[str, ...]] = {
    "connection_made": ("self", "transport"),
    "connection_lost": ("self", "exc"),
    "data_received": ("self", "data"),
    "_unset_keepalive_if_required": ("self",),
    "_start_asgi_task": ("self", "cycle", "app"),
    "on_message_begin": ("self",),
    "on_url": ("self", "url"),
    "on_header": ("self", "name", "value"),
    "on_headers_complete": ("self",),
    "on_body": ("self", "body"),
    "on_message_complete": ("self",),
    "on_response_complete": ("self",),
    "pause_writing": ("self",),
    "resume_writing": ("self",),
}
#: ``HttpToolsProtocol``'s per-connection state that ``LimitedHttp`` reads (or, ``pipeline``,
#: rebuilds without a refused request's cycle).
ATTRIBUTES: tuple[str, ...] = ("connections", "loop", "parser", "transport", "flow", "cycle")
ATTRIBUTES += ("pipeline", "headers", "scope")
#: What lmhead reads of a request cycle (``self.cycle``, ``cycle``, ``running``), of flow
#: control (``self.flow``) and of the httptools parser (``self.parser``).
CYCLE = ("keep_alive", "response_complete", "waiting_for_100_continue", "send")
FLOW = ("read_paused", "write_paused", "drain", "resume_reading")
PARSER = ("feed_data", "get_http_version", "should_upgrade")
#: Where uvicorn must still call the hooks: a cycle starts through ``_start_asgi_task`` (at
#: once, or queued on ``pipeline`` and started when the answer before it completes).
CALLED_FROM: dict[str, tuple[str, ...]] = {
    "on_headers_complete": ("_start_asgi_task", "pipeline", "appendleft", "cycle"),
    "on_response_complete": ("_start_asgi_task", "pipeline", "pop"),
}
#: ``data_received`` is replaced whole (a parse error's reason kept, upgrades answered as
#: HTTP/1.1): the names uvicorn's own uses, in every release checked (0.45 to 0.55). Any
#: change means lmhead's copy must be read against uvicorn's again.
DATA_RECEIVED_NAMES = frozenset(
    {
        "HttpParserError",
        "HttpParserUpgrade",
        "_should_upgrade",
        "_unset_keepalive_if_required",
        "_unsupported_upgrade_warning",
        "feed_data",
        "handle_websocket_upgrade",
        "httptools",
        "logger",
        "parser",
        "send_400_response",
        "warning",
    }
)
#: ``uvicorn.Server`` methods that ``service.hosting.server`` overrides, calling uvicorn's.
SERVER_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "config"),
    "handle_exit": ("self", "sig", "frame"),
}
#: Transport calls that write: each must be one ``CoalescedWrites`` makes itself (one it only
#: forwards would pass bytes held back for the end of the turn: an answer out of order).
WRITES = frozenset({"write", "writelines", "write_eof", "abort", "close"})


def _parameters(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _assigned(cls: type, method: str | None = None) -> set[str]:
    """Every ``self.<name>`` that ``cls``'s own methods (or the one named) assign: state."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or method not in (None, function.name):
            continue
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            names |= {
                target.attr
                for target in targets
                if isinstance(target, ast.Attribute) and _is_name(target.value, "self")
            }
    return names


def _own(cls: type) -> set[str]:
    """The names ``cls`` gives its class and its instances' state (no dunders)."""
    names = set(vars(cls)) | _assigned(cls, "__init__")
    return {name for name in names if not (name.startswith("__") and name.endswith("__"))}


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _members(cls: type) -> set[str]:
    """What instances of ``cls`` have: its class's attributes and the state it assigns."""
    return set(dir(cls)) | _assigned(cls)


@pytest.mark.parametrize("hook", sorted(METHODS))
def test_each_protocol_hook_is_there_with_its_parameters(hook: str) -> None:
    method = getattr(HttpToolsProtocol, hook, None)
    assert callable(method), f"{UVICORN}: HttpToolsProtocol.{hook} is gone (LimitedHttp uses it)"
    assert _parameters(method) == METHODS[hook], (
        f"{UVICORN}: HttpToolsProtocol.{hook}{inspect.signature(method)} changed; LimitedHttp "
        f"expects ({', '.join(METHODS[hook])})"
    )


@pytest.mark.parametrize("hook", sorted(CALLED_FROM))
def test_uvicorn_still_starts_each_request_through_start_asgi_task(hook: str) -> None:
    """``LimitedHttp._start_asgi_task`` notes which request's app runs (the pipeline's
    refusals wait for it) and guards ``100 Continue``: uvicorn must call it from here."""
    used = set(getattr(HttpToolsProtocol, hook).__code__.co_names)
    missing = set(CALLED_FROM[hook]) - used
    assert not missing, f"{UVICORN}: HttpToolsProtocol.{hook} no longer uses {sorted(missing)}"


def test_data_received_lmhead_replaces_is_the_one_it_was_copied_from() -> None:
    used = frozenset(HttpToolsProtocol.data_received.__code__.co_names)
    assert used == DATA_RECEIVED_NAMES, (
        f"{UVICORN}: HttpToolsProtocol.data_received changed ({sorted(used ^ DATA_RECEIVED_NAMES)} "
        "came or went); LimitedHttp.data_received replaces it whole: bring the change over"
    )


@pytest.mark.parametrize(
    ("owner", "names"),
    [(HttpToolsProtocol, ATTRIBUTES), (RequestResponseCycle, CYCLE), (FlowControl, FLOW)],
    ids=["protocol", "cycle", "flow"],
)
def test_the_state_lmhead_reads_is_there(owner: type, names: tuple[str, ...]) -> None:
    missing = set(names) - _members(owner)
    assert not missing, (
        f"{UVICORN}: {owner.__name__} has no {sorted(missing)} (LimitedHttp reads it)"
    )


def test_the_parser_calls_are_httptools_own() -> None:
    missing = [name for name in PARSER if not hasattr(httptools.HttpRequestParser, name)]
    assert not missing, f"httptools' HttpRequestParser has no {missing}"


def test_lmhead_names_shadow_nothing_of_uvicorn() -> None:
    """A name ``LimitedHttp`` gives its own state or helpers, should uvicorn take it up in a
    release, would silently replace uvicorn's (``_pending``, ``_answer``, ``_timer``, ...)."""
    overridden = _own(LimitedHttp) & _members(HttpToolsProtocol)
    unlisted = overridden - set(METHODS)
    assert not unlisted, f"{UVICORN}: LimitedHttp's {sorted(unlisted)} shadow uvicorn's own"


def test_every_uvicorn_name_the_connection_uses_is_listed_here() -> None:
    """What ``LimitedHttp`` reaches through ``self``, ``super()``, ``self.cycle``, ``self.flow``,
    ``self.parser`` and the cycles it holds, less what it defines itself, is in the lists
    above: a new use of a uvicorn internal is checked here from the day it is written."""
    module = ast.parse(inspect.getsource(connection))
    scanned = [
        node
        for node in module.body
        if isinstance(node, ast.FunctionDef)
        or (isinstance(node, ast.ClassDef) and node.name == LimitedHttp.__name__)
    ]
    own = _own(LimitedHttp)
    known = {
        "self": set(METHODS) | set(ATTRIBUTES),
        "super": {*METHODS, "__init__"},
    }  # (__init__: forwarded as given)
    known |= {"cycle": set(CYCLE), "flow": set(FLOW), "parser": set(PARSER)}
    unlisted: set[str] = set()
    nodes = [node for part in scanned for node in ast.walk(part)]
    for node in nodes:
        if not isinstance(node, ast.Attribute):
            continue
        owner = _owner(node.value)
        if owner is None or (owner == "self" and node.attr in own):
            continue
        if node.attr not in known[owner]:
            unlisted.add(f"{owner}.{node.attr}")
    assert not unlisted, f"uvicorn names used by service.hosting.connection, unchecked: {unlisted}"


def _owner(node: ast.expr) -> str | None:
    """Whose attribute ``node.<attr>`` is, as the lists above group them (None: not uvicorn's)."""
    if _is_name(node, "self"):
        return "self"
    if isinstance(node, ast.Call) and _is_name(node.func, "super"):
        return "super"
    if isinstance(node, ast.Name) and node.id in ("cycle", "running"):
        return "cycle"
    if isinstance(node, ast.Attribute) and _is_name(node.value, "self"):
        return {"cycle": "cycle", "flow": "flow", "parser": "parser"}.get(node.attr)
    return None


def test_every_write_uvicorn_makes_goes_through_coalesced_writes() -> None:
    """``CoalescedWrites`` holds small writes to the end of the turn and forwards every other
    call: a write call it only forwarded (``writelines``, say) would overtake held bytes."""
    called = set()
    for module in (httptools_impl, flow_control):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Attribute) and _is_transport(node.value):
                called.add(node.attr)
    bypassing = (called & WRITES) - set(vars(CoalescedWrites))
    assert not bypassing, f"{UVICORN} writes through transport.{sorted(bypassing)}, unheld"


def _is_transport(node: ast.expr) -> bool:
    return _is_name(node, "transport") or (
        isinstance(node, ast.Attribute) and node.attr in ("transport", "_transport")
    )


@pytest.mark.parametrize("hook", sorted(SERVER_METHODS))
def test_each_server_hook_is_there_with_its_parameters(hook: str) -> None:
    method = getattr(uvicorn.Server, hook, None)
    assert callable(method), f"{UVICORN}: Server.{hook} is gone (service.hosting.server uses it)"
    assert _parameters(method) == SERVER_METHODS[hook], (
        f"{UVICORN}: Server.{hook}{inspect.signature(method)} changed; service.hosting.server "
        f"expects ({', '.join(SERVER_METHODS[hook])})"
    )


def test_uvicorn_still_stops_through_handle_exit() -> None:
    """The server's ``handle_exit`` arms the last-resort exit at the first stop signal:
    uvicorn must still install it as the signal handler."""
    assert "handle_exit" in inspect.getsource(uvicorn.Server.capture_signals), (
        f"{UVICORN}: Server.capture_signals no longer installs handle_exit"
    )


def test_every_server_override_is_listed_here() -> None:
    overrides = {
        function.name
        for node in ast.parse(inspect.getsource(server)).body
        if isinstance(node, ast.ClassDef) and "uvicorn.Server" in map(ast.unparse, node.bases)
        for function in node.body
        if isinstance(function, ast.FunctionDef) and hasattr(uvicorn.Server, function.name)
    }
    assert overrides, "service.hosting.server no longer subclasses uvicorn.Server: drop these"
    assert overrides <= set(SERVER_METHODS), f"unchecked: Server.{overrides - set(SERVER_METHODS)}"


def test_uvicorn_is_bounded_below_its_next_minor_release() -> None:
    """The hooks above are private: a release past the bound may change any of them, so
    ``pip`` never installs one before these tests have run against it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (line,) = [dep for dep in project["dependencies"] if dep.startswith("uvicorn")]
    specifier = Requirement(line).specifier
    uppers = [Version(spec.version) for spec in specifier if spec.operator == "<"]
    assert uppers, f"pyproject.toml's {line!r} has no upper bound"
    (upper,) = uppers
    assert upper.release[2:] in ((), (0,)), f"{line!r}: bound below a minor release (X.Y)"
    assert Version(uvicorn.__version__) in specifier, f"{UVICORN} is outside {line!r}"
