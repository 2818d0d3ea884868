"""The efficiency table and plot at length, written from the committed ``inference_cost.py`` JSON files.

    python benchmarks/efficiency_report.py            # writes docs/real-base/efficiency/README.md, efficiency.png
                                                      # and the README's short table between its markers
    python benchmarks/efficiency_report.py --check    # exit 1 if a written table differs from the data

Input: ``docs/real-base/efficiency/{export,paper}-geometry.json`` from (on a quiet machine)::

    python benchmarks/inference_cost.py --export shipped --text squad-v2-dev.json --tail-at-mean --close-tail \\
        --sizes 4096 16384 32768 65536 131072 --repeats 1 --questions 3 --new-tokens 8 --threads 2 \\
        --json docs/real-base/efficiency/export-geometry.json
    ... --geometry paper --no-full --json docs/real-base/efficiency/paper-geometry.json

and ``stored-path.json``, the card's own question path (the README's table when present)::

    python benchmarks/inference_cost.py --export shipped --text squad-v2-dev.json --tail-at-mean --close-tail \
        --sizes 2048 4096 8192 16384 32768 65536 131072 --repeats 1 --questions 3 --new-tokens 8 --threads 2 \
        --json docs/real-base/efficiency/stored-path.json

Full attention is measured up to the base's position window; past it, each of its figures is projected
from the measured ones (build: ``a n + b n^2``, least squares through the origin; time to first token,
decoding per token and peak memory: ``a + b n``) and marked *projected*.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "docs" / "real-base" / "efficiency"
RUNS = {"export": "export-geometry.json", "paper": "paper-geometry.json", "bands": "stored-bands.json",
        "stored": "stored-path.json"}
BEGIN, END = "<!-- efficiency table: benchmarks/efficiency_report.py -->", "<!-- end of efficiency table -->"


def load(name: str) -> dict | None:
    path = FOLDER / RUNS[name]
    return json.loads(path.read_text()) if path.is_file() else None


def _fit(points: list[tuple[float, float]], quadratic: bool) -> tuple[float, float]:
    """Least squares: ``y = a n + b n^2`` through the origin (quadratic) or ``y = a + b n``."""
    import numpy as np

    n = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    basis = np.stack([n, n * n] if quadratic else [np.ones_like(n), n], axis=1)
    coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
    return float(coef[0]), float(coef[1])


def full_rows(run: dict) -> dict[int, dict]:
    """Full attention per nominal size: measured where it ran, projected past that (``projected: True``)."""
    measured = {r["size"]: r["full"] for r in run["rows"] if "error" not in r["full"]}
    if not measured:
        return {}
    out = {size: {**r, "projected": False} for size, r in measured.items()}
    pts = [(r["context_tokens"], r) for r in measured.values()]
    fits = {"build_s": _fit([(n, r["build_s"]) for n, r in pts], True)}
    for key in ("ttft_s", "decode_token_s", "peak_mib", "floor_build_s", "floor_ttft_s"):
        fits[key] = _fit([(n, r[key]) for n, r in pts], key in ("floor_build_s",)) if len(pts) > 1 else (pts[0][1][key], 0.0)
    for row in run["rows"]:
        if row["size"] in out:
            continue
        n = row["acre"].get("context_tokens", row["size"]) if "error" not in row["acre"] else row["size"]
        guess = {key: (a * n + b * n * n) if key in ("build_s", "floor_build_s") else a + b * n
                 for key, (a, b) in fits.items()}
        new = run["args"]["new_tokens"]
        guess.update(question_s=guess["ttft_s"] + (new - 1) * guess["decode_token_s"], kv_attended=n,
                     context_tokens=n, projected=True)
        out[row["size"]] = guess
    return out


def _k(size: int) -> str:
    return f"{size // 1024}K"


def _s(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _floors(r: dict) -> str:
    shape = r.get("shape_floor_build_s")
    return f"{_s(r['floor_build_s'])}; {_s(shape)}" if shape else f"{_s(r['floor_build_s'])}; –"


def table(run: dict, full: dict[int, dict] | None = None) -> list[str]:
    """One markdown table: per context, ACRE (tail re-run), ACRE (closed tail) and full attention."""
    lines = ["| context | arm | build s (floor; at its shapes' rate) | build peak GiB | first token s (floor) | "
             "decode ms / token | question s | KV entries attended |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    full = full if full is not None else full_rows(run)
    for row in run["rows"]:
        acre, closed = row["acre"], row.get("acre_closed_tail")
        tokens = acre.get("context_tokens", row["size"])
        label = f"{_k(row['size'])} ({tokens:,})"
        if "error" not in acre:
            shut = _closed_label(closed or {})
            for name, r in (("ACRE, tail re-run (exact)", acre), (shut, closed)):
                if not r or "error" in r:
                    continue
                lines.append(f"| {label} | {name} | {_s(r['build_s'])} ({_floors(r)}) | "
                             f"{r['peak_mib'] / 1024:.1f} | {r['ttft_s']:.2f} ({r['floor_ttft_s']:.2f}) | "
                             f"{1e3 * r['decode_token_s']:.0f} | {r['question_s']:.2f} | {r['kv_attended']:,.0f} |")
                label = ""
        f = full.get(row["size"])
        if f:
            tag = " *projected*" if f["projected"] else ""
            floor = lambda key: f" ({_s(f[key])})" if key in f and not f["projected"] else ""  # noqa: E731
            build = f" ({_floors(f)})" if not f["projected"] else ""
            lines.append(f"| {label} | full attention{tag} | {_s(f['build_s'])}{build} | "
                         f"{f['peak_mib'] / 1024:.1f} | {f['ttft_s']:.2f}{floor('floor_ttft_s')} | "
                         f"{1e3 * f['decode_token_s']:.0f} | {f['question_s']:.2f} | {f['kv_attended']:,.0f} |")
    return lines


def _closed_label(closed: dict) -> str:
    """The closed arm's name from what it answered with."""
    name = "ACRE, closed tail"
    if closed.get("refill_after_tail"):
        name += ", refill after it"
    if closed.get("reuse_score_pass"):
        name += ", scoring pass reused"
    return name


