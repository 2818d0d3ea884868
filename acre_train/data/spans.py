"""Stage-1 span sampling: cut long documents into spans, pack short ones, stop at a token budget.

Spans are described by *segments* ``(doc_index, start, end)`` (token offsets), not by tokens, so a
2B-token plan fits in memory and token ids are fetched only when a sample is built. Inside a span,
consecutive segments are separated by one EOS token.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np

Segment = tuple[int, int, int]  # (doc_index, start, end) in the document's tokens

# Separate RNG stream for span lengths, so they never correlate with the per-sample interval draws
# (which use seed=(seed, sample_index)).
_SPAN_STREAM = 0x5A1


def span_length(segments: Sequence[Segment]) -> int:
    """Raw tokens of a span: its segments plus one EOS between consecutive segments."""
    return sum(end - start for _, start, end in segments) + max(len(segments) - 1, 0)


class _Budget:
    def __init__(self, budget: int | None, min_length: int) -> None:
        self.left = budget
        self.min_length = min_length

    def fit(self, length: int) -> int:
        """How much of a ``length``-token span the budget allows (0: stop)."""
        if self.left is None:
            return length
        allowed = min(length, self.left)
        return allowed if allowed >= self.min_length else 0

    def spend(self, length: int) -> None:
        if self.left is not None:
            self.left -= length


def _truncate(segments: list[Segment], length: int) -> list[Segment]:
    """The first ``length`` raw tokens of a span (EOS separators included)."""
    out: list[Segment] = []
    left = length
    for doc, start, end in segments:
        if out:
            left -= 1  # the separator
        if left <= 0:
            break
        take = min(end - start, left)
        out.append((doc, start, start + take))
        left -= take
    return out


def iter_spans(
    doc_lengths: Iterable[tuple[int, int]],
    *,
    min_length: int,
    max_length: int,
    token_budget: int | None = None,
    pack: bool = True,
    seed: int = 0,
) -> Iterator[list[Segment]]:
    """Yield spans (lists of segments) from ``(doc_index, num_tokens)`` pairs, in order.

    A document with at least ``min_length`` tokens left is cut into consecutive spans whose target
    lengths are drawn uniformly from ``[min_length, max_length]`` (the last one takes what remains
    when that is shorter). What is left (< ``min_length``) goes to the packing buffer with ``pack``,
    else it is dropped. The packing buffer emits a span when it reaches its own drawn target length,
    splitting the document that crosses it (the rest starts the next buffer). Emission stops once
    ``token_budget`` raw tokens are out; the last span is cut to fit if it stays >= ``min_length``.
    Deterministic for a given seed and document order.
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    rng = np.random.default_rng(np.random.SeedSequence((seed, _SPAN_STREAM)))
    budget = _Budget(token_budget, min_length)

    def draw() -> int:
        return int(rng.integers(min_length, max_length + 1))

    buffer: list[Segment] = []
    buffer_target = draw()

    def emit(span: list[Segment]) -> list[Segment] | None:
        length = budget.fit(span_length(span))
        if length == 0:
            return None
        span = _truncate(span, length)
        budget.spend(length)
        return span

    for doc, n in doc_lengths:
        pos = 0
        while n - pos >= min_length:
            take = min(draw(), n - pos)
            span = emit([(doc, pos, pos + take)])
            if span is None:
                return
            yield span
            pos += take
        if not pack or pos == n:
            continue
        start = pos
        while start < n:
            # Room left in the buffer for this document (one token goes to the EOS separator).
            room = buffer_target - span_length(buffer) - (1 if buffer else 0)
            take = min(room, n - start)
            if take > 0:
                buffer.append((doc, start, start + take))
                start += take
            if span_length(buffer) >= buffer_target or take <= 0:
                # take <= 0: the buffer is one token short of its target and the separator would
                # overflow it; it is emitted if long enough, else (target == min_length) dropped.
                if span_length(buffer) >= min_length:
                    span = emit(buffer)
                    if span is None:
                        return
                    yield span
                buffer, buffer_target = [], draw()
    if buffer and span_length(buffer) >= min_length:
        span = emit(buffer)
        if span is not None:
            yield span
