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
from acre_train.modeling.interleave import interleave  # noqa: E402
from acre_train.modeling.rope import Rope  # noqa: E402

ARMS = ("acre", "full_kv", "no_q_l1", "full_kv_no_q_l1", "sparse_full")


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
    args = parser.parse_args(argv)
    length, task, sweep, setting, export, held = ladder.row_setup(args)
    cell = ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep)
    wanted = None if args.all_contexts else wrong_contexts(cell / args.row)
    model, _, _ = load_export(export, dtype=torch.float32)
    tok = auto_tokenizer(resolve_source(scorer_study.BASE))
    base = AutoModelForCausalLM.from_pretrained(resolve_source(scorer_study.BASE), dtype=torch.float32).eval()
    _, new_tokens, _, _ = scorer_study.CELLS[(length, task)]
    stops = stop_ids(model, tok)
    method = parse_method(setting)
    out = cell / f"{args.row}.swap-kv.jsonl"
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
            for ex in group:
                q = list(ex.suffix_ids)
                ans = engine.answer(cache, q, **options)
                chosen = ans.refilled
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
                row = {"id": ex.example.id, "answers": ex.example.answers,
                       **{f"{arm}_prediction": texts[arm] for arm in ARMS},
                       **{f"{arm}_score": score_answer(texts[arm], ex.example.answers)[metric] for arm in ARMS}}
                lines.append(row)
                out.write_text("".join(json.dumps(r) + "\n" for r in lines))  # a partial run keeps what it has
                ladder.log(f"{row['id']}: " + " ".join(f"{arm} {row[f'{arm}_score']:.0f}" for arm in ARMS))
    n = len(lines)
    ladder.log(f"{n} questions: " + ", ".join(f"{arm} {100 * sum(r[f'{arm}_score'] for r in lines) / n:.1f}"
                                              for arm in ARMS) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
