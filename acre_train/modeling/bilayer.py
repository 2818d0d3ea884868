"""The bi-layer cache's data and layout (DESIGN.md §5 "Build"): what a built context holds, how its
chunks are laid out, and where a refill puts every token. Inference builds it (``infer/cache.py``) and
answers over it; stage 2's refill simulation (``train/refill_sim.py``) views a training sample's captured
context as one, so both read the same layout from here.

Layout (batch size 1, every tensor per layer stacked on dim 0):

* **L1** (on the model's device): pre-RoPE keys ``l1_keys [L, H_kv, m, D]``, values ``l1_values``, and
  the keys rotated at their memory positions ``j = 0..m-1`` (``l1_keys_rot``, what later chunks and
  the scoring pass see).
* **L2** (CPU memory): pre-RoPE keys/values ``[L, H_kv, N2, D]`` of every raw token of the finished
  chunks, in text order. L1 entry ``j`` stands for ``l2[span_bounds[j]:span_bounds[j+1]]`` (the raw
  tokens since the previous L1 token); ``l2[span_bounds[m]:]`` are *pending* raw tokens whose L1
  token would fall in the unfinished chunk (only when chunk sizes are not multiples of ``l``).
* **Tail**: the token ids of the unfinished last chunk; they are re-run with every question over its
  refilled cache, which continues that open chunk. Their KV over the L1 memory alone (``tail_keys``,
  ``tail_values``) is kept too: every question's scoring pass starts from it.
* **Key boxes** (for the ``bounds`` scorer, modeling/ranking.py): per scoring layer, the per-span min
  and max of the raw keys rotated at their text positions (``[H_kv, m, D]`` each, on the device),
  made on first use or by ``AcreEngine.build`` and saved with the cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
from torch import nn

from .geometry import WindowGeometry
from .interleave import chunk_bounds, interleave
from .rope import Rope
from .span_choice import span_tokens

# The paper's geometry (modeling/geometry.py): W0 = 4096, S = 2048, l = 16, W = 32K, eta = 4096.
_PAPER = WindowGeometry()  # the defaults where an export stores none


@dataclass(frozen=True)
class CacheSettings:
    """What a built cache depends on (besides the model): part of the cache fingerprint."""

    first_chunk: int = _PAPER.first_chunk
    stride: int = _PAPER.stride
    interval: int = _PAPER.interval

    def __post_init__(self) -> None:
        for f in fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class BiLayerCache:
    """The query-independent cache of one context; reusable for any number of questions."""

    settings: CacheSettings
    fingerprint: str
    l1_keys: torch.Tensor
    l1_keys_rot: torch.Tensor
    l1_values: torch.Tensor
    l2_keys: torch.Tensor
    l2_values: torch.Tensor
    span_bounds: torch.Tensor  # [m + 1] int64, offsets into the L2 token axis
    tail_ids: list[int]
    carry: int  # raw tokens counted towards the next L1 group when the tail starts
    num_context_tokens: int
    context_digest: str = ""  # SHA-256 of the context's token ids: a saved cache names what it holds
    boxes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # "layer:sinks" -> (min, max)
    # The raw tail's plan run once over the L1 memory at build time (AcreEngine.build), its pre-RoPE keys
    # and values [L, H_kv, n_tail_plan, D]: what every question's scoring pass sees before its own tokens,
    # and (AcreEngine(close_tail=True)) what the prefill reuses. None: no tail, or a cache built without
    # an engine (the scoring pass then runs the tail itself).
    tail_keys: torch.Tensor | None = None
    tail_values: torch.Tensor | None = None
    # [N2] bool: the L2 tokens that end a sentence (infer/sentences.py), for refill.grow_shape=sentences;
    # set by an engine that has the tokenizer. None: not known (built from ids alone).
    sentence_ends: torch.Tensor | None = None
    # Scoring layer -> (the L2 keys it was made from, those keys rotated at text positions): see
    # l2_keys_rotated. Not saved; remade on first use.
    rotated: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tail_plan(self):
        """The raw tail interleaved as the start of the open chunk (what every question continues)."""
        n = max(len(self.tail_ids), 1)
        return interleave(self.tail_ids, first_chunk=n, stride=n, intervals=self.settings.interval, carry_in=self.carry)

    @property
    def context_tokens(self) -> int:
        """The context's length in tokens (finished raw tokens and the open tail): what length bands read."""
        return int(self.span_bounds[-1]) + len(self.tail_ids) if len(self.span_bounds) else len(self.tail_ids)

    @property
    def num_l1(self) -> int:
        return int(self.l1_keys.shape[2])

    @property
    def num_l2(self) -> int:
        return int(self.l2_keys.shape[2])

    @property
    def num_pending(self) -> int:
        return self.num_l2 - int(self.span_bounds[-1])

    def l2_keys_rotated(self, model: nn.Module, layer: int) -> torch.Tensor:
        """One layer's raw keys ``[H_kv, N2, D]`` rotated at their text positions ``0..N2-1``, on the
        model's device: what the ``l2`` scorer reads every question. Made at the first question and kept
        (``rotated``): a scoring layer's copy is ``1 / num_layers`` of the L2 keys, and re-making it would
        cost every question a pass over them."""
        made = self.rotated.get(layer)
        if made is None or made[0] is not self.l2_keys:  # (a copy of this cache with other L2 keys remakes it)
            keys = self.l2_keys[layer].to(self.l1_keys.device, non_blocking=True)
            made = self.rotated[layer] = (self.l2_keys, Rope.of(model).rotate(keys, torch.arange(self.num_l2)))
        return made[1]

    def sink_tokens(self, sinks: int) -> torch.Tensor:
        """``[N2]`` bool: the first ``sinks`` tokens of the context and of every chunk."""
        from .scoring import sink_mask

        return sink_mask(self.num_l2, self.settings.first_chunk, self.settings.stride, sinks)

    def key_box(self, model: nn.Module, layer: int, sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``bounds`` scorer's per-span key box at ``layer`` (sink tokens left out), made once."""
        from .scoring import key_bounds

        name = f"{layer}:{sinks}"
        if name not in self.boxes:
            ignore = self.sink_tokens(sinks) if sinks else None
            low, high = key_bounds(self.l2_keys_rotated(model, layer), self.span_bounds, ignore)
            self.boxes[name] = (low.to(self.l1_keys.device), high.to(self.l1_keys.device))
        return self.boxes[name]

    def nbytes(self) -> dict[str, int]:
        """Bytes held on the accelerator (L1, key boxes, the scoring layers' rotated raw keys) and in CPU
        memory (L2)."""
        boxes = [t for pair in self.boxes.values() for t in pair]
        l1 = sum(t.numel() * t.element_size() for t in (self.l1_keys, self.l1_keys_rot, self.l1_values, *boxes,
                                                        *(made for _, made in self.rotated.values())))
        l2 = sum(t.numel() * t.element_size() for t in (self.l2_keys, self.l2_values))
        return {"l1": l1, "l2": l2}

    def summary(self) -> str:
        sizes = self.nbytes()
        return (f"{self.num_context_tokens} context tokens -> {self.num_l1} L1 entries "
                f"({sizes['l1'] / 2**20:.1f} MiB on {self.l1_keys.device}), {self.num_l2} L2 tokens "
                f"({sizes['l2'] / 2**20:.1f} MiB on cpu), raw tail of {len(self.tail_ids)} tokens")


# ------------------------------------------------------------------------------ chunk layout

def finished_chunks(num_raw: int, settings: CacheSettings) -> tuple[int, int]:
    """(number of finished chunks, raw tokens they hold); a chunk is finished when it is full."""
    bounds = chunk_bounds(num_raw, settings.first_chunk, settings.stride)
    done = 0
    for t, (start, end) in enumerate(bounds):
        full = settings.first_chunk if t == 0 else settings.stride
        if end - start < full:
            break
        done = t + 1
    return done, (bounds[done - 1][1] if done else 0)


def span_layout(plan, done: int, raw_done: int) -> tuple[np.ndarray, int]:
    """``(span bounds [m + 1], carry)`` of a context plan's ``done`` finished chunks (``raw_done`` raw
    tokens): L1 entry ``j`` owns L2 tokens ``bounds[j]:bounds[j + 1]``; ``carry`` raw tokens after the
    last entry count towards the next L1 group (training's refilled layout uses the same rule)."""
    finished = plan.raw_index[: finished_length(plan, done)]
    l1_slots = np.nonzero(finished < 0)[0]
    # Raw tokens before each L1 token of the finished chunks = the end of its span on the L2 axis.
    span_ends = l1_slots - np.arange(len(l1_slots))
    return np.concatenate([[0], span_ends]).astype(np.int64), raw_done - int(span_ends[-1] if len(span_ends) else 0)


def finished_length(plan, done: int) -> int:
    """Interleaved length of the first ``done`` chunks of ``plan``."""
    return int((plan.chunk_ids < done).sum())



# ----------------------------------------------------------------------------- refill layout

def num_selected(num_l1: int, interval: int, working_window: int, max_refill: int) -> int:
    """``k = floor(min(W - m, eta) / l)``, clamped to ``[0, m]``.

    >>> num_selected(0, 16, 100, 64), num_selected(10, 16, 1000, 8), num_selected(10, 16, 5, 4096)
    (0, 0, 0)
    >>> num_selected(10, 4, 30, 4096), num_selected(10, 4, 10_000, 4096)
    (5, 10)
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    k = math.floor(min(working_window - num_l1, max_refill) / interval)
    return max(0, min(num_l1, k))


def refill_layout(cache: BiLayerCache, selected: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where every cached token goes: ``(l2_index, l2_slots, l1_slots)``.

    ``selected``: span indices (L1 entries whose whole span is refilled) or a ``[N_closed]`` bool mask
    of the finished chunks' raw tokens to refill (token-granular refill). The refilled tokens of span
    ``j`` go immediately before L1 entry ``j``, in text order; pending raw tokens (their L1 token lies in
    the open chunk) go last, where they sit in the text. Slots are contiguous positions ``0..P-1``.
    """
    bounds = cache.span_bounds.numpy()
    m = cache.num_l1
    mask = selected if selected.dtype == torch.bool else span_tokens(cache.span_bounds, selected)
    index = np.flatnonzero(mask.numpy())
    owner = np.repeat(np.arange(m), np.diff(bounds))[index]  # the span of every refilled token
    # A refilled token follows the refilled tokens before it and the L1 entries of the spans before its own.
    l2_slots = np.arange(len(index)) + owner
    l1_slots = np.cumsum(np.bincount(owner, minlength=m)) + np.arange(m)
    end = int(l1_slots[-1]) + 1 if m else 0
    pending = np.arange(int(bounds[-1]), cache.num_l2)
    l2_index = np.concatenate([index, pending]).astype(np.int64)
    return l2_index, np.concatenate([l2_slots, end + np.arange(len(pending))]).astype(np.int64), l1_slots.astype(np.int64)


def text_positions(cache: BiLayerCache, l2_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(l2_positions, l1_positions, next)``: each token's index in the whole interleaved context.

    A raw token ``r`` of span ``s`` follows ``r`` raw tokens and the ``s`` L1 entries before it (pending
    tokens follow all ``m``); L1 entry ``j`` follows its span's last raw token. ``next``: where the raw
    tail begins.
    """
    bounds = cache.span_bounds.numpy()
    m = cache.num_l1
    owner = np.searchsorted(bounds[1:], l2_index, side="right")  # the span of each token, m when pending
    return l2_index + owner, bounds[1:] + np.arange(m), int(cache.num_l2) + m
