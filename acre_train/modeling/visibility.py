"""Selective windowed attention: the visibility rule of DESIGN.md §3 and the kernels derived from it.

There is exactly one definition of who sees whom (``visible``). Every kernel builds its mask from it:

* ``dense``:   one pass over ``n + m`` keys (the tokens, then the L1 tokens a second time at their
  memory positions) with a boolean/additive mask — eager or SDPA, fine on CPU for short inputs.
* ``flex``:    the same key layout with a flex-attention ``BlockMask`` (block-sparse; opt-in, CUDA
  only: on CPU it is refused, see ``adapter.check_kernel``).
* ``chunked``: a loop over chunks, each attending to ``[L1 memory of earlier chunks ; chunk]`` —
  memory grows with the chunk, not with the sequence; the default and the inference path.

The actual softmax is always done by the transformers attention interface (``sdpa``, ``eager`` or
``flex_attention``), so GQA handling and backends stay the library's.

This module must stay self-contained (torch/transformers only, relative imports): exports copy it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# Chunk id given to padded memory slots: larger than any real chunk, so no query sees them.
_NO_CHUNK = torch.iinfo(torch.int32).max

KERNELS = ("chunked", "dense", "flex")
BACKENDS = ("sdpa", "eager")


def visible(
    q_chunk: torch.Tensor,
    q_pos: torch.Tensor,
    k_chunk: torch.Tensor,
    k_pos: torch.Tensor,
    k_is_memory: torch.Tensor,
) -> torch.Tensor:
    """The visibility rule, elementwise over broadcastable tensors.

    A query in chunk ``t`` sees every L1 memory key of chunks ``< t`` and every key of its own chunk
    at or before it. Inside one chunk ``position = M_t + index``, so comparing positions compares
    in-chunk indices. Padding uses chunk id -1 (pads see only pads, so no softmax row is empty).
    """
    same_chunk = (~k_is_memory) & (k_chunk == q_chunk) & (k_pos <= q_pos)
    earlier_memory = k_is_memory & (k_chunk < q_chunk)
    return same_chunk | earlier_memory


@dataclass
class MemoryIndex:
    """Where every sample's L1 tokens are, padded to the batch's largest L1 count ``m``."""

    token_index: torch.Tensor  # [B, m] index of the L1 token inside its sample (0 for padding)
    valid: torch.Tensor  # [B, m] bool
    chunk: torch.Tensor  # [B, m] chunk id of the L1 token (_NO_CHUNK for padding)
    positions: torch.Tensor  # [B, m] memory position j (0 for padding)

    @classmethod
    def from_batch(cls, is_l1: torch.Tensor, chunk_ids: torch.Tensor, memory_positions: torch.Tensor) -> "MemoryIndex":
        counts = is_l1.sum(dim=1)
        m = int(counts.max()) if counts.numel() else 0
        bsz = is_l1.shape[0]
        # Stable sort puts L1 slots first, in order; the first `count` entries are the real ones.
        order = torch.sort((~is_l1).to(torch.int8), dim=1, stable=True).indices[:, :m]
        valid = torch.arange(m, device=is_l1.device).expand(bsz, m) < counts[:, None]
        token_index = torch.where(valid, order, torch.zeros_like(order))
        chunk = torch.where(valid, chunk_ids.gather(1, token_index), torch.full_like(order, _NO_CHUNK))
        positions = torch.where(valid, memory_positions.gather(1, token_index), torch.zeros_like(order))
        return cls(token_index=token_index, valid=valid, chunk=chunk, positions=positions)

    @property
    def size(self) -> int:
        return int(self.token_index.shape[1])


def dense_mask(chunk_ids: torch.Tensor, positions: torch.Tensor, memory: MemoryIndex) -> torch.Tensor:
    """Boolean mask ``[B, 1, n, n + m]`` over keys ``[tokens ; L1 memory]``."""
    k_chunk = torch.cat([chunk_ids, memory.chunk], dim=1)
    k_pos = torch.cat([positions, memory.positions], dim=1)
    k_is_memory = torch.cat([torch.zeros_like(chunk_ids, dtype=torch.bool), torch.ones_like(memory.valid)], dim=1)
    mask = visible(chunk_ids[:, :, None], positions[:, :, None], k_chunk[:, None, :], k_pos[:, None, :], k_is_memory[:, None, :])
    return mask[:, None]


def flex_block_mask(chunk_ids: torch.Tensor, positions: torch.Tensor, memory: MemoryIndex):
    """The same mask as ``dense_mask``, as a flex-attention ``BlockMask`` (built block-sparsely)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = chunk_ids.shape[1]
    k_chunk = torch.cat([chunk_ids, memory.chunk], dim=1)
    k_pos = torch.cat([positions, memory.positions], dim=1)
    k_is_memory = torch.arange(k_chunk.shape[1], device=k_chunk.device) >= n

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(chunk_ids[b, q_idx], positions[b, q_idx], k_chunk[b, kv_idx], k_pos[b, kv_idx], k_is_memory[kv_idx])

    # Compiled block-mask construction never materialises the full n x (n + m) grid (needed at 64K).
    compile_mask = chunk_ids.device.type == "cuda"
    return create_block_mask(mask_mod, chunk_ids.shape[0], None, n, k_chunk.shape[1], device=chunk_ids.device, _compile=compile_mask)


