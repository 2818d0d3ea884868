"""What ACRE inference costs against full-context attention, on the same small model, on this machine.

For every context size: cache-build time (ACRE: streaming chunks into the bi-layer cache; full:
one prefill into a transformers KV cache), per-question latency with the cache reused (question
prefill + greedy decoding; ACRE adds scoring and refilling), peak memory over the run (process
RSS high-water mark, or the CUDA allocator's peak), and the KV bytes each keeps (ACRE: L1 on the
device, L2 in CPU memory). Every (method, size) runs in its own process so peaks do not mix.

    python benchmarks/inference_cost.py                       # 8K 16K 32K 64K, ~4-8 min on 2 CPU cores
    python benchmarks/inference_cost.py --sizes 4096 8192 --no-full --json out.json
    python benchmarks/inference_cost.py --model base:qwen2.5-coder-0.5b-instruct --sizes 8192 16384 32768 \
        --repeats 1 --threads 2        # the real base, ~25 min here (a 32K full prefill alone takes ~4 min)

Per question, the time is split: ACRE into scoring (the open chunk over the L1 cache), refill gather,
prefill (the open chunk, i.e. the raw tail of the unfinished last chunk plus the question, over the
refilled cache) and decoding; full attention into the question prefill and decoding. Each arm's build
and question are printed beside their floor (benchmarks/floors.py: the work the arm chose, at this
machine's matmul rate and read bandwidth measured in the same run).

The model is random (costs do not depend on weights): Qwen2-shaped, 2 layers, hidden 128, 2 query
heads / 1 KV head, fp32. Settings default to the paper's: W0 4096, S 2048, l 16, W 32K, eta 4096.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from floors import acre_build_work, build_floor, machine_rates, question_floor, shape_floor  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536], help="context tokens")
    p.add_argument("--model", default=None, help="a base folder or base:NAME instead of the tiny benchmark model "
                                                 "(e.g. base:qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--questions", type=int, default=2, help="questions per built cache")
    p.add_argument("--repeats", type=int, default=3,
                   help="builds per (method, size); the fastest build and the median question are reported "
                        "(other processes on a shared machine make single timings noisy)")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens decoded per question")
    p.add_argument("--first-chunk", type=int, default=4096)
    p.add_argument("--stride", type=int, default=2048)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--working-window", type=int, default=32768)
    p.add_argument("--max-refill", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: torch's); 1 is steadier on a machine shared with other jobs")
    p.add_argument("--no-full", action="store_true", help="skip the full-context baseline")
    p.add_argument("--no-acre", action="store_true", help="skip ACRE (e.g. to compare full attention's caches)")
    p.add_argument("--close-tail", action="store_true",
                   help="also ACRE with the raw tail closed into the cache at build time (a question runs only its own tokens)")
    p.add_argument("--full-cache", choices=["growing", "dynamic"], default="growing",
                   help="full attention's cache: growing (in place, its floor) or transformers' DynamicCache "
                        "(grows by concatenation: copies the whole cache every decoding step)")
    p.add_argument("--compare-fold", action="store_true",
                   help="also time full attention's decoding steps with the single-query fold (modeling/sdpa.py) "
                        "and with the grouped-KV switch alone, alternated in the same process")
    p.add_argument("--json", default=None, help="also write all figures to this file")
    p.add_argument("--_child", nargs=2, metavar=("METHOD", "SIZE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------- child side

def _model(args):
    from acre_train.modeling import attach_acre
    from acre_train.tiny import tiny_model

    if args.model:  # a real base (folder or base:NAME), fp32, with untrained L1 projections
        import torch
        from transformers import AutoModelForCausalLM

        from acre_train.base.fetch import resolve_source

        model = AutoModelForCausalLM.from_pretrained(resolve_source(args.model), dtype=torch.float32)
        return attach_acre(model).to(args.device).eval()
    longest = max(args.sizes) + args.question_tokens + args.new_tokens + 64
    model = tiny_model("qwen2", vocab_size=1024, eos_token_id=0, max_position_embeddings=longest,
                       hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    return attach_acre(model).to(args.device).eval()  # the same weights serve both methods


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(5, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_acre(args, size: int, close_tail: bool = False) -> dict:
    from acre_train.infer import AcreEngine, CacheSettings, RefillSettings
    from acre_train.measure import PeakMemory

    model = _model(args)
    engine = AcreEngine(model, cache_settings=CacheSettings(args.first_chunk, args.stride, args.interval),
                        refill=RefillSettings(working_window=args.working_window, max_refill=args.max_refill,
                                              max_new_tokens=args.new_tokens, stop_at_eos=False), close_tail=close_tail)
    engine.answer(engine.build(_tokens(args.first_chunk + 100, 0)), _tokens(8, 1))  # warm-up
    builds, latencies, answers = [], [], []
    with PeakMemory(args.device) as memory:
        for _ in range(args.repeats):
            cache = None  # free the previous cache before building the next one
            tic = time.perf_counter()
            cache = engine.build(_tokens(size, 2), progress=False)
            builds.append(time.perf_counter() - tic)
            engine.answer(cache, _tokens(args.question_tokens, 9))  # untimed: first-call costs (allocator, code paths)
            for q in range(args.questions):
                tic = time.perf_counter()
                answers.append(engine.answer(cache, _tokens(args.question_tokens, 10 + q)))
                latencies.append(time.perf_counter() - tic)
    sizes = cache.nbytes()
    a = answers[-1]
    rates = machine_rates(args.device)
    rows, pairs = acre_build_work(size, args.first_chunk, args.stride, args.interval)
    return {"build_s": min(builds), "question_s": statistics.median(latencies), "peak_mib": memory.added_bytes / 2**20,
            "device_kv_mib": sizes["l1"] / 2**20, "cpu_kv_mib": sizes["l2"] / 2**20,
            "working_cache_mib": _kv_mib(model, a.cache_length), "num_l1": cache.num_l1, "k": a.k,
            "cache_length": a.cache_length, "open_chunk": a.open_chunk, **{k: v for k, v in a.timings.items()},
            **rates, "floor_build_s": build_floor(model, rows=rows, pairs=pairs, rates=rates),
            **acre_floor(model, engine, a, args.new_tokens, rates)}


def acre_floor(model, engine, answer, new_tokens: int, rates: dict[str, float]) -> dict[str, float]:
    """ACRE's question floor: the scoring pass (the open chunk through the scoring layers, over the L1
    cache), the open chunk's prefill over the refilled cache, then decoding over both."""
    n, cache_len = answer.open_chunk, answer.cache_length
    layers = engine.refill.scorer.resolved_layers(model.config.num_hidden_layers)
    depth = (max(layers) + 1) / model.config.num_hidden_layers  # the scoring pass stops at its last layer
    score = question_floor(model, rows=n, keys=answer.num_l1 + n / 2, new_tokens=1, rates=rates)["floor_prefill_s"]
    rest = question_floor(model, rows=n, keys=cache_len + n / 2, new_tokens=new_tokens, rates=rates)
    return {"floor_score_s": depth * score, "floor_prefill_s": rest["floor_prefill_s"],
            "floor_decode_s": rest["floor_decode_s"], "floor_question_s": depth * score + rest["floor_question_s"],
            "shape_floor_score_s": depth * shape_floor(model, rows=n, keys=answer.num_l1 + n / 2, rates=rates),
            "shape_floor_prefill_s": shape_floor(model, rows=n, keys=cache_len + n / 2, rates=rates),
            "shape_floor_decode_s": (new_tokens - 1) * shape_floor(model, rows=1, keys=cache_len + n, rates=rates)}


