"""Where the context's sentences end, from its tokens' text (what ``refill.grow_shape: sentences`` snaps to)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

_STOPS = (".", "!", "?")


def sentence_ends(tokenizer: Any, ids: Sequence[int], pieces: dict[int, str] | None = None) -> torch.Tensor:
    """``[len(ids)]`` bool: token ``i`` ends a sentence.

    A token ends one when it holds a line break, or when its text ends in ``.``, ``!`` or ``?`` and the
    next token starts with white space (so ``3.5`` and ``e.g.,`` do not). ``pieces``: a memo of each
    token id's text, kept by the caller across contexts (each id is decoded once).

    >>> class Tok:
    ...     def decode(self, ids): return {0: "Paris", 1: " is", 2: " big", 3: ".", 4: " It", 5: "3", 6: ".5"}[ids[0]]
    >>> sentence_ends(Tok(), [0, 1, 2, 3, 4, 5, 6]).tolist()
    [False, False, False, True, False, False, False]
    """
    pieces = {} if pieces is None else pieces
    for t in set(ids):
        if t not in pieces:
            pieces[t] = tokenizer.decode([int(t)])
    text = [pieces[t] for t in ids]
    out = torch.zeros(len(ids), dtype=torch.bool)
    for i, piece in enumerate(text):
        after = text[i + 1][:1] if i + 1 < len(text) else " "
        out[i] = "\n" in piece or (piece.rstrip().endswith(_STOPS) and after.isspace())
    return out
