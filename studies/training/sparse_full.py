"""Diagnostic: the base with full attention, restricted to the tokens ACRE refilled.

Not part of the installed package. For every held-out question of a ladder cell, ACRE (a ladder row's
export, the cell's setting) answers as in the ladder and says which context tokens it refilled; then the
plain base reads the whole context with full attention (its own keys and values, which saw all the text
before them), and the question and answer attend only to the refilled tokens, the raw tail and each other,
at their text positions. Against ACRE's row on the same questions and selection this separates the two
things the refilled layout lacks: keys and values computed over the whole text, and the text between the
refilled tokens (which neither sees)::

    python studies/training/sparse_full.py --squad ../shared/data/squad-v2-dev.json --seeds 777

It writes docs/real-base/training/ladder/SWEEP/LENGTH/TASK/ROW.sparse-full.jsonl (one line per question:
ACRE's answer and score, the sparse full-attention answer and score, the refilled coverage of the needle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scorer"))
sys.path.insert(0, str(HERE))

import ladder  # noqa: E402
import run as scorer_study  # noqa: E402


@torch.no_grad()
def sparse_answer(base, ctx: list[int], visible: torch.Tensor, question: list[int], stop: set[int],
                  max_new: int) -> list[int]:
    """Greedy answer of the plain ``base`` whose question sees only the ``visible`` context tokens.

    The context runs once with full causal attention; the question and every new token attend to the
    visible context tokens and to each other, at their text positions."""
    from transformers import DynamicCache

    cache = DynamicCache()
    base(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True)
    mask = visible.long()
    tokens: list[int] = []
    step = list(question)
    while len(tokens) < max_new:
        start = len(mask)
        mask = torch.cat([mask, torch.ones(len(step), dtype=torch.long)])
        out = base(input_ids=torch.tensor([step]), cache=cache, use_cache=True, attention_mask=mask[None],
                   position_ids=torch.arange(start, start + len(step))[None])
        token = int(out.logits[0, -1].argmax())
        if token in stop:
            break
        tokens.append(token)
        step = [token]
    return tokens


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from acre_train.base.fetch import resolve_source
    from acre_train.data.tokenizer import auto_tokenizer
    from acre_train.eval.harness import group_by_context, stop_ids
    from acre_train.eval.metrics import score_answer
    from acre_train.eval.methods import parse_method
    from acre_train.eval.methods.base import GenerationConfig
    from acre_train.eval.prompt import prepare_example
    from acre_train.eval.tasks import build_task
    from acre_train.infer.load import load_export

    parser = ladder.row_parser(__doc__)
    parser.add_argument("--seeds", default="777")
    args = parser.parse_args(argv)
    length, task, sweep, setting, export, held = ladder.row_setup(args)
    model, _, _ = load_export(export, dtype=torch.float32)
    tok = auto_tokenizer(resolve_source(scorer_study.BASE))
    base = AutoModelForCausalLM.from_pretrained(resolve_source(scorer_study.BASE), dtype=torch.float32).eval()
    _, new_tokens, _, _ = scorer_study.CELLS[(length, task)]
    generation = GenerationConfig(new_tokens, stop_ids(model, tok))
    method = parse_method(setting)
    out = ladder.ladder_dir(ladder.DOCS / "training/ladder", length, task, sweep) / f"{args.row}.sparse-full.jsonl"
    lines = []
    for seed in (int(s) for s in args.seeds.split(",")):
        examples = build_task(task, tok, length, 40, seed, squad_path=held, questions_per_context=4)
        for group in group_by_context([prepare_example(tok, ex) for ex in examples]):
            engine, cache = method.prepare(model, tok, group[0])
            ctx = [*group[0].prefix_ids, *(t for d in group[0].doc_ids for t in d)]
            for ex in group:
                ans = engine.answer(cache, list(ex.suffix_ids), max_new_tokens=new_tokens,
                                    stop_token_ids=tuple(sorted(generation.stop_ids)), stop_at_eos=False)
                visible = torch.ones(len(ctx), dtype=torch.bool)
                visible[: len(ans.refilled)] = ans.refilled  # the finished chunks' raw tokens: as refilled
                sparse = sparse_answer(base, ctx, visible, list(ex.suffix_ids), generation.stop_ids, new_tokens)
                texts = {"acre": tok.decode(ans.token_ids, skip_special_tokens=True),
                         "sparse_full": tok.decode(sparse, skip_special_tokens=True)}
                metric = ex.example.metric
                row = {"id": ex.example.id, "answers": ex.example.answers, "visible_tokens": int(visible.sum()),
                       **{f"{k}_prediction": v for k, v in texts.items()},
                       **{f"{k}_score": score_answer(v, ex.example.answers)[metric] for k, v in texts.items()}}
                lines.append(row)
                ladder.log(f"{row['id']}: acre {row['acre_score']} sparse-full {row['sparse_full_score']}")
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    n = len(lines)
    ladder.log(f"{n} questions: acre {100 * sum(r['acre_score'] for r in lines) / n:.1f}, "
               f"sparse full attention {100 * sum(r['sparse_full_score'] for r in lines) / n:.1f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