def full_floor(model, context: int, question: int, new_tokens: int, rates: dict[str, float]) -> dict[str, float]:
    """Full attention's floor: the question's rows over context + question, then decoding over them."""
    floor = question_floor(model, rows=question, keys=context + question, new_tokens=new_tokens, rates=rates)
    return {**floor, "shape_floor_prefill_s": shape_floor(model, rows=question, keys=context + question, rates=rates),
            "shape_floor_decode_s": (new_tokens - 1) * shape_floor(model, rows=1, keys=context + question, rates=rates)}


def run_full(args, size: int) -> dict:
    import torch

    from acre_train.infer.growing_cache import GrowingCache
    from acre_train.measure import PeakMemory
    from acre_train.modeling.sdpa import grouped_kv_sdpa

    model = _model(args)
    device = args.device
    rates = machine_rates(device)

    def new_cache(n: int):
        return GrowingCache(capacity=n + args.question_tokens + args.new_tokens) if args.full_cache == "growing" else None

    def ask(cache, question: list[int]) -> dict[str, float]:
        """Greedy answer over the reused cache; the first forward is the question prefill, the rest decoding."""
        ids = torch.tensor([question], device=device)
        split = {"prefill_s": 0.0, "decode_s": 0.0}
        for step in range(args.new_tokens):
            tic = time.perf_counter()
            with grouped_kv_sdpa(device):  # as the product's full row does (eval/methods/full.py)
                out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            split["prefill_s" if step == 0 else "decode_s"] += time.perf_counter() - tic
        return split

    with torch.no_grad():
        warm = model(torch.tensor([_tokens(512, 0)], device=device), cache=new_cache(512), use_cache=True,
                     logits_to_keep=1).cache
        ask(warm, _tokens(8, 1))
        del warm
        builds, latencies, splits = [], [], []
        with PeakMemory(device) as memory:
            for _ in range(args.repeats):
                cache = None  # free the previous cache before building the next one
                tic = time.perf_counter()
                cache = model(torch.tensor([_tokens(size, 2)], device=device), cache=new_cache(size), use_cache=True,
                              logits_to_keep=1).cache
                builds.append(time.perf_counter() - tic)
                for q in range(-1, args.questions):  # q = -1: untimed first question, as for ACRE
                    tic = time.perf_counter()
                    split = ask(cache, _tokens(args.question_tokens, 10 + q))
                    if q >= 0:
                        latencies.append(time.perf_counter() - tic)
                        splits.append(split)
                    cache.crop(size - cache.get_seq_length())  # back to the context alone: the next question reuses it
        fold = _fold_ab(model, cache, size, args.new_tokens) if args.compare_fold else {}
    kv = _kv_mib(model, size)
    return {"build_s": min(builds), "floor_build_s": build_floor(model, rows=size, pairs=size * (size + 1) / 2, rates=rates), "question_s": statistics.median(latencies), "peak_mib": memory.added_bytes / 2**20,
            "device_kv_mib": kv, "cpu_kv_mib": 0.0, "working_cache_mib": kv, "cache_length": size,
            "cache": args.full_cache, **rates, **full_floor(model, size, args.question_tokens, args.new_tokens, rates),
            **{key: statistics.median(s[key] for s in splits) for key in ("prefill_s", "decode_s")}, **fold}


