"""Wire models of the native API: the small option fields only.

The big arrays (hidden states, ids) are not pydantic fields: they are decoded straight to numpy
by ``service.codec`` (orjson + one ``np.array`` call, or a zero-copy ``.npy`` read), which is
several times faster than validating millions of floats as Python objects.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LogitsOptions(_Options):
    """Options of ``/logits``: in the JSON body beside ``hidden_states``, or as query
    parameters with a ``.npy`` body."""

    temperature: float = Field(default=1.0, gt=0)

    @field_validator("temperature")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class TopKOptions(LogitsOptions):
    """Options of ``/topk``: the temperature, plus k and whether to return log-probs."""

    k: int | None = Field(default=None, ge=1)
    logprobs: bool = False


class EmbedOptions(_Options):
    """``/embed`` has no options yet; unknown fields are refused all the same."""
