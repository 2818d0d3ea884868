"""``--debug N``: print samples with the label mask and the L1 slots visible at a glance.

Colour in a terminal (training targets green, the rest dim, L1 slots magenta, chunk boundaries
yellow); plain markers otherwise: ``{{...}}`` around training targets, ``[L1]`` at L1 slots and a
``|chunk t, l=...|`` line at every chunk start. A *target* is a raw token that some earlier raw
token is trained to predict (the labels are shifted over the raw sequence, DESIGN §2).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence, TextIO

import numpy as np

from ..modeling.interleave import IGNORE_INDEX

GREEN, DIM, MAGENTA, YELLOW, RESET = "\033[32m", "\033[2m", "\033[35;7m", "\033[33m", "\033[0m"
LEGEND_PLAIN = "legend: {{...}} training targets, [L1] L1 slot, |chunk t, l=..| chunk start"
LEGEND_COLOR = f"legend: {GREEN}training targets{RESET}, {DIM}not trained{RESET}, {MAGENTA}L1{RESET} slot, {YELLOW}|chunk|{RESET} start"


def use_color(mode: str = "auto", stream: TextIO | None = None) -> bool:
    """``always`` / ``never`` / ``auto`` (a terminal and no ``NO_COLOR``)."""
    stream = sys.stdout if stream is None else stream
    if mode == "always":
        return True
    if mode == "never":
        return False
    return stream.isatty() and "NO_COLOR" not in os.environ


def target_mask(row: dict[str, Any]) -> np.ndarray:
    """Per interleaved slot: True where the raw token there is a training target."""
    labels = np.asarray(row["labels"])
    raw_index = np.asarray(row["raw_index"])
    raw_slots = np.flatnonzero(raw_index >= 0)
    targeted_raw = raw_index[raw_slots[labels[raw_slots] != IGNORE_INDEX]] + 1  # predicted raw tokens
    mask = np.zeros(len(labels), dtype=bool)
    slot_of_raw = np.empty(int(raw_index.max()) + 1 if raw_slots.size else 0, dtype=np.int64)
    slot_of_raw[raw_index[raw_slots]] = raw_slots
    mask[slot_of_raw[targeted_raw[targeted_raw < slot_of_raw.size]]] = True
    return mask


def _window(length: int, max_tokens: int) -> list[tuple[int, int]]:
    if max_tokens <= 0 or length <= max_tokens:
        return [(0, length)]
    head = max_tokens // 2
    return [(0, head), (length - (max_tokens - head), length)]


def format_sample(row: dict[str, Any], tokenizer: Any, *, color: bool = False, max_tokens: int = 400) -> str:
    """One sample as text: a header with its counts, then its tokens with targets/L1/chunks marked."""
    ids = np.asarray(row["input_ids"])
    is_l1 = np.asarray(row["is_l1"]).astype(bool)
    chunks = np.asarray(row["chunk_ids"])
    targets = target_mask(row)
    intervals = list(row["intervals"])
    header = (
        f"sample {row['sample_index']}: {row['num_raw_tokens']} raw + {int(is_l1.sum())} L1 = {len(ids)} tokens, "
        f"{len(intervals)} chunks, intervals {intervals}, {int(targets.sum())} target tokens"
        + (f", {row['num_answer_tokens']} answer tokens" if "num_answer_tokens" in row else "")
    )
    out = [header, LEGEND_COLOR if color else LEGEND_PLAIN, ""]
    pieces: list[str] = []
    for w, (start, end) in enumerate(_window(len(ids), max_tokens)):
        if w:
            pieces.append(f"\n... {start - prev_end} tokens not shown ...\n")
        in_target = False
        for k in range(start, end):
            if k == start or chunks[k] != chunks[k - 1]:
                if in_target and not color:
                    pieces.append("}}")
                    in_target = False
                if k == 0 or chunks[k] != chunks[k - 1]:
                    mark = f"|chunk {chunks[k]}, l={intervals[chunks[k]]}|"
                    pieces.append(("\n" if k else "") + (f"{YELLOW}{mark}{RESET}" if color else mark) + "\n")
            if is_l1[k]:
                pieces.append(f"{MAGENTA}L1{RESET}" if color else "[L1]")
                continue  # an L1 slot neither opens nor closes a target run
            text = tokenizer.decode([int(ids[k])])
            if color:
                pieces.append(f"{GREEN if targets[k] else DIM}{text}{RESET}")
            else:
                if targets[k] and not in_target:
                    pieces.append("{{")
                elif not targets[k] and in_target:
                    pieces.append("}}")
                in_target = bool(targets[k])
                pieces.append(text)
        if in_target and not color:
            pieces.append("}}")
        prev_end = end
    out.append("".join(pieces))
    return "\n".join(out)


def print_samples(rows: Sequence[dict[str, Any]], tokenizer: Any, *, color: str = "auto",
                  max_tokens: int = 400, stream: TextIO | None = None) -> None:
    """Print ``rows`` with :func:`format_sample`, separated by rules (to stdout by default)."""
    stream = sys.stdout if stream is None else stream
    colored = use_color(color, stream)
    for row in rows:
        print("=" * 80, file=stream)
        print(format_sample(row, tokenizer, color=colored, max_tokens=max_tokens), file=stream)
    print("=" * 80, file=stream)
