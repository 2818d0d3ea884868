"""The benchmark scripts run at their CI sizes and exit 0 (speed is read from them by hand, never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_cost_runs_tiny():
    # Three arms, one length (CI time): each arm's loss is tested elsewhere; this checks the script runs
    # its children and prints the table. By hand: every arm at 2K and 4K on the real base.
    out = subprocess.run([sys.executable, "benchmarks/train_step_cost.py", "--tiny", "--repeat", "1",
                          "--arms", "plain,sim+distill,packed4"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["length", "arm"] and len(lines) == 1 + 3


def test_prep_throughput_runs_with_its_tokenizer_beside():
    out = subprocess.run([sys.executable, "benchmarks/prep_throughput.py", "--copies", "1", "--repeat", "1"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SMOKE FIGURE" in out.stdout and "tokenizer() tok/s" in out.stdout and "encode_batch_fast" in out.stdout
    assert len([line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]) == 2


def test_gpu_check_runs_tiny_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out", str(tmp_path / "g.json")],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    data = json.loads((tmp_path / "g.json").read_text())
    assert {r["status"] for r in data["train"] + data["inference"]} == {"ok"}
    assert {r["arm"] for r in data["train"]} == {"acre", "full"} and len(data["inference"]) == 2


def test_inference_cost_runs_small_with_the_closed_tail_the_refill_after_it_and_the_reused_pass_beside():
    out = subprocess.run([sys.executable, "benchmarks/inference_cost.py", "--sizes", "1500", "--repeats", "1",
                          "--questions", "1", "--close-tail", "--first-chunk", "512", "--stride", "256",
                          "--max-refill", "64", "--compare-fold", "--refill-after-tail", "--reuse-score-pass",
                          "--scoring-layers", "0"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ACRE closed tail (refill after it) (scoring pass reused)" in out.stdout and "closed tail: per question" in out.stdout and "error" not in out.stdout
    assert "full's floor (growing cache" in out.stdout and "ACRE's floor: question" in out.stdout
    assert "ACRE build" in out.stdout and "full build" in out.stdout and "against its floor" in out.stdout
    assert "ACRE against the floor at the measured rate of its own matrix shapes" in out.stdout
    assert "full against the floor at the measured rate of its own matrix shapes" in out.stdout
    assert "full decoding step:" in out.stdout and "with the grouped-KV switch alone" in out.stdout


def test_chunk_cost_times_a_chunk_over_a_long_memory_both_ways_beside_its_floor():
    out = subprocess.run([sys.executable, "benchmarks/chunk_cost.py", "--rounds", "1"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("P ")]
    assert len(rows) == 2 and all("mask once per forward" in r and "once per layer" in r and "floor" in r for r in rows)


def test_methods_cost_runs_small_with_each_methods_floor_beside():
    methods = "full,truncated,cachefocus,infoflow"
    out = subprocess.run([sys.executable, "benchmarks/methods_cost.py", "--sizes", "512", "--doc-tokens", "128", "--methods", methods,
                          "--layers", "4", "--new-tokens", "2"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1] for r in rows] == methods.split(",")
    assert all(float(r[-1]) > 0 and float(r[-2]) > 0 for r in rows)  # x floor and the floor itself


def test_cache_memory_shows_a_loaded_cache_s_raw_kv_in_file_pages_not_copied():
    out = subprocess.run([sys.executable, "benchmarks/cache_memory.py", "--threads", "1", "--tokens", "4000"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = float(out.stdout.strip().splitlines()[-1].split(":")[-1])
    assert "after 3 questions" in out.stdout and ratio < 0.5  # the load did not copy the L2 into memory of its own


def test_scorer_cost_times_every_scorer_and_selection_option():
    out = subprocess.run([sys.executable, "benchmarks/scorer_cost.py", "--lengths", "1024", "--repeat", "1",
                          "--threads", "1", "--layers", "2"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    from importlib import util

    spec = util.spec_from_file_location("scorer_cost", ROOT / "benchmarks" / "scorer_cost.py")
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith("1024 |")]
    assert len(rows) == 4 and len(rows[-1].split("|")) == 1 + len(module.OPTIONS)  # 3 scorers, then every option


def test_the_published_efficiency_tables_are_what_the_committed_runs_give():
    """docs/real-base/efficiency/README.md and the README's table are written by efficiency_report.py from the
    committed JSON: an edit to either by hand, or new data without the tables, fails here."""
    out = subprocess.run([sys.executable, "benchmarks/efficiency_report.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_full_attention_past_its_window_is_projected_from_its_measured_curve():
    from importlib import util

    spec = util.spec_from_file_location("efficiency_report", ROOT / "benchmarks" / "efficiency_report.py")
    report = util.module_from_spec(spec)
    spec.loader.exec_module(report)
    measured = {n: {"build_s": 2e-3 * n + 1e-7 * n * n, "ttft_s": 0.1 + 1e-4 * n, "decode_token_s": 0.2 + 1e-6 * n,
                    "peak_mib": 10 + 0.01 * n, "floor_build_s": 1e-3 * n, "floor_ttft_s": 0.05, "context_tokens": n,
                    "question_s": 1.0, "kv_attended": n}
                for n in (4096, 16384, 32768)}
    run = {"args": {"new_tokens": 8},
           "rows": [{"size": n, "acre": {"context_tokens": n}, "full": measured.get(n, {"error": "beyond"})}
                    for n in (4096, 16384, 32768, 65536)]}
    full = report.full_rows(run)
    assert not full[32768]["projected"] and full[65536]["projected"]
    n = 65536
    assert abs(full[n]["build_s"] - (2e-3 * n + 1e-7 * n * n)) < 1e-6 * full[n]["build_s"]
    assert abs(full[n]["ttft_s"] - (0.1 + 1e-4 * n)) < 1e-9 * n
    assert abs(full[n]["question_s"] - (full[n]["ttft_s"] + 7 * full[n]["decode_token_s"])) < 1e-9
    assert "*projected*" in "\n".join(report.table(run | {"rows": [dict(r, acre={"error": "x"}) for r in run["rows"]]}))
