"""``/verify`` against a plain ``/topk`` of the same rows (issue 46's speed target: at most
1.25x; with ``draft_model``, at most 1.25x the two heads' ``/topk`` together): 64 sequences
of K = 4 drafts (320 rows: four drafted positions and one more) with the draft's
probabilities, with drafts taken as certain (a chain, and a tree: three children at the root,
one under the second), and with a draft head (d_model a quarter of the target's) computing
them; top-10 for the ``/topk``s (the draft head's of its own 256 rows).
Also the two requests' sizes on the wire (the client's ``.npz`` body and query): a
``draft_model`` request against one carrying ``draft_probs`` (the target: 20x smaller).

Engine: the data plane (no HTTP) in a worker process per build (``bench/verify_worker.py``),
calls interleaved call by call and build by build, median wall and CPU time per call (the
ratios hold on a shared machine better than the times). ``--baseline DIR``: an earlier
checkout (``git worktree add``) measured in the same run, beside this one. ``--profile``:
where a verification's time goes, beside the projections it runs.

    python -m bench.verify [--sizes 32000x512,128256x2048] [--rounds 7] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from bench.machine import describe_machine
from service.client.verify_call import verify_arrays_call
from service.heads.files import HeadWeights, save_head

SEQUENCES, DRAFTS = 64, 4
CALLS = ("topk", "topk_draft", "probs", "certain", "tree", "draft_model")
PROFILE = ("project_top10", "project_full")
WORKER = Path(__file__).with_name("verify_worker.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="32000x512,128256x2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="an earlier checkout to compare with")
    parser.add_argument("--profile", action="store_true", help="the projections beside")
    args = parser.parse_args(argv)
    print(describe_machine())
    builds = {"after": Path.cwd()} | ({"before": args.baseline} if args.baseline else {})
    for name, path in builds.items():
        print(f"{name}: `{_revision(path)}`")
    print()
    print(
        "| head | build | /topk ms (CPU) | /verify draft_probs ms (CPU) | ratio wall (CPU) "
        "| /verify certain | ratio | draft head /topk | /verify draft_model "
        "| ratio to both /topk | /verify tree, certain | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for size in args.sizes.split(","):
        vocab, d_model = (int(part) for part in size.split("x"))
        rows, note = _measure(vocab, d_model, args.rounds, builds, args.profile)
        print("\n".join(rows), flush=True)
        notes.append(note)
    print()
    print("\n".join(notes))
    return 0


def _measure(
    vocab: int, d_model: int, rounds: int, builds: dict[str, Path], profile: bool
) -> tuple[list[str], str]:
    rng = np.random.default_rng(46)
    draft_d = d_model // 4
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        for name, width, seed in (("head", d_model, 46), ("drafter", draft_d, 47)):
            table = np.random.default_rng(seed).standard_normal((vocab, width), dtype=np.float32)
            save_head(HeadWeights.from_arrays(table / np.sqrt(width)), root / "models" / name / "1")
            del table
        hidden = rng.standard_normal((SEQUENCES, DRAFTS + 1, d_model), dtype=np.float32)
        probs = rng.dirichlet(np.full(vocab, 0.05), size=(SEQUENCES, DRAFTS)).astype(np.float32)
        ids = np.argmax(probs, axis=2)
        states = rng.standard_normal((SEQUENCES, DRAFTS, draft_d), dtype=np.float32)
        np.savez(root / "inputs.npz", hidden=hidden, ids=ids, probs=probs, draft_states=states)
        sizes = _sizes(hidden, ids, probs, states)
        del probs
        names = CALLS + (PROFILE if profile else ())
        times = _interleaved(root, builds, names, rounds)
    lines = []
    for build in builds:
        wall = {name: statistics.median(t[0] for t in times[build][name]) for name in names}
        cpu = {name: statistics.median(t[1] for t in times[build][name]) for name in names}
        lines.append(_row(vocab, d_model, build, wall, cpu))
        if profile:
            lines.append(_profile_row(vocab, d_model, build, wall, cpu))
    note = (
        f"{vocab} x {d_model}: a request with draft_probs {sizes[0] / 1e6:.1f} MB, with "
        f"draft_model (draft_hidden_states of d_model {draft_d}) {sizes[1] / 1e3:.1f} kB: "
        f"{sizes[0] / sizes[1]:.0f}x smaller."
    )
    return lines, note


def _sizes(hidden: Any, ids: Any, probs: Any, states: Any) -> tuple[int, int]:
    """Bytes on the wire (body and query) of the two requests, as the client sends them."""

    def size(draft_probs: Any, **options: Any) -> int:
        call = verify_arrays_call("head", hidden, ids, draft_probs, None, None, None, options)
        query = sum(len(key) + len(value) + 2 for key, value in (call.params or {}).items())
        return len(call.content or b"") + query

    with_model = size(None, draft_model="drafter", draft_hidden_states=states)
    return size(probs), with_model


def _interleaved(
    root: Path, builds: dict[str, Path], names: tuple[str, ...], rounds: int
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Each build's worker, the calls sent in turn, build by build; the first round warms."""
    workers = {}
    for build, path in builds.items():
        env = os.environ | {"PYTHONPATH": str(path.resolve())}
        workers[build] = subprocess.Popen(
            [sys.executable, str(WORKER), str(root)],
            cwd=path,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        build: {name: [] for name in names} for build in builds
    }
    try:
        for worker in workers.values():
            assert worker.stdout is not None
            json.loads(worker.stdout.readline())  # ready: its calls
        for round_ in range(rounds + 1):
            for name in names:
                for build, worker in workers.items():
                    answer = _ask(worker.stdin, worker.stdout, name)
                    if round_:
                        times[build][name].append(answer)
    finally:
        for worker in workers.values():
            if worker.stdin is not None:
                worker.stdin.close()
            worker.wait(timeout=120)
    return times