def compact(run: dict, stored: bool = False) -> list[str]:
    """The README's table: one line per context, ACRE beside full attention (measured or projected).
    ``stored``: the closed arm is the card's own path, and its question time is the one shown."""
    shown = "ACRE as stored / tail re-run / full" if stored else "ACRE exact / closed tail / full"
    lines = [f"| context | build s: ACRE / full | first token s: {shown} | "
             "question s: ACRE / full | build peak GiB: ACRE / full | KV attended: ACRE / full |",
             "|---|---:|---:|---:|---:|---:|"]
    full = full_rows(run)
    for row in run["rows"]:
        acre, closed, f = row["acre"], row.get("acre_closed_tail") or {}, full.get(row["size"])
        if "error" in acre or not f:
            continue
        tag = "*" if f["projected"] else ""
        shut = f"{closed['ttft_s']:.2f}" if "ttft_s" in closed else "–"
        first = f"{shut} / {acre['ttft_s']:.2f}" if stored else f"{acre['ttft_s']:.2f} / {shut}"
        question = closed["question_s"] if stored and "question_s" in closed else acre["question_s"]
        lines.append(f"| {_k(row['size'])} | {_s(acre['build_s'])} / {_s(f['build_s'])}{tag} | "
                     f"{first} / {f['ttft_s']:.2f}{tag} | "
                     f"{question:.2f} / {f['question_s']:.2f}{tag} | "
                     f"{acre['peak_mib'] / 1024:.1f} / {f['peak_mib'] / 1024:.1f}{tag} | "
                     f"{acre['kv_attended']:,.0f} / {f['kv_attended']:,.0f} |")
    if any(f["projected"] for f in full.values()):
        lines += ["", "\\* projected from full attention's measured curve (past the base's window)."]
    return lines