def chunk_mask(num_prefix: int, length: int, device: torch.device) -> torch.Tensor:
    """Mask ``[1, 1, L, P + L]`` for one chunk over ``[P memory keys ; L chunk keys]``, from the rule.

    The memory keys are given chunk -1 relative to the chunk's 0; the result is "all memory, causal
    inside the chunk" (a bottom-right-aligned causal mask).
    """
    pos = torch.arange(length, device=device)
    k_chunk = torch.cat([torch.full((num_prefix,), -1, device=device), torch.zeros(length, device=device, dtype=torch.long)])
    k_pos = torch.cat([torch.zeros(num_prefix, device=device, dtype=torch.long), pos])
    k_is_memory = torch.arange(num_prefix + length, device=device) < num_prefix
    return visible(torch.zeros_like(pos)[:, None], pos[:, None], k_chunk[None], k_pos[None], k_is_memory[None])[None, None]


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" mask -> additive mask (0 / most negative), as eager attention expects."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


@dataclass
class ChunkSegment:
    """One chunk of one sample: tokens ``[start, end)`` that see the first ``num_memory`` L1 keys."""

    sample: int
    start: int
    end: int
    num_memory: int


def chunk_segments(chunk_ids: torch.Tensor, is_l1: torch.Tensor) -> list[ChunkSegment]:
    """Contiguous runs of equal chunk id per sample (padding, chunk id < 0, is skipped)."""
    segments: list[ChunkSegment] = []
    ids = chunk_ids.cpu()
    l1_before = torch.cumsum(is_l1.cpu().to(torch.long), dim=1) - is_l1.cpu().to(torch.long)
    for b in range(ids.shape[0]):
        values, counts = torch.unique_consecutive(ids[b], return_counts=True)
        start = 0
        for value, count in zip(values.tolist(), counts.tolist()):
            if value >= 0:
                segments.append(ChunkSegment(b, start, start + count, int(l1_before[b, start])))
            start += count
    return segments


