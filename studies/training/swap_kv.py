"""Diagnostic: which part of ACRE's refilled cache makes a refilled needle lose to another one.

Not part of the installed package. ``sparse_full.py`` showed that the plain base, reading the whole
context with full attention and answering from only the tokens ACRE refilled, answers needles ACRE
gets wrong. That comparison changes two things at once; this script changes them one at a time, on
the same questions, with ACRE's own selection held fixed:

* ``acre``: the ladder row as committed (a check that it reproduces);
* ``full_kv``: ACRE's cache, layout and L1 memory, but the refilled raw tokens carry the keys and
  values full attention computed for them (over the whole text before them), instead of the ones
  the chunked build computed (over their own chunk and the L1 memory);
* ``no_q_l1``: ACRE's cache, but no L1 tokens in the question and the answer;
* ``full_kv_no_q_l1``: both;
* ``sparse_full``: the plain base, as in ``sparse_full.py``.

By default it answers every question of the contexts where the committed row got a whole refilled
needle wrong (so both directions of every flip are counted)::

    python studies/training/swap_kv.py --squad ../shared/data/squad-v2-dev.json --seeds 777,778,779

It writes docs/real-base/training/ladder/SWEEP/LENGTH/TASK/ROW.swap-kv.jsonl, a line per question.

``--closed-tail`` answers more arms with the context's raw tail closed at build time (so that it too can
carry full attention's keys and values), on the questions where ``sparse_full`` and ``full_kv_no_q_l1``
disagree in the first pass's file (``--every-question``: on all of them):

* ``closed_tail``: ACRE with its tail run once over the L1 memory (``close_tail``);
* ``closed_tail_full_kv_no_q_l1``: every raw context token (refilled and tail) with full attention's KV,
  no L1 token in the question; ``..._text``: the same at text positions (what is then left between it and
  ``sparse_full`` is the L1 memory and the tail's L1 tokens);
* ``closed_tail_full_tail_no_q_l1``: only the tail's raw tokens with full attention's KV;
* ``closed_tail_wide_tail_no_q_l1``: the tail closed by one pass over every finished raw token's ACRE KV
  at text positions instead of over the L1 memory (what a build could do).

It writes ``ROW.swap-kv-tail.jsonl`` (arms already there are kept); ``--report`` prints the table of both
files.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))
sys.path.insert(0, str(HERE))

import ladder  # noqa: E402
import run as scorer_study  # noqa: E402
from sparse_full import sparse_answer  # noqa: E402

from acre_train.infer.engine import AcreEngine  # noqa: E402
from acre_train.modeling.rope import Rope  # noqa: E402

ARMS = ("acre", "full_kv", "no_q_l1", "full_kv_no_q_l1", "sparse_full")
TAIL_ARMS = ("closed_tail", "closed_tail_full_kv_no_q_l1", "closed_tail_full_kv_no_q_l1_text",
             "closed_tail_full_tail_no_q_l1", "closed_tail_wide_tail_no_q_l1")


@torch.no_grad()
def full_attention_kv(base, ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values ``[L, H_kv, n, D]`` the plain base computes for ``ctx`` with full attention."""
    from transformers import DynamicCache

    cache = DynamicCache()
    base(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True)
    rope = Rope.of(base)
    positions = torch.arange(len(ctx))
    keys = torch.stack([rope.unrotate(layer.keys[0], positions) for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys, values


def with_full_kv(cache, keys: torch.Tensor, values: torch.Tensor):
    """A shallow copy of ``cache`` whose finished raw tokens carry full attention's keys and values."""
    swapped = copy.copy(cache)
    n = cache.l2_keys.shape[2]
    swapped.l2_keys = keys[:, :, :n].to(cache.l2_keys.dtype)
    swapped.l2_values = values[:, :, :n].to(cache.l2_values.dtype)
    return swapped


def closed_tail(engine: AcreEngine, cache, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
    """``(engine, cache)`` with the raw tail closed at build time; with ``keys``/``values`` (full attention's,
    over the whole context), the tail's raw tokens carry those instead (its L1 tokens keep ACRE's)."""
    closing = copy.copy(engine)
    closing.close_tail = True
    closed = copy.copy(cache)
    closing._close_tail(closed)
    if keys is not None:
        plan = closed.tail_plan()
        rows = torch.as_tensor(np.nonzero(~plan.is_l1)[0])
        at = torch.as_tensor(plan.raw_index[~plan.is_l1]) + closed.l2_keys.shape[2]
        closed.tail_keys = closed.tail_keys.clone()
        closed.tail_values = closed.tail_values.clone()
        closed.tail_keys[:, :, rows] = keys[:, :, at].to(closed.tail_keys.dtype)
        closed.tail_values[:, :, rows] = values[:, :, at].to(closed.tail_values.dtype)
    return closing, closed


def wide_tail(engine: AcreEngine, cache):
    """``(engine, cache)`` with the raw tail closed by one pass over every finished raw token's KV (ACRE's,
    rotated at text positions 0..N-1), the tail at N + i: the tail reads the whole text, not the memory."""
    closing = copy.copy(engine)
    closing.close_tail = True
    closed = copy.copy(cache)
    n = cache.l2_keys.shape[2]
    keys_rot = Rope.of(engine.model).rotate(cache.l2_keys, torch.arange(n))
    keys, values = {}, {}

    def capture(layer, _q, key, value):
        keys[layer], values[layer] = key[0], value[0]

    engine._forward(cache.tail_plan(), offset=n, capture=capture,
                    prefix=lambda layer: (keys_rot[layer][None], cache.l2_values[layer][None]))
    layers = range(engine.model.config.num_hidden_layers)
    closed.tail_keys = torch.stack([keys[x] for x in layers])
    closed.tail_values = torch.stack([values[x] for x in layers])
    return closing, closed


def no_question_l1(engine: AcreEngine) -> AcreEngine:
    """A view of ``engine`` whose question and answer carry no L1 tokens (the raw tail keeps its own)."""
    patched = copy.copy(engine)

    def open_chunk(cache, q_ids, settings=None):
        plan, k = AcreEngine.open_chunk(engine, cache, q_ids, settings)
        question_starts = int(np.nonzero(plan.raw_index >= len(cache.tail_ids))[0][0])
        keep = ~plan.is_l1 | (np.arange(len(plan)) < question_starts)
        cut = {name: getattr(plan, name)[keep] for name in
               ("input_ids", "is_l1", "chunk_ids", "memory_positions", "labels", "raw_index")}
        cut["positions"] = np.arange(int(keep.sum()), dtype=plan.positions.dtype)
        return replace(plan, **cut), k

    def decode(kv, logits, carry, settings):
        never = 1 << 30  # an interval no answer reaches: no L1 token is inserted while decoding
        original = engine.cache_settings
        patched.cache_settings = replace(original, interval=never)
        try:
            return AcreEngine._decode(patched, kv, logits, 0, settings)
        finally:
            patched.cache_settings = original

    patched.open_chunk = open_chunk
    patched._decode = decode
    return patched


def report(cell: Path, row: str) -> str:
    """The arms' table from the committed files: per arm, the whole refilled needles answered, and the flips
    against ACRE as committed (answered here and not there, the other way round), on the questions it ran."""
    committed = {r["id"]: r for r in map(json.loads, (cell / row / "predictions.jsonl").read_text().splitlines())}
    merged: dict[str, dict] = {}
    for name in (f"{row}.swap-kv.jsonl", f"{row}.swap-kv-tail.jsonl"):
        if (cell / name).is_file():
            for r in map(json.loads, (cell / name).read_text().splitlines()):
                merged.setdefault(r["id"], {}).update(r)
    lines = ["| arm | questions | whole needles answered | ACRE as committed on those | fixed | broken |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm in (*ARMS, *TAIL_ARMS):
        ran = [(r, committed[i]) for i, r in merged.items()
               if f"{arm}_score" in r and committed[i]["refill_coverage"] == 1]
        if not ran:
            continue
        mine = sum(r[f"{arm}_score"] for r, _ in ran)
        theirs = sum(c["score"] for _, c in ran)
        fixed = sum(r[f"{arm}_score"] > c["score"] for r, c in ran)
        broken = sum(r[f"{arm}_score"] < c["score"] for r, c in ran)
        lines.append(f"| {arm} | {len(ran)} | {mine:.0f} | {theirs:.0f} | {fixed} | {broken} |")
    return "\n".join(lines)


def wrong_contexts(cell: Path) -> set[str]:
    """Ids of the questions whose context holds a whole refilled needle the committed row got wrong."""
    rows = [json.loads(line) for line in (cell / "predictions.jsonl").read_text().splitlines()]
    seeds_contexts = {(r["id"].rsplit("-", 1)[0], int(r["id"].rsplit("-", 1)[1]) // r["questions_on_context"])
                      for r in rows if r["refill_coverage"] == 1 and r["score"] == 0}
    return {r["id"] for r in rows
            if (r["id"].rsplit("-", 1)[0], int(r["id"].rsplit("-", 1)[1]) // r["questions_on_context"])
            in seeds_contexts}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from acre_train.base.fetch import resolve_source
    from acre_train.data.tokenizer import auto_tokenizer
    from acre_train.eval.harness import group_by_context, stop_ids
    from acre_train.eval.methods import parse_method
    from acre_train.eval.metrics import score_answer
    from acre_train.eval.prompt import prepare_example
    from acre_train.eval.tasks import build_task
    from acre_train.infer.load import load_export

    parser = ladder.row_parser(__doc__)
    parser.add_argument("--seeds", default="777,778,779")
    parser.add_argument("--all-contexts", action="store_true", help="every context, not only those with a miss")
    parser.add_argument("--closed-tail", action="store_true",
                        help="second pass: the closed-tail arms on the first pass's disagreements")
    parser.add_argument("--every-question", action="store_true",
                        help="with --closed-tail: on every question of the first pass, not only its disagreements")
    parser.add_argument("--report", action="store_true", help="only print the arms' table from the committed files")
    args = parser.parse_args(argv)
    if args.report:
        ((length, task, sweep, _),) = ladder.parse_cells(f"{args.cell}:{args.row}")
        print(report(ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep), args.row))
        return 0
    length, task, sweep, setting, export, held = ladder.row_setup(args)
    cell = ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep)
    wanted = None if args.all_contexts else wrong_contexts(cell / args.row)
    arms = ARMS
    if args.closed_tail:
        first = [json.loads(line) for line in (cell / f"{args.row}.swap-kv.jsonl").read_text().splitlines()]
        wanted = {r["id"] for r in first
                  if args.every_question or r["sparse_full_score"] != r["full_kv_no_q_l1_score"]}
        arms = TAIL_ARMS
    model, _, _ = load_export(export, dtype=torch.float32)
    tok = auto_tokenizer(resolve_source(scorer_study.BASE))
    base = AutoModelForCausalLM.from_pretrained(resolve_source(scorer_study.BASE), dtype=torch.float32).eval()
    _, new_tokens, _, _ = scorer_study.CELLS[(length, task)]
    stops = stop_ids(model, tok)
    method = parse_method(setting)
    out = cell / f"{args.row}.swap-kv{'-tail' if args.closed_tail else ''}.jsonl"
    earlier = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())} \
        if args.closed_tail and out.is_file() else {}
    lines = []
    for seed in (int(s) for s in args.seeds.split(",")):
        examples = build_task(task, tok, length, 40, seed, squad_path=held, questions_per_context=4)
        for group in group_by_context([prepare_example(tok, ex) for ex in examples]):
            if wanted is not None and not any(ex.example.id in wanted for ex in group):
                continue
            engine, cache = method.prepare(model, tok, group[0])
            ctx = [*group[0].prefix_ids, *(t for d in group[0].doc_ids for t in d)]
            keys, values = full_attention_kv(base, ctx)
            swapped = with_full_kv(cache, keys, values)
            bare = no_question_l1(engine)
            options = dict(max_new_tokens=new_tokens, stop_token_ids=tuple(sorted(stops)), stop_at_eos=False)
            if args.closed_tail:
                closing, closed = closed_tail(engine, cache)
                _, all_full = closed_tail(engine, swapped, keys, values)
                _, tail_full = closed_tail(engine, cache, keys, values)
                wide_closing, wide = wide_tail(engine, cache)
            for ex in group:
                if wanted is not None and ex.example.id not in wanted and args.closed_tail:
                    continue
                q = list(ex.suffix_ids)
                ans = engine.answer(cache, q, **options)
                chosen = ans.refilled
                if args.closed_tail:
                    bare_closing = no_question_l1(closing)
                    runs = {"closed_tail": lambda: closing.answer(closed, q, selected=chosen, **options),
                            "closed_tail_full_kv_no_q_l1": lambda: bare_closing.answer(all_full, q, selected=chosen, **options),
                            "closed_tail_full_kv_no_q_l1_text":
                                lambda: bare_closing.answer(all_full, q, selected=chosen, positions="text", **options),
                            "closed_tail_full_tail_no_q_l1": lambda: bare_closing.answer(tail_full, q, selected=chosen, **options),
                            "closed_tail_wide_tail_no_q_l1":
                                lambda: no_question_l1(wide_closing).answer(wide, q, selected=chosen, **options)}
                    known = earlier.get(ex.example.id, {})
                    tokens = {arm: run().token_ids for arm, run in runs.items() if f"{arm}_score" not in known}
                else:
                    known = {}
                    tokens = {
                        "acre": ans.token_ids,
                        "full_kv": engine.answer(swapped, q, selected=chosen, **options).token_ids,
                        "no_q_l1": bare.answer(cache, q, selected=chosen, **options).token_ids,
                        "full_kv_no_q_l1": bare.answer(swapped, q, selected=chosen, **options).token_ids,
                    }
                    visible = torch.ones(len(ctx), dtype=torch.bool)
                    visible[: len(chosen)] = chosen
                    tokens["sparse_full"] = sparse_answer(base, ctx, visible, q, stops, new_tokens)
                texts = {arm: tok.decode(t, skip_special_tokens=True) for arm, t in tokens.items()}
                metric = ex.example.metric
                row = {"id": ex.example.id, "answers": ex.example.answers, **known,
                       **{f"{arm}_prediction": texts[arm] for arm in texts},
                       **{f"{arm}_score": score_answer(texts[arm], ex.example.answers)[metric] for arm in texts}}
                lines.append(row)
                out.write_text("".join(json.dumps(r) + "\n" for r in lines))  # a partial run keeps what it has
                ladder.log(f"{row['id']}: " + " ".join(f"{arm} {row[f'{arm}_score']:.0f}" for arm in arms))
    n = len(lines)
    ladder.log(f"{n} questions: " + ", ".join(f"{arm} {100 * sum(r[f'{arm}_score'] for r in lines) / n:.1f}"
                                              for arm in arms) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
