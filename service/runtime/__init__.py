"""onnxruntime sessions, dynamic batches and rows of W.

One session per head (``session``), the dynamic batcher (``batcher``) and what one merged run
is (``pending``), how a head is placed in sessions (``layout``), rows of W read from a head
(``rows``, ``gemm``), the numpy of shaped distributions (``vocabulary``), and the math every
number derived from logits goes through (``logmath``: log-sum-exp, ranks, entropy, KL).

May import: ``service.heads`` and the shared basics at the package root (``make layers``
checks the order).
"""
