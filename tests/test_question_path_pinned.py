"""The question path's outputs pinned: greedy tokens and refilled tokens of every selection option.

Speed work on the question path (scoring pass, selection, assembling the refilled cache, prefill,
decoding) must not change what is answered. ``tests/data/question_path_pinned.json`` holds the tokens
each setting below produced before that work; this test fails when any of them changes. Regenerate
only for a change that is meant to alter answers (and say so in its commit)::

    python tests/test_question_path_pinned.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from acre_train.infer import AcreEngine, CacheSettings, RefillSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import perturbed_acre_model  # noqa: E402

PINNED = Path(__file__).resolve().parent / "data" / "question_path_pinned.json"
TEXT = ("The harbour master kept a ledger of every ship. In 1871 the schooner Alba brought salt from Cadiz. "
        "Her captain, Rosa Vell, paid the fee in silver. The ledger also names the pilot, a man called Ostrow. "
        "Two winters later the harbour froze and no ship came for forty days. ")
QUESTIONS = ["Who paid the fee in silver?", "How long did no ship come?", "What did the Alba bring?"]
# Every selection option users run, one setting per row: (scorer, refill overrides, close_tail).
SETTINGS = {
    "l1": ("l1:layers=-1", {}, False),
    "l1-neighbors": ("l1:layers=0+1,heads=max", {"neighbors": True}, False),
    "l2-two-layers": ("l2:layers=0+1,heads=max,sinks=2,keep_sinks=1", {}, False),
    "bounds": ("bounds:layers=1,sinks=1", {}, False),
    "grow-attention": ("l2:layers=1", {"grow": 2}, False),
    "grow-centered": ("l2:layers=0+1,heads=max", {"grow": 3, "grow_shape": "centered"}, False),
    "grow-densest": ("l2:layers=1,sinks=2,keep_sinks=tokens", {"grow": 1, "grow_shape": "densest"}, False),
    "shipped-like": ("l2:layers=0+1,heads=max,sinks=2,keep_sinks=1,query=question",
                     {"grow": 1, "grow_shape": "sentences"}, False),
    "unscored": ("l2:layers=1,heads=max,sinks=2,keep_sinks=tokens,unscored=4,query=question",
                 {"grow": 1, "grow_shape": "sentences"}, False),
    "text-positions": ("l2:layers=1,heads=max", {"grow": 1, "grow_shape": "densest", "positions": "text"}, False),
    "closed-tail": ("l2:layers=0+1,heads=max,sinks=2,keep_sinks=1,query=question",
                    {"grow": 1, "grow_shape": "sentences"}, True),
    "closed-tail-refill-after": ("l2:layers=0+1,heads=max,sinks=2,keep_sinks=1,query=question",
                                 {"grow": 1, "grow_shape": "sentences", "close_tail": True, "refill_after_tail": True},
                                 True),
}


def _outputs() -> dict[str, list[dict]]:
    from acre_train.data.tiny_tokenizer import tiny_tokenizer

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = perturbed_acre_model("qwen2", seed=3, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    out = {}
    for name, (scorer, overrides, close_tail) in SETTINGS.items():
        refill = RefillSettings(working_window=4096, max_refill=48, scorer=scorer, max_new_tokens=6,
                                stop_at_eos=False).replace(**overrides)
        engine = AcreEngine(model, tok, cache_settings=CacheSettings(64, 48, 8), refill=refill, close_tail=close_tail)
        cache = engine.build(TEXT * 3, progress=False)
        rows = []
        for question in QUESTIONS:
            answer = engine.answer(cache, question)
            rows.append({"tokens": answer.token_ids, "refilled": torch.nonzero(answer.refilled).flatten().tolist()})
        out[name] = rows
    return out


@pytest.mark.usefixtures("one_thread")
def test_every_selection_option_answers_and_refills_as_pinned():
    pytest.importorskip("acre_train.data.tiny_tokenizer")
    pinned = json.loads(PINNED.read_text())
    now = _outputs()
    assert set(now) == set(pinned)
    for name in SETTINGS:
        assert now[name] == pinned[name], f"{name}: the answer or the refilled tokens changed"
    # The pin means something only if the settings disagree with each other.
    assert len({json.dumps(rows) for rows in now.values()}) >= 6


if __name__ == "__main__":
    if "--write" in sys.argv:
        torch.set_num_threads(1)
        PINNED.write_text(json.dumps(_outputs(), indent=1) + "\n")
        print(f"wrote {PINNED}")
