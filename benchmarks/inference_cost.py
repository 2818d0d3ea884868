"""What ACRE inference costs against full-context attention, on the same model, on this machine.

For every context size: the cache build (ACRE: streaming chunks into the bi-layer cache; full: one
prefill into a KV cache), each question on the reused cache (time to first token, decoding per token,
the whole answer; ACRE adds scoring and refilling), the KV entries each question attends, peak memory
(process RSS high-water mark, or the CUDA allocator's peak) and the KV bytes each keeps (ACRE: L1 on
the device, L2 in CPU memory). Every (method, size) runs in its own process so peaks do not mix, and
every figure is printed beside its floor (benchmarks/floors.py: the work the arm chose, at this
machine's rates measured in the same run).

    python benchmarks/inference_cost.py                       # tiny random model, random ids, 8K..64K
    python benchmarks/inference_cost.py --export shipped --text ../shared/data/squad-v2-dev.json \
        --sizes 4096 16384 32768 65536 131072 --repeats 1 --questions 4 --threads 2 --json out.json
    python benchmarks/inference_cost.py --export shipped --geometry paper --text ...   # W0 4096, S 2048, l 16

``--export shipped`` answers with the adapter that ships with acre-train on the fetched 0.5B base, with
the geometry and refill selection of its card (what ``acre-train quickstart`` and ``chat`` run);
``--export DIR`` with any export's stored settings. ``--geometry paper`` keeps the model but chunks as
the paper does (W0 4096, S 2048, l 16, W 32K, eta 4096, the L1-key scorer at the last layer).
``--text`` reads a SQuAD-format file: the context is its paragraphs in order, cut at the size, and the
questions are those of the paragraphs it holds, rendered by the export's prompt for both arms. Full
attention runs up to ``--full-max`` tokens (default: the base's position window); past that it is
projected from the measured sizes by ``benchmarks/efficiency_report.py``, which writes the docs' table
and plot from the JSON files.

Per question, ACRE's time is split: the scoring pass (the question over the L1 cache and the raw tail's
KV, kept from the build), selection (ranking spans and choosing tokens), refill (gathering the chosen
L2 tokens and rotating the cache), prefill (the open chunk: the raw tail and the question over the
refilled cache; with ``--close-tail`` the question alone) and decoding. Full attention's: the question
prefill and decoding.

Without ``--export`` the model is random (costs do not depend on weights): Qwen2-shaped, 2 layers,
hidden 128, 2 query heads / 1 KV head, fp32. Settings then default to the paper's: W0 4096, S 2048,
l 16, W 32K, eta 4096.
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

from floors import (acre_build_work, build_floor, build_shape_floor, machine_rates, question_floor,  # noqa: E402
                    shape_floor)


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
    p.add_argument("--refill-after-tail", action="store_true",
                   help="with --close-tail: the closed arm puts the refilled tokens after the closed tail, next to the "
                        "question (selection word refill_after_tail)")
    p.add_argument("--reuse-score-pass", action="store_true",
                   help="with --close-tail: the closed arm takes the question's layers up to the last scoring layer "
                        "from its scoring pass (selection word reuse_score_pass)")
    p.add_argument("--scoring-layers", type=int, nargs="+", default=None,
                   help="the scorer's layers instead of the stored (or default) ones, e.g. 0 for the random model with "
                        "--reuse-score-pass (which needs a scoring layer below the last)")
    p.add_argument("--full-cache", choices=["growing", "dynamic"], default="growing",
                   help="full attention's cache: growing (in place, its floor) or transformers' DynamicCache "
                        "(grows by concatenation: copies the whole cache every decoding step)")
    p.add_argument("--compare-fold", action="store_true",
                   help="also time full attention's decoding steps with the single-query fold (modeling/sdpa.py) "
                        "and with the grouped-KV switch alone, alternated in the same process")
    p.add_argument("--export", default=None,
                   help="answer with an export's model and stored settings: a folder, or 'shipped' (the shipped "
                        "stage 1+2 adapter on the fetched 0.5B base, as the quickstart runs it)")
    p.add_argument("--geometry", choices=["export", "paper"], default="export",
                   help="with --export: its stored geometry and selection, or the paper's (W0 4096, S 2048, "
                        "l 16, W 32K, eta 4096, the L1-key scorer at the last layer)")
    p.add_argument("--text", default=None, help="a SQuAD-format JSON file: real text and its questions "
                                                 "(default: random token ids)")
    p.add_argument("--tail-at-mean", action="store_true",
                   help="contexts of SIZE - S/2 tokens: ACRE's raw tail (re-run by every question) at its mean length; "
                        "sizes that are multiples of S otherwise leave no tail at all")
    p.add_argument("--full-max", type=int, default=None,
                   help="full attention runs up to this many context tokens (default: the model's position window)")
    p.add_argument("--json", default=None, help="also write all figures to this file")
    p.add_argument("--_child", nargs=2, metavar=("METHOD", "SIZE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------- child side

PAPER = {"first_chunk": 4096, "stride": 2048, "interval": 16, "working_window": 32768, "max_refill": 4096,
         "scorer": "l1:layers=-1", "grow": 0, "neighbors": False}


def _setup(args):
    """``(model, tokenizer or None, cache settings, refill settings)`` of the run."""
    import torch

    from acre_train.infer import CacheSettings, RefillSettings
    from acre_train.modeling import attach_acre

    decoding = {"max_new_tokens": args.new_tokens, "stop_at_eos": False}
    if args.export:
        from acre_train.infer.load import load_export
        from acre_train.infer.settings import inference_settings

        model, tokenizer, data = load_export(_export_dir(args.export), device=args.device, dtype=torch.float32)
        overrides = dict(PAPER) if args.geometry == "paper" else {}
        cache, refill = inference_settings(data, {**overrides, "scoring_layers": args.scoring_layers})
        return model, tokenizer, cache, refill.replace(**decoding)
    if args.model:  # a real base (folder or base:NAME), fp32, with untrained L1 projections
        from transformers import AutoModelForCausalLM

        from acre_train.base.fetch import resolve_source

        model = AutoModelForCausalLM.from_pretrained(resolve_source(args.model), dtype=torch.float32)
        model = attach_acre(model).to(args.device).eval()
    else:
        from acre_train.tiny import tiny_model

        longest = max(args.sizes) + args.question_tokens + args.new_tokens + 64
        model = tiny_model("qwen2", vocab_size=1024, eos_token_id=0, max_position_embeddings=longest,
                           hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
        model = attach_acre(model).to(args.device).eval()  # the same weights serve both methods
    refill = RefillSettings(working_window=args.working_window, max_refill=args.max_refill, **decoding)
    if args.scoring_layers:
        refill = refill.replace(scorer=f"l1:layers={'+'.join(map(str, args.scoring_layers))}")
    return model, None, CacheSettings(args.first_chunk, args.stride, args.interval), refill


def _export_dir(name: str) -> Path:
    if name != "shipped":
        return Path(name)
    from acre_train.quickstart import shipped_adapter_export

    return shipped_adapter_export(REPO / "checkpoints" / "benchmarks" / "shipped-export")


def _workload(args, size: int, tokenizer, stride: int) -> tuple[list[int], list[list[int]]]:
    """``(context ids, question ids)``: ``size`` context tokens (``--tail-at-mean``: ``size - stride / 2``, so
    ACRE's raw tail has its mean length over all context lengths) and ``questions + 2`` questions (one warms
    up, one is untimed); real text and its own questions with ``--text``, random ids otherwise."""
    count = args.questions + 2
    size = size - stride // 2 if args.tail_at_mean else size
    if not args.text:
        return _tokens(size, 2), [_tokens(args.question_tokens, 9 + q) for q in range(count)]
    from acre_train.data.prompt import PromptFormat

    prompt = PromptFormat(tokenizer)
    data = json.loads(Path(args.text).read_text(encoding="utf-8"))
    paragraphs = [p for article in data["data"] for p in article["paragraphs"]]
    text, asked, words = "", [], 0
    for p in paragraphs:  # whole paragraphs while they fit (~1.3 tokens a word is plenty), then cut in tokens
        if words > size:
            break
        text += ("\n\n" if text else "") + p["context"]
        words += len(p["context"].split())
        asked += [q["question"] for q in p["qas"] if q.get("answers")][:1]
    ids = prompt.context_ids(text)
    if len(ids) < size:
        raise SystemExit(f"{args.text} holds {len(ids)} tokens of text, fewer than {size}")
    held = ids[:size]
    inside = [q for i, q in enumerate(asked) if i < len(asked) * size / len(ids)]  # asked of what the cut keeps
    step = max(1, len(inside) // count)
    return held, [prompt.question_ids(q) for q in inside[::step][:count]]


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(5, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_acre(args, size: int) -> dict:
    """One build per context; its questions answered with the raw tail open (``open``) and, with
    ``--close-tail``, on the same cache with the tail closed (``closed``)."""
    from acre_train.infer import AcreEngine
    from acre_train.measure import PeakMemory

    model, tokenizer, cache_settings, refill = _setup(args)
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    context, questions = _workload(args, size, tokenizer, cache_settings.stride)
    warm_size = min(len(context), cache_settings.first_chunk + cache_settings.stride + 100)
    engine.answer(engine.build(context[:warm_size], progress=False), questions[0])  # warm-up
    builds = []
    with PeakMemory(args.device) as memory:
        for _ in range(args.repeats):
            cache = None  # free the previous cache before building the next one
            tic = time.perf_counter()
            cache = engine.build(context, progress=False)
            builds.append(time.perf_counter() - tic)
            engine.answer(cache, questions[1])  # untimed: first-call costs (allocator, code paths, rotated keys)
            tails = (False, True) if args.close_tail else (False,)
            answered = {closed: _ask_acre(engine, cache, questions[2:], _path(args, closed)) for closed in tails}
    rates = machine_rates(args.device)
    chunks: list[int] = []
    rows, pairs = acre_build_work(len(context), cache_settings.first_chunk, cache_settings.stride, cache_settings.interval,
                                  chunks)
    tail = int(cache.tail_keys.shape[2]) if cache.tail_keys is not None else 0
    rows, pairs = rows + tail, pairs + tail * cache.num_l1 + tail * (tail + 1) // 2  # the build runs the raw tail once
    chunks += [tail] if tail else []
    sizes = cache.nbytes()
    shared = {"build_s": min(builds), "peak_mib": memory.added_bytes / 2**20, "context_tokens": len(context),
              "device_kv_mib": sizes["l1"] / 2**20, "cpu_kv_mib": sizes["l2"] / 2**20, "num_l1": cache.num_l1,
              "selection": engine.refill.describe_selection(),
              "geometry": [cache_settings.first_chunk, cache_settings.stride, cache_settings.interval,
                           refill.working_window, refill.max_refill],
              **rates, "floor_build_s": build_floor(model, rows=rows, pairs=pairs, rates=rates),
              "shape_floor_build_s": build_shape_floor(model, chunks=chunks, pairs=pairs, rates=rates)}
    out = {}
    for closed, (answers, totals) in answered.items():
        a = answers[-1]
        tail = int(cache.tail_keys.shape[2]) if cache.tail_keys is not None else 0
        used = engine.settings_for(cache, **_path(args, closed))  # the length band's, with the arm's path
        out["closed" if closed else "open"] = {
            **shared, "question_s": statistics.median(totals), "tail_plan": tail,
            "answered_with": used.selection.describe(),
            "refill_after_tail": used.refill_after_tail, "reuse_score_pass": used.reuse_score_pass,
            "ttft_s": statistics.median(x.timings["score_s"] + x.timings["refill_s"] + x.timings["prefill_s"] for x in answers),
            "decode_token_s": statistics.median(x.timings["decode_s"] / max(1, len(x.token_ids) - 1) for x in answers),
            "working_cache_mib": _kv_mib(model, a.cache_length), "k": a.k, "cache_length": a.cache_length,
            "kv_attended": statistics.median(x.cache_length + x.open_chunk + (tail if closed else 0) for x in answers),
            "open_chunk": a.open_chunk,
            **{key: statistics.median(x.timings.get(key, 0.0) for x in answers)
               for key in ("score_s", "score_pass_s", "select_s", "refill_s", "prefill_s", "decode_s")},
            **acre_floor(model, engine, cache, a, args.new_tokens, rates, closed, used.reuse_score_pass)}
    return out


def _path(args, closed: bool) -> dict:
    """The question-path overrides of an arm: the open arm re-runs the raw tail (every path option off);
    the closed arm closes it and keeps the stored placement and reuse unless the flags ask for them."""
    if not closed:
        return {"close_tail": False, "refill_after_tail": False, "reuse_score_pass": False}
    asked = {"refill_after_tail": args.refill_after_tail, "reuse_score_pass": args.reuse_score_pass}
    return {"close_tail": True, **{key: True for key, on in asked.items() if on}}


def _ask_acre(engine, cache, questions: list[list[int]], path: dict):
    """``(answers, seconds each)`` of ``questions`` on ``cache`` with the question-path overrides ``path``;
    the length band's selection otherwise."""
    answers, totals = [], []
    for q in questions:
        tic = time.perf_counter()
        answers.append(engine.answer(cache, q, **path))
        totals.append(time.perf_counter() - tic)
    return answers, totals


