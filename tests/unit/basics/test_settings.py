"""Settings that guard the service: which Host names it answers to, by default and as set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import Settings


def test_a_loopback_service_answers_to_loopback_names_only() -> None:
    assert Settings().trusted_hosts == ["127.0.0.1", "::1", "[::1]", "localhost"]
    assert Settings(host="::1").trusted_hosts == Settings(host="localhost").trusted_hosts


def test_a_service_bound_elsewhere_answers_to_any_name() -> None:
    """A non-loopback bind needs a token (or a read-only control API), which guards the
    control API: probes and Services reach pods under names the service cannot know."""
    assert Settings(host="0.0.0.0", admin_token="secret").trusted_hosts == ["*"]
    assert Settings(host="0.0.0.0", read_only=True).trusted_hosts == ["*"]


def test_allowed_hosts_replaces_the_default() -> None:
    settings = Settings(allowed_hosts=" Lmhead.Internal, *.example.com ,127.0.0.1")
    assert settings.trusted_hosts == ["lmhead.internal", "*.example.com", "127.0.0.1"]
    assert Settings(allowed_hosts="").trusted_hosts == Settings().trusted_hosts


@pytest.mark.parametrize("patterns", ["a.*.example", "exa*mple.com", "a,,b", "*example.com"])
def test_host_patterns_starlette_cannot_take_are_refused(patterns: str) -> None:
    with pytest.raises(ValidationError, match="no host pattern"):
        Settings(allowed_hosts=patterns)


@pytest.mark.parametrize("token", [" ", "\t \n"])
def test_a_token_of_whitespace_is_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="LMHEAD_ADMIN_TOKEN is only whitespace"):
        Settings(host="0.0.0.0", admin_token=token)


@pytest.mark.parametrize(
    "host", ["127.0.0.2", "LOCALHOST", "localhost.", "0:0:0:0:0:0:0:1", "[::1]", "::ffff:127.0.0.1"]
)
def test_any_spelling_of_loopback_is_loopback(host: str) -> None:
    """A loopback bind spelled otherwise turned the Host check off (``Host: evil.com`` was
    answered) and, without read-only, refused to start for exposing the control API."""
    settings = Settings(host=host)
    assert settings.loopback
    assert "*" not in settings.trusted_hosts
    assert "evil.com" not in settings.trusted_hosts
    assert {"127.0.0.1", "localhost", "[::1]"} <= set(settings.trusted_hosts)


def test_a_loopback_bind_answers_to_its_own_spelling() -> None:
    assert "127.0.0.2" in Settings(host="127.0.0.2").trusted_hosts
    assert "[::1]" in Settings(host="0:0:0:0:0:0:0:1").trusted_hosts


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "192.0.2.7", "no-such-name.invalid"])
def test_other_binds_are_not_loopback(host: str) -> None:
    assert not Settings(host=host, read_only=True).loopback


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("s\u00e9cret", "printable ASCII"),
        ("secret ", "whitespace"),
        (" secret", "whitespace"),
        ("sec\x07ret", "printable ASCII"),
        ("sec\nret", "printable ASCII"),
    ],
)
def test_a_token_http_cannot_carry_is_refused(token: str, why: str) -> None:
    """Accepted at start, such a token let nobody authenticate."""
    with pytest.raises(ValidationError, match=why):
        Settings(host="0.0.0.0", admin_token=token)


def test_a_printable_token_with_inner_spaces_is_taken() -> None:
    settings = Settings(host="0.0.0.0", admin_token="two words!")
    assert settings.admin_token is not None