@dataclass
class AttentionKernel:
    """Runs selective windowed attention for one batch layout; shared by all layers of a forward.

    ``prefix`` (chunked kernel only) supplies extra keys/values per layer that every query sees, already
    rotated: inference uses it for the bi-layer cache. ``capture(layer_idx, query_rot, key_pre_rope,
    value)`` is called by every layer, so inference can score and store them.
    """

    kind: str
    backend: str
    chunk_ids: torch.Tensor
    positions: torch.Tensor
    is_l1: torch.Tensor
    memory: MemoryIndex
    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    capture: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    _mask: object = field(default=None, repr=False)
    _segments: list[ChunkSegment] | None = field(default=None, repr=False)
    # chunk masks by (prefix, length): every layer of a forward attends with the same ones, made once
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KERNELS:
            raise ValueError(f"unknown attention kernel {self.kind!r}; choose one of {', '.join(KERNELS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.prefix is not None and self.kind != "chunked":
            raise ValueError("an external KV prefix (inference cache) needs the 'chunked' kernel")

    def attend(self, module, query, key, value, memory_key, memory_value, dtype) -> torch.Tensor:
        """Attention output ``[B, n, H, D]`` for rotated ``query``/``key`` ``[B, H*, n, D]``.

        ``memory_key``/``memory_value`` ``[B, H_kv, m, D]`` are the L1 tokens' keys rotated at
        their memory positions and their values.
        """
        if self.kind == "chunked":
            return self._attend_chunked(module, query, key, value, memory_key, memory_value)
        keys = torch.cat([key, memory_key], dim=2)
        values = torch.cat([value, memory_value], dim=2)
        if self.kind == "flex":
            from transformers.integrations.flex_attention import flex_attention_forward

            if self._mask is None:
                self._mask = flex_block_mask(self.chunk_ids, self.positions, self.memory)
            return flex_attention_forward(module, query, keys, values, self._mask, scaling=module.scaling)[0]
        if self._mask is None:
            mask = dense_mask(self.chunk_ids, self.positions, self.memory)
            self._mask = mask if self.backend == "sdpa" else to_additive(mask, dtype)
        return _interface(self.backend)(module, query, keys, values, self._mask, dropout=0.0, scaling=module.scaling)[0]

    def _attend_chunked(self, module, query, key, value, memory_key, memory_value) -> torch.Tensor:
        if self._segments is None:
            self._segments = chunk_segments(self.chunk_ids, self.is_l1)
        fn = _interface(self.backend)
        bsz, heads, n, dim = query.shape
        outputs: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
        filled = [0] * bsz
        prefix = self.prefix(module.layer_idx) if self.prefix is not None else None
        for seg in self._segments:
            b, s, e = seg.sample, seg.start, seg.end
            k_parts = [memory_key[b : b + 1, :, : seg.num_memory], key[b : b + 1, :, s:e]]
            v_parts = [memory_value[b : b + 1, :, : seg.num_memory], value[b : b + 1, :, s:e]]
            if prefix is not None:
                # to the layer's device too: under a device map the cache sits on the main device
                k_parts.insert(0, prefix[0][b : b + 1].to(key.device, key.dtype))
                v_parts.insert(0, prefix[1][b : b + 1].to(value.device, value.dtype))
            num_prefix = sum(p.shape[2] for p in k_parts[:-1])
            keys, values, q = torch.cat(k_parts, 2), torch.cat(v_parts, 2), query[b : b + 1, :, s:e]
            if self.backend == "sdpa":
                out = _prefix_causal_sdpa(fn, module, q, keys, values, num_prefix, self._chunk_mask)
            else:
                mask = self._chunk_mask(num_prefix, e - s, query.device, query.dtype)
                out = fn(module, q, keys, values, mask, dropout=0.0, scaling=module.scaling)[0]
            if s > filled[b]:  # padding or skipped tokens before this segment
                outputs[b].append(query.new_zeros(1, s - filled[b], heads, dim))
            outputs[b].append(out)
            filled[b] = e
        for b in range(bsz):
            if filled[b] < n:
                outputs[b].append(query.new_zeros(1, n - filled[b], heads, dim))
        return torch.cat([torch.cat(parts, dim=1) for parts in outputs], dim=0)

    def _chunk_mask(self, num_prefix: int, length: int, device: torch.device, dtype: torch.dtype | None = None):
        """``chunk_mask`` (boolean, or additive in ``dtype``), made once per forward and shared by its layers
        (at 128K a chunk's mask over 4K L1 entries took 16 ms to build against 250 ms for its attention, one thread)."""
        key = (num_prefix, length, str(device), dtype)  # under a device map, layers sit on several devices
        if key not in self._masks:
            mask = chunk_mask(num_prefix, length, device)
            self._masks[key] = mask if dtype is None else to_additive(mask, dtype)
        return self._masks[key]


def _prefix_causal_sdpa(fn, module, query, keys, values, num_prefix: int, masks=None) -> torch.Tensor:
    """``chunk_mask`` attention through SDPA, picking the cheaper of two exact forms.

    ``chunk_mask(P, L)`` is rows ``P..P+L`` of a square causal mask. When the prefix is shorter than
    the chunk (training chunks, cache building), ``P`` zero queries are put in front and SDPA's
    ``is_causal`` path runs (flash kernels, no mask tensor): ``(P + L)^2 / 2`` scores. When the
    prefix is longer (a question over a refilled cache), the explicit mask costs ``L (P + L)`` and
    wins. A single query sees every key and needs no mask at all.
    """
    length = query.shape[2]
    if length == 1:
        return fn(module, query, keys, values, None, dropout=0.0, scaling=module.scaling, is_causal=False)[0]
    if num_prefix >= length:
        mask = (masks or chunk_mask)(num_prefix, length, query.device)
        return fn(module, query, keys, values, mask, dropout=0.0, scaling=module.scaling)[0]
    if num_prefix:
        query = torch.cat([query.new_zeros(*query.shape[:2], num_prefix, query.shape[3]), query], dim=2)
    out = fn(module, query, keys, values, None, dropout=0.0, scaling=module.scaling, is_causal=True)[0]
    return out[:, num_prefix:]


def _interface(backend: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]