def acre_floor(model, engine, cache, answer, new_tokens: int, rates: dict[str, float], close_tail: bool,
               reuse: bool = False) -> dict[str, float]:
    """ACRE's question floor: the scoring pass (the question through the scoring layers, over the L1 cache
    and the tail's kept KV), the raw-key scan (``l2``: the question's logits over every raw key of the
    scoring layers), the prefill (open chunk, or the question alone with a closed tail, over the refilled
    cache; ``reuse``: only the layers above the scoring pass's), then decoding over both."""
    tail = int(cache.tail_keys.shape[2]) if cache.tail_keys is not None else 0
    n, cache_len = answer.open_chunk, answer.cache_length
    question = n - tail if not close_tail else n  # rows the scoring pass runs
    scorer = engine.settings_for(cache).scorer  # the length band's
    layers = scorer.resolved_layers(model.config.num_hidden_layers)
    depth = (max(layers) + 1) / model.config.num_hidden_layers  # the scoring pass stops at its last layer
    heads, dim = model.config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    scan = 2 * heads * question * cache.num_l2 * dim * len(layers) if scorer.kind == "l2" else 0
    scan_s = scan / (rates["gflops"] * 1e9)
    keys_q = answer.num_l1 + tail + question / 2
    score = question_floor(model, rows=question, keys=keys_q, new_tokens=1, rates=rates)["floor_prefill_s"]
    prefill_keys = cache_len + (tail if close_tail else 0) + n / 2
    rest = question_floor(model, rows=n, keys=prefill_keys, new_tokens=new_tokens, rates=rates)
    above = 1 - depth if reuse else 1.0  # the share of the layers the prefill runs
    prefill = above * rest["floor_prefill_s"]
    shape_prefill = above * shape_floor(model, rows=n, keys=prefill_keys, rates=rates)
    steps = max(1, len(answer.token_ids) - 1)
    shape_score = depth * shape_floor(model, rows=question, keys=keys_q, rates=rates) + scan_s
    return {"floor_score_s": depth * score + scan_s, "floor_prefill_s": prefill,
            "floor_decode_s": rest["floor_decode_s"], "floor_decode_token_s": rest["floor_decode_s"] / max(1, new_tokens - 1),
            "floor_question_s": depth * score + scan_s + prefill + rest["floor_decode_s"],
            "floor_ttft_s": depth * score + scan_s + prefill,
            "shape_floor_score_s": shape_score,
            "shape_floor_prefill_s": shape_prefill,
            "shape_floor_decode_s": steps * shape_floor(model, rows=1, keys=cache_len + n, rates=rates),
            "shape_floor_ttft_s": shape_score + shape_prefill}


