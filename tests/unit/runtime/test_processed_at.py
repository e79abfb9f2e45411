"""``service.runtime.processed_at``: the touched tokens of a run, whole or for listed tokens
alone, against a plain reading of the options token by token."""

from __future__ import annotations

import numpy as np
import pytest

from service.runtime.processed_at import touched
from service.runtime.processors import Histories, Processors
from service.runtime.vocabulary import Bias

VOCAB = 300
ROWS = 5


def _processors(rng: np.random.Generator) -> Processors:
    """Histories over the whole vocabulary, a trimmed head's lacking tokens among them."""
    lists = []
    for _ in range(ROWS):
        tokens = rng.integers(0, VOCAB, 40)
        tokens[:3] = -1 - rng.integers(0, 50, 3)  # tokens the head lacks: never touched
        lists.append(tokens.tolist())
    output = Histories.of([tokens[::2] for tokens in lists])
    return Processors(
        prompt=Histories.of(lists),
        output=output,
        repetition=1.3,
        presence=0.2,
        frequency=0.1,
        min_tokens=30,
        stop_ids=np.array([5, 6]),
    )


def _expected(processors: Processors, bias: Bias) -> dict[int, tuple[bool, int, bool, float]]:
    """Flat index -> (seen, output count, banned, bias), read token by token."""
    table: dict[int, tuple[bool, int, bool, float]] = {}

    def entry(flat: int) -> tuple[bool, int, bool, float]:
        return table.get(flat, (False, 0, False, 0.0))

    assert processors.prompt is not None
    assert processors.output is not None
    for row in range(ROWS):
        base = row * VOCAB
        prompt = processors.prompt.values[
            processors.prompt.offsets[row] : processors.prompt.offsets[row + 1]
        ]
        output = processors.output.values[
            processors.output.offsets[row] : processors.output.offsets[row + 1]
        ]
        for token in prompt.tolist():
            if token >= 0:
                seen, count, banned, value = entry(base + token)
                table[base + token] = (True, count, banned, value)
        for token in output.tolist():
            if token >= 0:
                _, count, banned, value = entry(base + token)
                table[base + token] = (True, count + 1, banned, value)
        if len(output) < processors.min_tokens:
            for token in (5, 6):
                seen, count, _, value = entry(base + token)
                table[base + token] = (seen, count, True, value)
        for token, value in zip(bias.ids.tolist(), bias.values.tolist(), strict=True):
            seen, count, banned, _ = entry(base + token)
            table[base + token] = (seen, count, banned, value)
    return table


@pytest.mark.parametrize("seed", range(3))
def test_touched_lists_every_changed_token_once_or_the_listed_ones_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    processors = _processors(rng)
    bias = Bias.of({7: 1.5, 299: -2.0}, None)
    assert bias is not None
    expected = _expected(processors, bias)
    whole = touched(processors, bias, ROWS, VOCAB)
    assert whole.at.tolist() == sorted(expected)
    for at, seen, count, banned, value in zip(
        whole.at, whole.seen, whole.count, whole.banned, whole.bias, strict=True
    ):
        assert (bool(seen), int(count), bool(banned), float(value)) == expected[int(at)]
    # listed: some touched tokens, some not, some touched in another row only
    listed = np.unique(rng.integers(0, ROWS * VOCAB, 200))
    chosen = touched(processors, bias, ROWS, VOCAB, listed=listed)
    assert chosen.at.tolist() == listed.tolist()
    assert chosen.listed.all()
    for at, seen, count, banned, value in zip(
        chosen.at, chosen.seen, chosen.count, chosen.banned, chosen.bias, strict=True
    ):
        assert (bool(seen), int(count), bool(banned), float(value)) == expected.get(
            int(at), (False, 0, False, 0.0)
        )
