"""The benchmark tables of docs/benchmarks.md and the README, read from the results files.

Neither quotes a number by hand: ``python -m bench.readme`` prints both tables from
``bench/results-*.md`` (docs/benchmarks.md has every measure, the README a few headlines) and
a test keeps the copies equal to them. Re-run a benchmark, then ``python -m bench.readme
--write``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BENCH = Path(__file__).resolve().parent
README = BENCH.parent / "README.md"
BENCHMARKS = BENCH.parent / "docs" / "benchmarks.md"
BEGIN = "<!-- bench.readme: begin -->"
END = "<!-- bench.readme: end -->"
Row = dict[str, str]
Measure = tuple[str, str, str]  # what, the value, the results file
LENS_ROW = (
    "logit lens, 32 layers x 512 tokens, 128256 x 2048 head, vs /topk of the same rows: served;"
    " engine; peak MB beyond the loaded process (bound)"
)
#: The README's rows of the whole table (what a newcomer asks first: speed, batching, swaps).
README_ROWS = (
    "64-row `.npy` requests, 16 clients, vs a bare onnxruntime session",
    "dynamic batching on / off, 64 one-row clients",
    "failed requests across tied/untied hot swaps under load",
    "demo head, 1000 allowed tokens vs the whole head: 64 rows `.npy`; 1 row JSON",
    "tied 50257 x 768 head resident, `shared` / `fast` mode (x W)",
    LENS_ROW,
)


def tables(name: str) -> list[list[Row]]:
    """Every markdown table in ``bench/<name>``, as rows keyed by the header cells."""
    found: list[list[Row]] = []
    header: list[str] | None = None
    for line in (BENCH / name).read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells
            found.append([])
        elif not set(line) <= set("|-: "):
            found[-1].append(dict(zip(header, cells, strict=True)))
    return found


def machine(name: str) -> str:
    first = (BENCH / name).read_text(encoding="utf-8").splitlines()[0]
    return first.removeprefix("Machine: ").rstrip(".") if first.startswith("Machine") else ""


def pick(rows: list[Row], column: str, /, **match: str) -> str:
    for row in rows:
        if all(row.get(key) == value for key, value in match.items()):
            return row[column]
    raise KeyError(f"no row {match} with {column}")


def headlines(*, only: tuple[str, ...] = (), links: str = "../bench/") -> str:
    """The table between the markers: every measure, or those named in ``only``; results
    files linked from ``links`` (``bench/`` from the README)."""
    measures = [row for row in _measures() if not only or row[0] in only]
    main = machine("results-serve.md")
    lines = [
        BEGIN,
        f"Machine, unless a row names another: {main}.",
        "",
        "| measure | result | from |",
        "|---|---|---|",
    ]
    lines += [
        f"| {what} | {value} | {_source(name, main, links)} |" for what, value, name in measures
    ]
    return "\n".join([*lines, END])


def _measures() -> list[Measure]:
    serve, v2, batching = tables("results-serve.md")
    heads = tables("results-heads.md")[0]
    (swap,) = tables("results-swap.md")
    (shadow,) = tables("results-shadow.md")
    (ray,) = tables("results-ray.md")
    (protocols,) = tables("results-protocols.md")
    served, options, memory, prompt = tables("results-vocabulary.md")
    (client,) = tables("results-client.md")
    lens_served, lens_engine, lens_memory = tables("results-lens.md")
    workers = tables("results-workers.md")[0]
    (trimmed,) = [row["run"] for row in options if row["run"].startswith("head trimmed")]
    ray_1, ray_2 = {"served by": "Ray Serve, 1 replica"}, {"served by": "Ray Serve, 2 replicas"}
    at_64, at_1 = {"rows/req": "64", "clients": "16"}, {"rows/req": "1", "clients": "1"}
    gpu_memory, gpu_time, _, _ = tables("results-gpu.md")
    gpt2 = {"head": "tied fp32", "vocab x d": "50257 x 768"}
    int8 = {"head": "tied int8 b128", "vocab x d": "128256 x 2048"}
    int4 = {"head": "tied int4 b128", "vocab x d": "128256 x 2048"}
    rows: list[Measure] = [
        (
            "64-row `.npy` requests, 16 clients, vs a bare onnxruntime session",
            pick(serve, "vs bare session", body="npy", **{"rows/req": "64", "clients": "16"}),
            "results-serve.md",
        ),
        (
            "64-row JSON requests, 16 clients, vs a bare session",
            pick(serve, "vs bare session", body="json", **{"rows/req": "64", "clients": "16"}),
            "results-serve.md",
        ),
        (
            "dynamic batching on / off, 64 one-row clients",
            pick(batching, "speed-up", client="raw", batching="on"),
            "results-serve.md",
        ),
        (
            "V2 binary vs native `.npy`, 64 rows, 16 clients",
            pick(v2, "vs native npy", **{"API and body": "v2 binary", "clients": "16"}),
            "results-serve.md",
        ),
        (
            "tied 50257 x 768 head resident, `shared` / `fast` mode (x W)",
            f"{pick(heads, 'resident / W', **gpt2, **{'memory mode': 'shared'})} / "
            f"{pick(heads, 'resident / W', **gpt2, **{'memory mode': 'fast'})}",
            "results-heads.md",
        ),
        (
            "tied head time at 64 rows, `shared` vs `fast`",
            pick(heads, "vs fast @64", **gpt2, **{"memory mode": "shared"}),
            "results-heads.md",
        ),
        (
            "int8 / int4 tied 128256 x 2048 head: 1 row vs fp32; resident (x fp32 W)",
            f"{pick(heads, 'vs fp32 shared @1', **int8)} / "
            f"{pick(heads, 'vs fp32 shared @1', **int4)}; "
            f"{pick(heads, 'resident / W', **int8)} / {pick(heads, 'resident / W', **int4)}",
            "results-heads.md",
        ),
        (
            "failed requests across tied/untied hot swaps under load",
            " + ".join(
                f"{pick(swap, 'failed', head=h, swap='v1 -> v2 (untied)')} of "
                f"{pick(swap, 'requests', head=h, swap='v1 -> v2 (untied)')}"
                for h in ("demo 32000x512", "large 128256x2048")
            ),
            "results-swap.md",
        ),
        (
            "primary rows/s with 10% shadow traffic, vs none",
            pick(shadow, "vs no shadow", **{"shadow sampling": "10%"}),
            "results-shadow.md",
        ),
        (
            "H200, 128256 x 2048 tied head: device memory added, float32 / bfloat16 (x W)",
            f"{pick(gpu_memory, 'device / W', head='tied', dtype='float32')} / "
            f"{pick(gpu_memory, 'device / W', head='tied', dtype='bfloat16')}",
            "results-gpu.md",
        ),
        (
            "H200, same head, 64 rows: lmhead bfloat16 / torch bfloat16 (ms, host copies)",
            f"{pick(gpu_time, '64 rows', engine='lmhead bfloat16')} / "
            f"{pick(gpu_time, '64 rows', engine='torch bfloat16')}",
            "results-gpu.md",
        ),
        (
            "demo head, 1000 allowed tokens vs the whole head: 64 rows `.npy`; 1 row JSON",
            f"{pick(served, 'vs the whole head', request='64 rows .npy, allowed')}; "
            f"{pick(served, 'vs the whole head', request='1 row JSON, allowed')}",
            "results-vocabulary.md",
        ),
        (
            "128256 x 2048, 64 rows, vs the full head: 1000 / 10 allowed tokens; sampling",
            f"{pick(options, 'speed-up vs full head', run='1000 allowed tokens')} / "
            f"{pick(options, 'speed-up vs full head', run='10 allowed tokens')}; "
            f"{pick(options, 'speed-up vs full head', run='top-10 + sampling (top_p 0.9)')}",
            "results-vocabulary.md",
        ),
        (
            "that head trimmed to a quarter of its tokens: speed-up at 64 rows; resident memory",
            f"{pick(options, 'speed-up vs full head', run=trimmed)}; "
            f"{memory[1]['vs full']} of the full head's",
            "results-vocabulary.md",
        ),
        (
            "4096-position prompt log-probs vs plain top-k: time; peak extra MB",
            f"{pick(prompt, 'time vs plain', run='prompt scoring')}; "
            f"{pick(prompt, 'peak extra memory MB', run='prompt scoring')} vs "
            f"{pick(prompt, 'peak extra memory MB', run='plain top-10')}",
            "results-vocabulary.md",
        ),
        (
            LENS_ROW,
            f"{lens_served[1]['vs /topk']}; {lens_engine[1]['vs top-k']}; "
            f"{lens_memory[1]['MB']} ({lens_memory[2]['MB']})",
            "results-lens.md",
        ),
        (
            "`service.client` vs a hand-built `.npy` request: 64 rows; overhead at 1 row (ms)",
            f"{pick(client, 'client / hand-built', rows='64')}; "
            f"{pick(client, 'overhead ms', rows='1')}",
            "results-client.md",
        ),
        (
            "V2 over gRPC vs native `.npy`: 64 rows, 16 clients; 1-row p50 at 1 client (ms)",
            f"{pick(protocols, 'vs native npy', protocol='gRPC raw', **at_64)}; "
            f"{pick(protocols, 'p50 ms', protocol='gRPC raw', **at_1)} vs "
            f"{pick(protocols, 'p50 ms', protocol='native npy', **at_1)}",
            "results-protocols.md",
        ),
        (
            "`LMHEAD_WORKERS=2` vs one process, 2 cores: 64-row `.npy`, 16 clients; 1-row JSON, "
            "64 clients (demo / small head)",
            f"{_ratio(workers, 'npy', 'demo-tied', '16')}; "
            f"{_ratio(workers, 'json', 'demo-tied', '64')} / "
            f"{_ratio(workers, 'json', 'small', '64')}",
            "results-workers.md",
        ),
        (
            "Ray Serve, 1 / 2 replicas vs one process: 64 rows, 16 clients; 1-row p50 (ms)",
            f"{pick(ray, 'vs single process', **ray_1, **at_64)} / "
            f"{pick(ray, 'vs single process', **ray_2, **at_64)}; "
            f"{pick(ray, 'p50 ms', **ray_1, **at_1)} vs "
            f"{pick(ray, 'p50 ms', **{'served by': 'single process'}, **at_1)}",
            "results-ray.md",
        ),
    ]
    return rows


def _source(name: str, main: str, links: str) -> str:
    """The results file's link, with its machine where that is not the table's (a CPU with
    other vector instructions moves quantized heads' ratios; see ``bench.machine``)."""
    other = machine(name).split(";")[0]
    where = f" ({other})" if other and other != main.split(";")[0] else ""
    return f"[{name}]({links}{name}){where}"


def _ratio(rows: list[Row], kind: str, model: str, clients: str) -> str:
    """N = 2 vs N = 1 from ``results-workers.md`` (its bold stripped)."""
    load = f"{64 if kind == 'npy' else 1}-row {kind}, `{model}`"
    return pick(rows, "N vs N = 1", load=load, clients=clients, N="2").strip("*")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="replace the two copies")
    args = parser.parse_args()
    copies = {BENCHMARKS: headlines(), README: headlines(only=README_ROWS, links="bench/")}
    for path, table in copies.items():
        if not args.write:
            print(f"{path.name}:\n{table}\n")
            continue
        text = path.read_text(encoding="utf-8")
        start, end = text.index(BEGIN), text.index(END) + len(END)
        path.write_text(text[:start] + table + text[end:], encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
