"""A model's ``config.json`` read as the loader reads it: what is wrong is said of the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.repository.disk import CONFIG_FILE, RepositoryError, read_config


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[1, 2]", "m/config.json: Input should be an object"),
        ("nonsense", "m/config.json: Invalid JSON"),
        ('{"default_k": "x"}', "m/config.json: default_k: Input should be a valid integer"),
    ],
)
def test_a_bad_config_is_reported_as_the_file_not_a_body(
    tmp_path: Path, text: str, said: str
) -> None:
    """An error of the whole file was reported as "body: ..." (the HTTP API's word)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / CONFIG_FILE).write_text(text)
    with pytest.raises(RepositoryError) as raised:
        read_config(tmp_path / "m", tmp_path.resolve())
    assert str(raised.value).startswith(said)
    assert "body" not in str(raised.value)
