"""What ACRE answers when the whole needle came back and the answer is still wrong (niah_multikey cells).

Not part of the installed package. Reads committed cells only (no model; it rebuilds the held-out
contexts with the base's tokenizer, seconds)::

    python studies/scorer/confusions.py docs/real-base/scorer/centered/4096/niah_multikey \\
        docs/real-base/scorer/centered/8192/niah_multikey

For each question of the cell's ACRE row (``acre`` or the ladder's ``acre:...`` setting) whose needle was refilled whole (``refill_coverage`` 1) and
answered wrong, the first number of the prediction is classed as: another needle's value in the same
context (with its distance in tokens from the asked needle), a number that is in no needle (a garbled
copy), or no number at all. The first class is a key-value binding error with both needles readable;
the others are copying errors. Cells that record which needles each question saw whole
(``refill_visible_gold``) also give ``that_needle``: it counts whether the needle whose
value was given had been refilled too, or came from the L1 memory. ``given_needle_lies`` counts whether
that needle comes after the asked one in the text (nearer the question) or before it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import BASE, EVAL_SEEDS  # noqa: E402

QUESTIONS_PER_CONTEXT = 4  # as the study's cells (run.CELLS) ask niah_multikey


def classify(prediction: str, context: str, asked: str, tokenizer) -> tuple[str, int | None]:
    """(class, token distance from the asked needle's value to the predicted one, when it is another needle's;
    negative when the predicted needle comes first in the text, positive when it lies nearer the question)."""
    numbers = re.findall(r"\d{5,}", prediction)
    if not numbers:
        return "no number", None
    needles = set(re.findall(r"\d{7}", context))
    wrong = numbers[0]
    if wrong not in needles or wrong == asked:
        return "a number in no needle", None
    asked_at, given_at = context.find(asked), context.find(wrong)
    a, b = sorted((asked_at, given_at))
    tokens = len(tokenizer(context[a:b], add_special_tokens=False)["input_ids"])
    return "another needle's value", tokens if given_at > asked_at else -tokens


def cell_confusions(cell: Path, tokenizer) -> dict:
    from acre_train.eval.tasks import build_task

    info = json.loads((cell / "cell.json").read_text())
    length = int(info["length"])
    rows = [json.loads(line) for line in (cell / "predictions.jsonl").read_text().splitlines()]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m == "acre" or m.startswith("acre:")]
    acre = {r["id"]: r for r in rows if r["method"] == methods[0]}  # the cell's ACRE row (ladder cells name it)
    examples = {e.id: e for seed in info.get("seeds", EVAL_SEEDS)
                for e in build_task("niah_multikey", tokenizer, length, 40, seed,
                                    questions_per_context=QUESTIONS_PER_CONTEXT)}
    refilled = [r for r in acre.values() if r.get("refill_coverage") == 1.0]
    wrong = [r for r in refilled if r["score"] < 1]
    kinds: Counter[str] = Counter()
    distances, seen, side = [], Counter(), Counter()
    for r in wrong:
        e = examples[r["id"]]
        kind, distance = classify(r["prediction"], e.context, e.answers[0], tokenizer)
        kinds[kind] += 1
        if distance is not None:
            distances.append(abs(distance))
            side["after the asked one" if distance > 0 else "before it"] += 1
            if "refill_visible_gold" in r:  # recorded by the newer cells
                given = re.findall(r"\d{5,}", r["prediction"])[0]
                other = next(i for i, (a, b) in enumerate(e.gold_spans) if given in e.context[a:b])
                seen["refilled" if other in r["refill_visible_gold"] else "not refilled"] += 1
    return {"cell": str(cell), "refilled_whole": len(refilled), "wrong": len(wrong), "classes": dict(kinds),
            "median_distance_tokens": statistics.median(distances) if distances else None,
            "min_distance_tokens": min(distances) if distances else None,
            "that_needle": dict(seen) or None, "given_needle_lies": dict(side) or None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cells", nargs="+", help="committed niah_multikey cell folders (with cell.json)")
    args = parser.parse_args(argv)
    from acre_train.base.fetch import resolve_source
    from acre_train.data.tokenizer import auto_tokenizer

    tokenizer = auto_tokenizer(resolve_source(BASE))
    for cell in args.cells:
        print(json.dumps(cell_confusions(Path(cell), tokenizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