def full_floor(model, context: int, question: int, new_tokens: int, rates: dict[str, float]) -> dict[str, float]:
    """Full attention's floor: the question's rows over context + question, then decoding over them."""
    floor = question_floor(model, rows=question, keys=context + question, new_tokens=new_tokens, rates=rates)
    prefill = shape_floor(model, rows=question, keys=context + question, rates=rates)
    return {**floor, "floor_ttft_s": floor["floor_prefill_s"],
            "floor_decode_token_s": floor["floor_decode_s"] / max(1, new_tokens - 1),
            "shape_floor_prefill_s": prefill, "shape_floor_ttft_s": prefill,
            "shape_floor_decode_s": (new_tokens - 1) * shape_floor(model, rows=1, keys=context + question, rates=rates)}


def run_full(args, size: int) -> dict:
    import torch

    from acre_train.infer.growing_cache import GrowingCache
    from acre_train.measure import PeakMemory
    from acre_train.modeling.sdpa import grouped_kv_sdpa

    model, tokenizer, cache_settings, _ = _setup(args)
    device = args.device
    context, questions = _workload(args, size, tokenizer, cache_settings.stride)
    size = len(context)
    longest = max(len(q) for q in questions)
    rates = machine_rates(device)

    def new_cache(n: int):
        return GrowingCache(capacity=n + longest + args.new_tokens) if args.full_cache == "growing" else None

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
        warm = model(torch.tensor([context[:512]], device=device), cache=new_cache(512), use_cache=True,
                     logits_to_keep=1).cache
        ask(warm, questions[0])
        del warm
        builds, latencies, splits = [], [], []
        with PeakMemory(device) as memory:
            for _ in range(args.repeats):
                cache = None  # free the previous cache before building the next one
                tic = time.perf_counter()
                with grouped_kv_sdpa(device):
                    cache = model(torch.tensor([context], device=device), cache=new_cache(size), use_cache=True,
                                  logits_to_keep=1).cache
                builds.append(time.perf_counter() - tic)
                for q, question in enumerate(questions[1:]):  # the first untimed, as for ACRE
                    tic = time.perf_counter()
                    split = ask(cache, question)
                    if q > 0:
                        latencies.append(time.perf_counter() - tic)
                        splits.append(split)
                    cache.crop(size - cache.get_seq_length())  # back to the context alone: the next question reuses it
        fold = _fold_ab(model, cache, size, args.new_tokens) if args.compare_fold else {}
    kv = _kv_mib(model, size)
    q_len = statistics.median(len(q) for q in questions[2:])
    return {"build_s": min(builds), "floor_build_s": build_floor(model, rows=size, pairs=size * (size + 1) / 2, rates=rates),
            "shape_floor_build_s": build_shape_floor(model, chunks=[size], pairs=size * (size + 1) / 2, rates=rates),
            "question_s": statistics.median(latencies), "peak_mib": memory.added_bytes / 2**20,
            "ttft_s": statistics.median(s["prefill_s"] for s in splits),
            "decode_token_s": statistics.median(s["decode_s"] for s in splits) / max(1, args.new_tokens - 1),
            "device_kv_mib": kv, "cpu_kv_mib": 0.0, "working_cache_mib": kv, "cache_length": size,
            "kv_attended": size + q_len, "context_tokens": size,
            "cache": args.full_cache, **rates, **full_floor(model, size, int(q_len), args.new_tokens, rates),
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
        result = run_acre(args, size) if method == "acre" else run_full(args, size)
        print(json.dumps(result))
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = (f"export {args.export} ({args.geometry} geometry)" if args.export else args.model
             or f"qwen2-shaped, {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads")
    print(f"model: {shape}, fp32, {args.device}; torch {torch.__version__}, {torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.1f}")
    text = f"real text from {args.text}" if args.text else f"random ids, questions of {args.question_tokens} tokens"
    geometry = "the export's" if args.export else (f"W0 {args.first_chunk}, S {args.stride}, l {args.interval}, "
                                                   f"W {args.working_window}, eta {args.max_refill}")
    print(f"ACRE: {geometry}; {text}; {args.questions} timed questions, {args.new_tokens} new tokens each; "
          f"fastest of {args.repeats} builds, median question\n")
    full_max = args.full_max or _position_window(args)
    rows = []
    for size in args.sizes:
        both = {"open": {"error": "skipped"}} if args.no_acre else measure(args, "acre", size)
        acre, closed = both.get("open", both), both.get("closed") if args.close_tail else None
        if args.no_full:
            full = {"error": "skipped"}
        elif full_max is not None and size > full_max:
            full = {"error": f"beyond {full_max} tokens (--full-max, the position window): projected in the report"}
        else:
            full = measure(args, "full", size)
        rows.append({"size": size, "acre": acre, "full": full, **({"acre_closed_tail": closed} if closed else {})})
        _print_row(size, acre, full, closed)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "_child"},
                                               "rows": rows}, indent=2))
    return 0


