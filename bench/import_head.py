"""Benchmark ``lmhead import`` on a synthetic Llama-3-sized bf16 checkpoint (128256 x 2048).

Writes the checkpoint (embedding plus a trunk tensor the importer must skip), then runs the
import in a fresh process and reports its wall time and peak resident memory against the
float32 head's size.

    python -m bench.import_head [--vocab 128256] [--d-model 2048]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--d-model", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        source = root / "checkpoint"
        source.mkdir()
        rng = np.random.default_rng(0)
        table = rng.standard_normal((args.vocab, args.d_model), dtype=np.float32)
        tensors = {
            "model.embed_tokens.weight": table.astype(ml_dtypes.bfloat16),
            "model.layers.0.mlp.weight": np.ones((4096, args.d_model), ml_dtypes.bfloat16),
        }
        del table
        save_file(tensors, str(source / "model.safetensors"))
        (source / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
        del tensors
        command = [sys.executable, "-m", "service", "import", str(source), "--name", "big"]
        start = time.perf_counter()
        subprocess.run([*command, "--repository", str(root / "models")], check=True)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        head = args.vocab * args.d_model * 4
        checkpoint = (source / "model.safetensors").stat().st_size
        print(
            f"import of a {args.vocab} x {args.d_model} bf16 checkpoint ({checkpoint / 1e9:.2f} "
            f"GB): {seconds:.1f} s, peak RSS {peak / 1e9:.2f} GB = {peak / head:.2f}x the "
            f"float32 head ({head / 1e9:.2f} GB)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
