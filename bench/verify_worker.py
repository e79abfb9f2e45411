"""One checkout's data plane for ``bench/verify.py``, in a process of its own: the driver
starts one per build under test (``PYTHONPATH`` naming the checkout, so an earlier one can be
measured beside this one) and sends it the names of calls, one a line; the worker runs each
and answers its wall and CPU seconds as a JSON line (CPU: ``time.process_time``, every thread
of the process: the event loop, the inference executor and onnxruntime's own).

    python bench/verify_worker.py ROOT    # ROOT: models/ (head, drafter) and inputs.npz
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from service.allocator import settle_allocator
from service.messages import Target, TopKRequest
from service.metrics import Metrics
from service.plane.dataplane import DataPlane
from service.repository.registry import Registry
from service.settings import Settings
from service.verify_messages import VerifyRequest

K = 10
#: Drafts taken as certain as a tree: three children at the root, one under the second.
TREE = np.array([-1, -1, -1, 1])


def main() -> int:
    settle_allocator()  # the service's allocator: buffers from 1 MiB up are fresh mappings
    asyncio.run(_serve(Path(sys.argv[1])))
    return 0


async def _serve(root: Path) -> None:
    inputs = np.load(root / "inputs.npz")
    hidden, ids, probs = inputs["hidden"], inputs["ids"], inputs["probs"]
    states = inputs["draft_states"]
    settings = Settings(repository=root / "models", max_rows=4096, max_inflight_bytes=4 * 2**30)
    metrics = Metrics()
    head, drafter = Target("head"), Target("drafter")
    with ThreadPoolExecutor(1) as executor:
        registry = Registry(settings, executor, metrics)
        plane = DataPlane(registry, settings, metrics)
        await registry.load_all()
        model = registry.get("head")
        rows = hidden.reshape(-1, hidden.shape[-1])
        drafted = states.reshape(-1, states.shape[-1])
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "topk": lambda: plane.topk(TopKRequest(head, rows, K, logprobs=True)),
            "topk_draft": lambda: plane.topk(TopKRequest(drafter, drafted, K, logprobs=True)),
            "probs": lambda: plane.verify(VerifyRequest(head, hidden, ids, probs)),
            "certain": lambda: plane.verify(VerifyRequest(head, hidden, ids)),
            "tree": lambda: plane.verify(VerifyRequest(head, hidden, ids, draft_parents=TREE)),
            "draft_model": lambda: plane.verify(
                VerifyRequest(head, hidden, ids, draft_model="drafter", draft_hidden_states=states)
            ),
            "project_top10": lambda: model.project(rows, K),
            "project_full": lambda: model.project(rows, 1, full_logits=True),
        }
        print(json.dumps(sorted(calls)), flush=True)
        for line in sys.stdin:
            call = calls[line.strip()]
            wall, cpu = time.perf_counter(), time.process_time()
            await call()
            answer = [time.perf_counter() - wall, time.process_time() - cpu]
            print(json.dumps(answer), flush=True)
        await plane.close()
        await registry.close()


if __name__ == "__main__":
    raise SystemExit(main())
