"""The question's scoring pass over a bi-layer cache: the open chunk (the context's raw tail and the
question, interleaved), run over the L1 memory alone up to the last scoring layer, and the question's
rotated query states taken there (:class:`~acre_train.modeling.ranking.QuestionQueries`).

Inference (``infer/engine.py``) and stage 2's refill simulation (``train/refill_sim.py``) both rank
spans from this pass, so a run trained in the refilled layout refills what inference will.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .adapter import acre_forward, acre_layers_from
from .bilayer import BiLayerCache
from .interleave import interleave
from .ranking import QuestionQueries
from .rope import Rope
from .sdpa import grouped_kv_sdpa


class _StopForward(Exception):
    """Raised from a capture hook once the last scoring layer has been seen (skips the rest)."""


def open_chunk_plan(cache: BiLayerCache, q_ids: Sequence[int]):
    """The raw tail and the question interleaved as one open chunk (whatever its length: it is not
    split at the stride), continuing the L1 group count where the context left it."""
    raw = cache.tail_ids + list(q_ids)
    return interleave(raw, first_chunk=len(raw), stride=len(raw), intervals=cache.settings.interval,
                      carry_in=cache.carry)


def slice_plan(plan, start: int):
    """Rows ``start:`` of a one-chunk plan, positions renumbered from 0 (the rows before become a KV prefix)."""
    cut = {name: getattr(plan, name)[start:] for name in
           ("input_ids", "is_l1", "chunk_ids", "positions", "memory_positions", "labels", "raw_index")}
    cut["positions"] = cut["positions"] - start
    return replace(plan, **cut)


def _chunk_tensors(plan, offset: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One open chunk's batch tensors (batch of one, one chunk) at positions ``offset + i``."""
    positions = torch.as_tensor(plan.positions, device=device)[None] + offset
    is_l1 = torch.as_tensor(plan.is_l1, device=device)[None]
    return dict(is_l1=is_l1, chunk_ids=torch.zeros_like(positions), positions=positions,
                memory_positions=torch.where(is_l1, positions, -1))


def run_open_chunk(model: nn.Module, plan, *, offset: int, prefix, capture, device: torch.device,
                   backend: str | None = None, want_hidden: bool = False) -> torch.Tensor | None:
    """Run ``plan`` (one open chunk) at positions ``offset + i`` over a KV ``prefix`` of ``offset`` keys
    (no gradient); ``capture(layer, q, k, v)`` sees every layer's states."""
    with torch.no_grad(), grouped_kv_sdpa(device):
        out = acre_forward(model, input_ids=torch.as_tensor(plan.input_ids, device=device)[None],
                           **_chunk_tensors(plan, offset, device), kernel="chunked", backend=backend, prefix=prefix,
                           capture=capture)
    return out.hidden_states if want_hidden else None


def resume_open_chunk(model: nn.Module, plan, hidden: torch.Tensor, *, first_layer: int, offset: int, prefix, capture,
                      device: torch.device, backend: str | None = None) -> torch.Tensor:
    """:func:`run_open_chunk` from decoder layer ``first_layer`` on, given the chunk's hidden states
    ``[1, n, d]`` entering it (the layers below ran earlier, in the scoring pass); the final hidden states."""
    with torch.no_grad(), grouped_kv_sdpa(device):
        return acre_layers_from(model, hidden, first_layer=first_layer, **_chunk_tensors(plan, offset, device),
                                kernel="chunked", backend=backend, prefix=prefix, capture=capture)


@dataclass
class PassStates:
    """What a scoring pass leaves for the question's prefill to reuse: the hidden states ``[1, n, d]``
    leaving its last layer, and each layer's pre-RoPE keys and values ``[H_kv, n, D]`` up to it."""

    hidden: torch.Tensor
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]

    @property
    def next_layer(self) -> int:
        """The first layer the prefill still has to run."""
        return max(self.keys) + 1


def question_queries(model: nn.Module, cache: BiLayerCache, plan, *, num_tail: int, layers: Sequence[int],
                     device: torch.device, backend: str | None = None,
                     find_own: Callable[[list[int]], list[bool] | None] | None = None,
                     keep_states: bool = False) -> QuestionQueries:
    """The question's query states at ``layers`` (indices ``0..L-1``) for ranking spans.

    The tail and question run as the open chunk over the L1 cache alone, exactly as the training plan
    has it (L1 keys at memory positions ``j``, the chunk at ``m + i``); the question's raw tokens'
    rotated queries are taken, and the forward stops after the last wanted layer. The tail's part of
    that pass is the same for every question: a build that ran it once and kept its KV
    (``cache.tail_keys``) lets only the question's tokens run here. ``find_own(question ids)``: which of
    them are the question's own words (``PromptFormat.question_words``), asked only by scorers that
    pool those. ``keep_states`` (a closed tail only): the pass runs its last layer to the end and
    leaves :class:`PassStates` in ``.states`` for the prefill to start above it.
    """
    if keep_states and cache.tail_keys is None:
        raise ValueError("the scoring pass's states are kept over a closed tail only (close_tail)")
    wanted = sorted(set(layers))
    m = cache.num_l1
    tail_len = cache.tail_keys.shape[2] if cache.tail_keys is not None else 0
    rows_np = np.nonzero(plan.raw_index >= num_tail)[0]
    run_rows = torch.as_tensor(rows_np - tail_len, device=device)
    queries: dict[int, torch.Tensor] = {}

    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    hidden: list[torch.Tensor] = []

    def capture(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if keep_states and layer <= wanted[-1]:
            keys[layer], values[layer] = key[0], value[0]
        if layer in wanted:
            queries[layer] = query[0].index_select(1, run_rows)
            if layer == wanted[-1] and not keep_states:
                raise _StopForward

    def leave(_module, _args, output) -> None:  # the last scoring layer's output: the prefill starts above it
        hidden.append(output[0] if isinstance(output, tuple) else output)
        raise _StopForward

    if cache.tail_keys is not None:  # run only the question, after the closed tail's KV
        tail_rot = Rope.of(model).rotate(cache.tail_keys, torch.arange(m, m + tail_len))
        prefix = lambda layer: (torch.cat([cache.l1_keys_rot[layer], tail_rot[layer]], 1)[None],  # noqa: E731
                                torch.cat([cache.l1_values[layer], cache.tail_values[layer]], 1)[None])
        run, offset = slice_plan(plan, tail_len), m + tail_len
    else:
        prefix = lambda layer: (cache.l1_keys_rot[layer][None], cache.l1_values[layer][None])  # noqa: E731
        run, offset = plan, m
    hook = model.model.layers[wanted[-1]].register_forward_hook(leave) if keep_states else None
    try:
        run_open_chunk(model, run, offset=offset, prefix=prefix, capture=capture, device=device, backend=backend)
    except _StopForward:
        pass
    finally:
        if hook is not None:
            hook.remove()
    q_ids = plan.input_ids[rows_np].tolist()
    return QuestionQueries(by_layer=queries, states=PassStates(hidden[0], keys, values) if keep_states else None,
                           memory_positions=torch.as_tensor(plan.positions[rows_np] + m, dtype=torch.long),
                           text_positions=torch.as_tensor(plan.raw_index[rows_np] + cache.num_l2, dtype=torch.long),
                           find_own=(lambda: find_own(q_ids)) if find_own is not None else None)
