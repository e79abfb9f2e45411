"""The ONNX head format: build, write, read, inspect and quantize heads; the reference math.

A tied head stores ONE initializer that feeds both the Gather and the projection; an untied
head stores two. ``graph`` builds the graph, ``lse_graph`` its chunked log-sum-exp,
``files`` writes and reads heads (``HeadWeights``, ``save_head``, ``read_head``), ``external``
reads external data, ``quantize`` block-quantizes, ``inspector`` reports how a file's weights
are wired, and ``reference`` is the numpy math every other layer is checked against.

May import: the shared basics at the package root only (``make layers`` checks the order).
``from service.heads import HeadWeights, save_head, read_head`` works and loads ``files`` (and
onnx) only when one of them is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.heads.files import HeadWeights, read_head, save_head

#: A head's file names, defined here only: the graph, and its external data when the weights
#: are stored beside it (the repository, the importer and the inspector all name them).
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

#: The names read lazily (``__getattr__``).
__all__ = ["HeadWeights", "read_head", "save_head"]


def __getattr__(name: str) -> Any:
    """The names users import from ``service.heads``, loaded on first use (PEP 562): importing
    ``service`` or the reference math must not load onnx into every front process."""
    if name in ("HeadWeights", "read_head", "save_head"):
        from service.heads import files

        return getattr(files, name)
    raise AttributeError(f"module 'service.heads' has no attribute {name!r}")