def _ask(stdin: IO[str] | None, stdout: IO[str] | None, name: str) -> tuple[float, float]:
    assert stdin is not None
    assert stdout is not None
    stdin.write(name + "\n")
    stdin.flush()
    wall, cpu = json.loads(stdout.readline())
    return float(wall), float(cpu)


def _row(
    vocab: int, d_model: int, build: str, wall: dict[str, float], cpu: dict[str, float]
) -> str:
    def ms(name: str) -> str:
        return f"{1000 * wall[name]:.1f} ({1000 * cpu[name]:.1f})"

    def ratio(name: str, *over: str) -> str:
        base_wall = sum(wall[o] for o in over)
        base_cpu = sum(cpu[o] for o in over)
        return f"{wall[name] / base_wall:.2f}x ({cpu[name] / base_cpu:.2f}x)"

    return (
        f"| {vocab} x {d_model} | {build} | {ms('topk')} | {ms('probs')} "
        f"| {ratio('probs', 'topk')} | {ms('certain')} | {ratio('certain', 'topk')} "
        f"| {ms('topk_draft')} | {ms('draft_model')} "
        f"| {ratio('draft_model', 'topk', 'topk_draft')} | {ms('tree')} "
        f"| {ratio('tree', 'topk')} |"
    )


def _profile_row(
    vocab: int, d_model: int, build: str, wall: dict[str, float], cpu: dict[str, float]
) -> str:
    return (
        f"| {vocab} x {d_model} | {build}: projections alone | top-10 of the 320 rows "
        f"{1000 * wall['project_top10']:.1f} ({1000 * cpu['project_top10']:.1f}) | "
        f"top-1 with full logits {1000 * wall['project_full']:.1f} "
        f"({1000 * cpu['project_full']:.1f}) | | | | | | | | |"
    )


def _revision(path: Path) -> str:
    found = subprocess.run(
        ["git", "-C", str(path), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip()[:80] or str(path)


if __name__ == "__main__":
    raise SystemExit(main())