def machine(run: dict) -> str:
    rows = [r["acre"] for r in run["rows"] if "error" not in r["acre"]]
    rates = [r["gflops"] for r in rows]
    return (f"2 threads, fp32, matmul {min(rates):.0f}-{max(rates):.0f} GFLOP/s measured in each run"
            if rates else "")


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_q, ax_m) = plt.subplots(1, 3, figsize=(14, 4.2))
    styles = {"export": "o-", "paper": "s--"}
    for name, run in runs.items():
        if name not in styles:  # the plot keeps to the two geometries over the whole length range
            continue
        ok = [r for r in run["rows"] if "error" not in r["acre"]]
        n = [r["acre"]["context_tokens"] for r in ok]
        ax_t.plot(n, [r["acre"]["build_s"] for r in ok], styles[name], label=f"ACRE build ({name} geometry)")
        ax_q.plot(n, [r["acre"]["ttft_s"] for r in ok], styles[name], label=f"ACRE first token ({name}, tail re-run)")
        closed = [r for r in ok if r.get("acre_closed_tail")]
        ax_q.plot([r["acre_closed_tail"]["context_tokens"] for r in closed],
                  [r["acre_closed_tail"]["ttft_s"] for r in closed], styles[name][0] + ":",
                  label=f"ACRE first token ({name}, closed tail)")
        ax_m.plot(n, [r["acre"]["peak_mib"] / 1024 for r in ok], styles[name], label=f"ACRE build peak ({name})")
    full = full_rows(runs["export"]) if "export" in runs else {}
    for projected, style in ((False, "k^-"), (True, "k^:")):
        part = sorted((f["context_tokens"], f) for f in full.values() if f["projected"] == projected)
        if projected and part:  # join the projection to the last measured point
            last = max((f["context_tokens"], f) for f in full.values() if not f["projected"])
            part = [last, *part]
        label = "full attention" + (" (projected)" if projected else "")
        ax_t.plot([n for n, _ in part], [f["build_s"] for _, f in part], style, label=label + " prefill")
        ax_q.plot([n for n, _ in part], [f["ttft_s"] for _, f in part], style, label=label)
        ax_m.plot([n for n, _ in part], [f["peak_mib"] / 1024 for _, f in part], style, label=label)
    for ax, title, unit in ((ax_t, "cache build (once per context)", "seconds"),
                            (ax_q, "time to first token (reused cache)", "seconds"),
                            (ax_m, "peak memory added by the build", "GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ACRE vs full attention on Qwen2.5-Coder-0.5B, 2 CPU cores, fp32 (benchmarks/efficiency_report.py)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SCORING_PASS = (
    "A question runs the scoring pass (its tokens through the layers up to the last scoring layer, over the L1 "
    "memory) and then the prefill (through all layers, over a few hundred entries). Full attention runs the same "
    "tokens once through all layers; at 2K-4K its question over the whole context costs little more than reading "
    "the weights, so the extra scoring pass puts ACRE above it there, and only from the length where full "
    "attention's attention over the context outweighs that pass is ACRE faster.")


REUSED = (
    "Up to 8,192 tokens the scoring pass is 4 layers deep and the prefill runs only the 20 above it, so a "
    "question runs each layer once, as full attention's does, over a few hundred entries instead of the "
    "context. Beyond that the band scores at layers 7+9 and runs them again in the prefill: reusing that deeper "
    "pass lost answers on dev (docs/selection.md).")


def targets(run: dict, title: str = "## Against the goals", why: str = SCORING_PASS) -> list[str]:
    """Where the run meets the cost goals and where not, each ratio computed from the rows."""
    full = full_rows(run)
    first, build, question = [], [], []
    for row in run["rows"]:
        acre, closed, f = row["acre"], row.get("acre_closed_tail") or {}, full.get(row["size"])
        if "error" in acre:
            continue
        tag = "*" if f and f["projected"] else ""
        if f and "ttft_s" in closed:
            first.append(f"{_k(row['size'])} {closed['ttft_s'] / f['ttft_s']:.2f}×{tag}")
        if acre.get("shape_floor_build_s"):
            build.append(f"{_k(row['size'])} {acre['build_s'] / acre['shape_floor_build_s']:.2f}×")
        if "question_s" in closed and closed.get("shape_floor_ttft_s"):
            floor = closed["shape_floor_ttft_s"] + closed["shape_floor_decode_s"]
            question.append(f"{_k(row['size'])} {closed['question_s'] / floor:.2f}×")
    growth = [f"{_k(row['size'])} {1e3 * row['acre']['build_s'] / row['acre']['context_tokens']:.1f}"
              for row in run["rows"] if "error" not in row["acre"]]
    asked = [f"{_k(row['size'])} {row['acre_closed_tail']['question_s']:.2f} (select {row['acre_closed_tail']['select_s']:.2f})"
             for row in run["rows"] if "question_s" in (row.get("acre_closed_tail") or {})]
    return [
        title, "",
        "- Growth: the build in ms per context token (flat when the build is linear in the context): "
        + ", ".join(growth) + "; a question with the closed tail, s (of which choosing the refill, which scans "
        "the raw keys): " + ", ".join(asked) + ".",
        "- First token with the closed tail against full attention's on its reused cache (goal: at most 1× from 4K, "
        "1.5× at 2K; * against a projection): " + ", ".join(first) + ". The closed tail costs the same whether the "
        "refill goes before it or after it (`refill_after_tail`, the setting that keeps the answers on dev, "
        "docs/selection.md). " + why,
        "- Build against its floor at its shapes' rate (goal 1.2×): " + ", ".join(build) + ".",
        "- A whole question (closed tail) against its floor at its shapes' rate (goal 1.3×): "
        + ", ".join(question) + ".", ""]


def memory_check(run: dict) -> list[str]:
    """The cache's bytes from the formula beside the measured figure, per context."""
    lines = ["| context | L2 (CPU) formula MiB | measured | L1 + rotated scoring keys (device) formula MiB | measured |",
             "|---|---:|---:|---:|---:|"]
    layers, kv_heads, dim, nbytes, score_layers = 24, 2, 64, 4, 2  # Qwen2.5-0.5B, fp32, two scoring layers
    for row in run["rows"]:
        acre = row["acre"]
        if "error" in acre:
            continue
        first, stride, interval = acre["geometry"][:3]
        l2_tokens = first + (acre["context_tokens"] - first) // stride * stride  # the finished chunks
        l2 = 2 * layers * kv_heads * dim * nbytes * l2_tokens
        l1 = 3 * layers * kv_heads * dim * nbytes * acre["num_l1"]
        rotated = score_layers * kv_heads * dim * nbytes * l2_tokens if acre["selection"].startswith("l2") else 0
        lines.append(f"| {_k(row['size'])} | {l2 / 2**20:,.1f} | {acre['cpu_kv_mib']:,.1f} | "
                     f"{(l1 + rotated) / 2**20:,.1f} | {acre['device_kv_mib']:,.1f} |")
    return lines


def report(runs: dict[str, dict]) -> tuple[str, str]:
    """``(docs page, README block)``."""
    export, paper = runs.get("export"), runs.get("paper")
    page = ["# ACRE's cost at length (generated by `benchmarks/efficiency_report.py`; do not edit by hand)", ""]
    readme = [BEGIN, ""]
    if export:
        first = next(r["acre"] for r in export["rows"] if "error" not in r["acre"])
        page += [f"Shipped adapter on the fetched 0.5B base, its geometry and selection ({first['selection']}; "
                 f"W0 {first['geometry'][0]}, S {first['geometry'][1]}, l {first['geometry'][2]}, W {first['geometry'][3]}, "
                 f"eta {first['geometry'][4]}); real text (SQuAD v2 dev paragraphs, their own questions); "
                 f"{machine(export)}. Each context is the nominal size minus half a stride, so ACRE's raw tail "
                 "has its mean length. 'first token' is a question's time to its first token on the reused cache; "
                 "floors (benchmarks/floors.py) price every FLOP at the run's matmul rate and each decoding step "
                 "at its weight-read time; 'at its shapes' rate' prices the weight products at the rate torch "
                 "reaches for the build's own row counts, measured in the same run.", "",
                 *[f"    {cmd}" for cmd in export.get("runs", [])], *([""] if export.get("runs") else []),
                 *table(export), "", "![efficiency](efficiency.png)", "",
                 "Memory of the bi-layer cache: formula against the measured bytes "
                 "(per token per layer: L2 `2·H_kv·D·b`, L1 `3·H_kv·D·b / l`, each scoring layer's rotated raw keys "
                 "`H_kv·D·b`; here H_kv 2, D 64, b 4, 24 layers):", "", *memory_check(export), "", *targets(export)]
        readme += [*compact(export), ""] if not runs.get("stored") else []
    if paper:
        full = full_rows(export) if export else {}
        page += ["## The paper's geometry", "",
                 "The same model and text, chunked as the paper does (W0 4096, S 2048, l 16, W 32K, eta 4096, "
                 "the L1-key scorer at the last layer). Full attention's rows are the export run's (its contexts are "
                 "half a stride shorter there).", "", *[f"    {cmd}" for cmd in paper.get("runs", [])],
                 *([""] if paper.get("runs") else []), *table(paper, full), ""]
    bands = runs.get("bands")
    if bands:
        first = next(r["acre"] for r in bands["rows"] if "error" not in r["acre"])
        page += ["## The stored length bands, the refill after the closed tail", "",
                 f"The shipped adapter's selection as its card stores it now, one per band of context lengths "
                 f"({first['selection']}), on the same text; the closed arm puts the refilled tokens after the "
                 "closed tail (`close_tail refill_after_tail`, which answered as the tail re-run does on dev, "
                 f"docs/selection.md). All three arms in one run per length; {machine(bands)}.", "",
                 *[f"    {cmd}" for cmd in bands.get("runs", [])], *([""] if bands.get("runs") else []),
                 *table(bands), "", *targets(bands, "### Against the goals (stored bands)")]
    stored = runs.get("stored")
    if stored:
        last = next(r["acre"] for r in reversed(stored["rows"]) if "error" not in r["acre"])  # the newest run's card
        page += ["## The card's question path", "",
                 f"The shipped adapter with its card's path ({last['selection']}): every band closes the raw tail "
                 "at build time and puts the refill after it, and up to 8,192 tokens a question scores at layer 3 "
                 "and its prefill starts above that pass (`reuse_score_pass`, docs/selection.md). The closed arm "
                 "answers that way (at 2K the run predates the card storing the closed path there, and its flags "
                 "`--close-tail --refill-after-tail` asked for the same path); the open arm re-runs the tail with "
                 "the same band's scorer. All "
                 f"three arms in one run per length; {machine(stored)}.", "",
                 *[f"    {cmd}" for cmd in stored.get("runs", [])], *([""] if stored.get("runs") else []),
                 *table(stored), "", *targets(stored, "### Against the goals (as stored)", why=REUSED)]
        readme += [*compact(stored, stored=True), ""]  # what a user of the card gets
    readme.append(END)
    return "\n".join(page) + "\n", "\n".join(readme)


def splice(text: str, block: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the written tables with the data; write nothing")
    args = parser.parse_args(argv)
    runs = {name: run for name in RUNS if (run := load(name)) is not None}
    if not runs:
        print(f"no runs in {FOLDER}", file=sys.stderr)
        return 1
    page, block = report(runs)
    readme_path = REPO / "README.md"
    readme = readme_path.read_text()
    page_path = FOLDER / "README.md"
    if args.check:
        pairs = [(page_path, page)] + ([(readme_path, splice(readme, block))] if BEGIN in readme else [])
        stale = [str(p) for p, want in pairs if not p.is_file() or p.read_text() != want]
        if stale:
            print("out of date (run benchmarks/efficiency_report.py): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    page_path.write_text(page)
    if BEGIN in readme:
        readme_path.write_text(splice(readme, block))
    plot(runs, FOLDER / "efficiency.png")
    print(f"wrote {page_path}, {FOLDER / 'efficiency.png'}" + (", README.md" if BEGIN in readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