def _position_window(args) -> int | None:
    """The model's ``max_position_embeddings`` (None for the tiny model, sized to the longest context)."""
    if not (args.export or args.model):
        return None
    if args.export:
        config = json.loads((_export_dir(args.export) / "config.json").read_text())
        if config.get("adapter_only") and config.get("base_model"):
            config = json.loads((Path(config["base_model"]) / "config.json").read_text())
        return config.get("max_position_embeddings")
    from transformers import AutoConfig

    from acre_train.base.fetch import resolve_source

    return getattr(AutoConfig.from_pretrained(resolve_source(args.model)), "max_position_embeddings", None)


def _print_row(size: int, acre: dict, full: dict, closed: dict | None = None) -> None:
    def ratio(key: str) -> str:
        if "error" in acre or "error" in full or not acre.get(key):
            return "  n/a"
        return f"{full[key] / acre[key]:5.2f}x"

    print(f"context {size:>6} tokens")
    shut = "ACRE closed tail" + (" (refill after it)" if closed and closed.get("refill_after_tail") else "") + \
        (" (scoring pass reused)" if closed and closed.get("reuse_score_pass") else "")
    for name, r in (("ACRE", acre), *(((shut, closed),) if closed else ()), ("full", full)):
        if "error" in r:
            print(f"  {name:<5} {r['error']}")
            continue
        extra = f", {r['num_l1']} L1 entries, k={r['k']}, refilled cache {r['cache_length']}" if name.startswith("ACRE") else ""
        split = " + ".join(f"{key[:-2]} {r[key]:.3f}" for key in ("score_pass_s", "select_s", "refill_s", "prefill_s", "decode_s")
                           if r.get(key) or key in ("prefill_s", "decode_s"))
        split += (f" s; first token after {r['ttft_s']:.3f}s (floor {r['floor_ttft_s']:.3f}), "
                  f"{1e3 * r['decode_token_s']:.0f} ms per decoded token, {r['kv_attended']:.0f} KV entries attended")
        print(f"  {name:<5} build {r['build_s']:7.2f}s | per question {r['question_s']:6.3f}s | peak +{r['peak_mib']:7.1f} MiB"
              f" | KV on device {r['device_kv_mib']:6.1f} MiB, in CPU memory {r['cpu_kv_mib']:6.1f} MiB{extra}")
        print(f"        per question: {split}")
    print(f"  full / ACRE: build {ratio('build_s')}, per question {ratio('question_s')}, peak memory {ratio('peak_mib')}, "
          f"device KV {ratio('device_kv_mib')}, attended cache {ratio('working_cache_mib')}")
    for name, r in (("ACRE", acre), ("full", full)):
        if "floor_build_s" in r:
            shape = (f", {r['build_s'] / r['shape_floor_build_s']:.2f}x the floor at its products' measured rate "
                     f"{r['shape_floor_build_s']:.2f}s" if r.get("shape_floor_build_s") else "")
            print(f"  {name} build {r['build_s']:.2f}s against its floor {r['floor_build_s']:.2f}s "
                  f"({r['build_s'] / r['floor_build_s']:.2f}x{shape}), peak +{r['peak_mib']:.0f} MiB")
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
              f"({acre['question_s'] / closed['question_s']:.2f}x faster), first token after {closed['ttft_s']:.3f}s vs "
              f"{acre['ttft_s']:.3f}s (the same build)")


if __name__ == "__main__":
    sys.exit(main())