def _fold_ab(model, cache, size: int, steps: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds per decoding step over the ``size``-token cache with the single-query fold and with the
    grouped-KV switch alone (set by hand, which leaves :func:`grouped_kv_sdpa` out), alternated."""
    import torch

    from acre_train.modeling.sdpa import FORCE_GQA, grouped_kv_sdpa

    times: dict[str, list[float]] = {"fold_step_s": [], "switch_step_s": []}
    device = model.lm_head.weight.device
    user_setting = os.environ.pop(FORCE_GQA, None)  # set, it would turn the fold off in both arms
    for _ in range(rounds):
        for key in times:
            if key == "switch_step_s":
                os.environ[FORCE_GQA] = "1"
            ids = torch.tensor([[7]], device=device)
            tic = time.perf_counter()
            for _ in range(steps):
                with grouped_kv_sdpa(device):
                    ids = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            times[key].append((time.perf_counter() - tic) / steps)
            os.environ.pop(FORCE_GQA, None)
            cache.crop(size - cache.get_seq_length())
    if user_setting is not None:
        os.environ[FORCE_GQA] = user_setting
    return {key: statistics.median(v) for key, v in times.items()}


def _kv_mib(model, tokens: int) -> float:
    cfg = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * tokens * 4 / 2**20


# ------------------------------------------------------------------------------------- parent side

def measure(args, method: str, size: int) -> dict:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--_child", method, str(size)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._child:
        import torch

        torch.manual_seed(0)
        if args.threads:
            torch.set_num_threads(args.threads)
        method, size = args._child[0], int(args._child[1])
        result = run_acre(args, size, close_tail=method == "acre-closed") if method.startswith("acre") else run_full(args, size)
        print(json.dumps(result))
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.model or f"qwen2-shaped, {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads"
    print(f"model: {shape}, fp32, {args.device}; torch {torch.__version__}, {torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.1f}")
    print(f"ACRE: W0 {args.first_chunk}, S {args.stride}, l {args.interval}, W {args.working_window}, "
          f"eta {args.max_refill}; {args.questions} questions of {args.question_tokens} tokens, "
          f"{args.new_tokens} new tokens each; fastest of {args.repeats} builds, median question\n")
    rows = []
    for size in args.sizes:
        acre = {"error": "skipped"} if args.no_acre else measure(args, "acre", size)
        closed = measure(args, "acre-closed", size) if args.close_tail else None
        full = {"error": "skipped"} if args.no_full else measure(args, "full", size)
        rows.append({"size": size, "acre": acre, "full": full, **({"acre_closed_tail": closed} if closed else {})})
        _print_row(size, acre, full, closed)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "_child"},
                                               "rows": rows}, indent=2))
    return 0


def _print_row(size: int, acre: dict, full: dict, closed: dict | None = None) -> None:
    def ratio(key: str) -> str:
        if "error" in acre or "error" in full or not acre.get(key):
            return "  n/a"
        return f"{full[key] / acre[key]:5.2f}x"

    print(f"context {size:>6} tokens")
    for name, r in (("ACRE", acre), *((("ACRE closed tail", closed),) if closed else ()), ("full", full)):
        if "error" in r:
            print(f"  {name:<5} {r['error']}")
            continue
        extra = f", {r['num_l1']} L1 entries, k={r['k']}, refilled cache {r['cache_length']}" if name.startswith("ACRE") else ""
        split = " + ".join(f"{key[:-2]} {r[key]:.3f}" for key in ("score_s", "refill_s", "prefill_s", "decode_s") if key in r)
        print(f"  {name:<5} build {r['build_s']:7.2f}s | per question {r['question_s']:6.3f}s | peak +{r['peak_mib']:7.1f} MiB"
              f" | KV on device {r['device_kv_mib']:6.1f} MiB, in CPU memory {r['cpu_kv_mib']:6.1f} MiB{extra}")
        print(f"        per question: {split} s")
    print(f"  full / ACRE: build {ratio('build_s')}, per question {ratio('question_s')}, peak memory {ratio('peak_mib')}, "
          f"device KV {ratio('device_kv_mib')}, attended cache {ratio('working_cache_mib')}")
    for name, r in (("ACRE", acre), ("full", full)):
        if "floor_build_s" in r:
            print(f"  {name} build {r['build_s']:.2f}s against its floor {r['floor_build_s']:.2f}s "
                  f"({r['build_s'] / r['floor_build_s']:.2f}x), peak +{r['peak_mib']:.0f} MiB")
    if "floor_question_s" in acre:
        print(f"  ACRE's floor: question {acre['floor_question_s']:.3f}s = score {acre['floor_score_s']:.3f} + prefill "
              f"{acre['floor_prefill_s']:.3f} + decode {acre['floor_decode_s']:.3f} (open chunk {acre['open_chunk']} tokens); "
              f"measured {acre['question_s']:.3f}s = {acre['question_s'] / acre['floor_question_s']:.2f}x the floor "
              f"(score {acre['score_s'] / acre['floor_score_s']:.2f}x, prefill {acre['prefill_s'] / acre['floor_prefill_s']:.2f}x, "
              f"decode {acre['decode_s'] / max(acre['floor_decode_s'], 1e-9):.2f}x)")
    if "floor_question_s" in full:
        print(f"  full's floor ({full['cache']} cache; matmul {full['gflops']:.0f} GFLOP/s, read {full['gemv_gbps']:.1f} GB/s "
              f"by matrix-vector, {full['gbps']:.1f} by sum, measured now): question {full['floor_question_s']:.3f}s = prefill {full['floor_prefill_s']:.3f} + decode "
              f"{full['floor_decode_s']:.3f}; measured {full['question_s']:.3f}s = {full['question_s'] / full['floor_question_s']:.2f}x "
              f"the floor (prefill {full['prefill_s'] / full['floor_prefill_s']:.2f}x, decode "
              f"{full['decode_s'] / max(full['floor_decode_s'], 1e-9):.2f}x)")
    for name, r in (("ACRE", acre), ("full", full)):
        if "shape_floor_prefill_s" in r:
            parts = [f"{part} {r[part + '_s'] / r['shape_floor_' + part + '_s']:.2f}x" for part in ("score", "prefill", "decode")
                     if r.get("shape_floor_" + part + "_s")]
            print(f"  {name} against the floor at the measured rate of its own matrix shapes (the question's rows; "
                  f"one row per decoding step): {', '.join(parts)}")
    if "fold_step_s" in full:
        print(f"  full decoding step: {1e3 * full['fold_step_s']:.1f} ms with one query's heads folded into rows, "
              f"{1e3 * full['switch_step_s']:.1f} ms with the grouped-KV switch alone "
              f"({full['switch_step_s'] / full['fold_step_s']:.2f}x; alternated, median)")
    if closed and "error" not in closed and "error" not in acre:
        print(f"  closed tail: per question {closed['question_s']:.3f}s vs {acre['question_s']:.3f}s open "
              f"({acre['question_s'] / closed['question_s']:.2f}x faster), build {closed['build_s']:.2f}s")


if __name__ == "__main__":
    sys.exit(main())
