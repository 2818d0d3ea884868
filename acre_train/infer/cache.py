"""Building a context's bi-layer cache (DESIGN.md §5 "Build"; the cache's data and layout are
``modeling/bilayer.py``), its fingerprint, and saving and loading it (``save_cache``, ``load_cache``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..files import atomic_path
from ..modeling.adapter import acre_forward
from ..modeling.bilayer import BiLayerCache, CacheSettings, finished_chunks, finished_length, span_layout
from ..modeling.interleave import interleave
from ..modeling.kv_buffer import KVBuffer
from ..modeling.rope import Rope

CACHE_FORMAT = "acre-bilayer-cache/1"


class CacheMismatchError(ValueError):
    """A saved cache was built by another model or with other settings."""


class ContextTooLongError(ValueError):
    """The context does not fit what the model and settings allow."""


# ---------------------------------------------------------------------------------- save/load

def save_cache(cache: BiLayerCache, path: str | Path) -> Path:
    """Write ``cache`` to one ``.safetensors`` file; its metadata carries the fingerprint."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "l1_keys": cache.l1_keys, "l1_values": cache.l1_values,
        "l2_keys": cache.l2_keys, "l2_values": cache.l2_values, "span_bounds": cache.span_bounds,
        "tail_ids": torch.tensor(cache.tail_ids, dtype=torch.int64),
    }
    for name, (low, high) in cache.boxes.items():
        tensors[f"box.{name}.min"], tensors[f"box.{name}.max"] = low, high
    if cache.tail_keys is not None:
        tensors["tail_keys"], tensors["tail_values"] = cache.tail_keys, cache.tail_values
    if cache.sentence_ends is not None:
        tensors["sentence_ends"] = cache.sentence_ends.to(torch.bool)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {"format": CACHE_FORMAT, "fingerprint": cache.fingerprint, "settings": cache.settings.as_dict(),
            "carry": cache.carry, "num_context_tokens": cache.num_context_tokens,
            "context_digest": cache.context_digest, "checksum": tensors_digest(tensors)}
    with atomic_path(path) as tmp:  # a half-written cache never carries the final name
        save_file(tensors, str(tmp), metadata={"acre_cache": json.dumps(meta)})
    return path


def load_cache(path: str | Path, model: nn.Module, settings: CacheSettings) -> BiLayerCache:
    """Load a saved cache for ``model`` and ``settings``; a cache built otherwise is an error.

    The raw (L2) keys and values stay in the file: safetensors maps it (its ``mmap`` backend) and the CPU
    tensors are views of that mapping, so they occupy file pages the kernel may drop and read again, not
    memory of their own (``benchmarks/cache_memory.py``)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {path}")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
        raise CacheMismatchError(f"{path} is not a readable cache file ({exc}); rebuild it") from exc
    with handle as f:
        raw_meta = (f.metadata() or {}).get("acre_cache")
        if raw_meta is None:
            raise CacheMismatchError(f"{path} is not an ACRE bi-layer cache (no 'acre_cache' metadata)")
        meta = json.loads(raw_meta)
        if meta.get("format") != CACHE_FORMAT:
            raise CacheMismatchError(f"{path}: cache format {meta.get('format')!r}, expected {CACHE_FORMAT!r}")
        if meta["settings"] != settings.as_dict():
            raise CacheMismatchError(
                f"{path} was built with settings {meta['settings']}, but this run uses {settings.as_dict()}; "
                "rebuild the cache or use the settings it was built with")
        expected = fingerprint(model, settings)
        if meta["fingerprint"] != expected:
            raise CacheMismatchError(
                f"{path} was built by another model (fingerprint {meta['fingerprint'][:12]}, this model "
                f"{expected[:12]}: different weights, dtype or architecture); rebuild the cache")
        t = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("checksum") and tensors_digest(t) != meta["checksum"]:
        raise CacheMismatchError(f"{path}: the stored tensors do not match their checksum (a damaged file); rebuild it")
    device = _device_of(model)
    l1_keys = t["l1_keys"].to(device)
    boxes = {key[4:-4]: (t[key].to(device), t[key[:-4] + ".max"].to(device))
             for key in t if key.startswith("box.") and key.endswith(".min")}
    return BiLayerCache(
        settings=settings, fingerprint=meta["fingerprint"], l1_keys=l1_keys,
        l1_keys_rot=Rope.of(model).rotate(l1_keys, torch.arange(l1_keys.shape[2])),
        l1_values=t["l1_values"].to(device), l2_keys=t["l2_keys"], l2_values=t["l2_values"],
        span_bounds=t["span_bounds"], tail_ids=t["tail_ids"].tolist(), carry=int(meta["carry"]),
        num_context_tokens=int(meta["num_context_tokens"]), context_digest=meta.get("context_digest", ""),
        boxes=boxes, tail_keys=t["tail_keys"].to(device) if "tail_keys" in t else None,
        tail_values=t["tail_values"].to(device) if "tail_values" in t else None,
        sentence_ends=t.get("sentence_ends"),
    )


# ------------------------------------------------------------------------------------ fingerprint

def fingerprint(model: nn.Module, settings: CacheSettings, sample: int = 1024) -> str:
    """A hash of the weights (names, shapes, dtypes, an evenly spaced sample of values) and settings.

    Sampling keeps this fast for multi-billion-parameter models while any retrained, different or
    differently-typed model still changes it. Config objects are left out on purpose: the same
    weights loaded from an export or held in memory after training give the same fingerprint.
    """
    from .placement import offloaded_tensor

    digest = hashlib.sha256(json.dumps(settings.as_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.device.type == "meta":  # offloaded by a device map (read from there), or never loaded
            tensor = offloaded_tensor(model, name)
            if tensor is None:
                raise ValueError("cannot fingerprint a model on the meta device")
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        values = flat[::step][:sample].to("cpu", torch.float64).numpy()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------- build

def check_context(model: nn.Module, num_raw: int, settings: CacheSettings, working_window: int | None) -> None:
    """Raise ``ContextTooLongError`` before any work when a context cannot be served."""
    plan_m = interleave(np.zeros(num_raw, dtype=np.int64), first_chunk=settings.first_chunk,
                        stride=settings.stride, intervals=settings.interval)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and plan_m.max_position >= limit:
        raise ContextTooLongError(
            f"a context of {num_raw} tokens reaches RoPE position {plan_m.max_position} while building the "
            f"cache (max_position_embeddings {limit}); use a larger interval or a smaller first_chunk/stride")
    done, _ = finished_chunks(num_raw, settings)
    m = int(plan_m.is_l1[plan_m.chunk_ids < done].sum())
    if working_window is not None and m > working_window:
        raise ContextTooLongError(
            f"a context of {num_raw} tokens gives {m} L1 entries, more than the working window "
            f"W = {working_window}; raise W, use a larger interval, or shorten the context")


def max_context_tokens(model: nn.Module, settings: CacheSettings, working_window: int | None) -> int | None:
    """The longest context (raw tokens) :func:`check_context` lets through: what a caller may read and
    tokenize at most before refusing (None: no limit). Both limits grow with the number of L1 entries,
    about one per ``interval`` tokens, which bounds the bisection over the plan."""
    positions = getattr(model.config, "max_position_embeddings", None)
    entries = min(x for x in (working_window, positions) if x is not None) if (working_window or positions) else None
    if entries is None:
        return None
    low, high = 0, (entries + 2) * settings.interval + settings.first_chunk + settings.stride
    while low < high:
        mid = (low + high + 1) // 2
        try:
            check_context(model, mid, settings, working_window)
        except ContextTooLongError:
            high = mid - 1
        else:
            low = mid
    return low


def build_cache(
    model: nn.Module,
    context_ids: Sequence[int],
    settings: CacheSettings,
    *,
    working_window: int | None = None,
    progress: bool | None = None,
    kernel_backend: str | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> BiLayerCache:
    """Stream ``context_ids`` through the plan of the whole context and return its bi-layer cache.

    Every finished chunk runs once, attending to the L1 cache built so far (a KV prefix at memory
    positions ``j``) and to itself; its L1 KV stays on the device, its raw tokens' KV moves to CPU as
    each layer produces it. ``progress``: show a bar (default: when there are more than 4 chunks).
    """
    ids = np.asarray(context_ids, dtype=np.int64).reshape(-1)
    check_context(model, len(ids), settings, working_window)
    device = _device_of(model)
    plan = interleave(ids, first_chunk=settings.first_chunk, stride=settings.stride, intervals=settings.interval)
    done, raw_done = finished_chunks(len(ids), settings)
    store = _BuildStore(model, raw_done, int(plan.is_l1[: finished_length(plan, done)].sum()), device)
    rope = Rope.of(model)
    # One forward per chunk. Chunks never read each other's raw tokens, so several could share a forward
    # (the kernel's in-batch L1 memory); at the shipped geometry (chunks of 528 rows) that measured 0.97x on
    # 2 CPU threads at 4K: the weight products already run at their large-shape rate.
    for t in _chunk_range(done, progress):
        sel = plan.chunk_ids == t
        is_l1 = torch.as_tensor(plan.is_l1[sel], device=device)
        l1_pos = torch.nonzero(is_l1, as_tuple=False).reshape(-1)
        raw_pos = torch.nonzero(~is_l1, as_tuple=False).reshape(-1)
        with torch.no_grad():
            acre_forward(
                model, input_ids=_t(plan.input_ids[sel], device)[None], is_l1=is_l1[None],
                chunk_ids=torch.zeros(1, int(sel.sum()), dtype=torch.long, device=device),
                positions=_t(plan.positions[sel], device)[None],
                memory_positions=_t(plan.memory_positions[sel], device)[None],
                kernel="chunked", backend=kernel_backend,
                prefix=store.l1_prefix(), capture=store.capture(l1_pos, raw_pos),
            )
        store.close_chunk(rope, l1_pos.numel(), raw_pos.numel())
        if on_chunk is not None:
            on_chunk(t + 1, done)
    if store.pinned:
        torch.cuda.synchronize(device)  # the non-blocking L2 copies have landed

    bounds, carry = span_layout(plan, done, raw_done)
    return BiLayerCache(
        settings=settings, fingerprint=fingerprint(model, settings),
        l1_keys=store.l1_keys, l1_keys_rot=store.l1.keys, l1_values=store.l1.values,
        l2_keys=store.l2.keys, l2_values=store.l2.values,
        span_bounds=torch.as_tensor(bounds, dtype=torch.int64),
        tail_ids=ids[raw_done:].tolist(), carry=carry,
        num_context_tokens=len(ids), context_digest=context_digest(ids),
    )


def _chunk_range(done: int, progress: bool | None):
    """The finished chunks' indices, with a bar when asked (default: more than 4 chunks)."""
    if not (done > 4 if progress is None else progress):
        return range(done)
    from tqdm.auto import tqdm

    return tqdm(range(done), desc="building cache", unit="chunk")


class _BuildStore:
    """Where a cache build writes, chunk after chunk, all of it preallocated.

    L2 (raw tokens) goes straight into CPU buffers, pinned when the model is on CUDA so the per-layer
    copies overlap with compute, and never copied again. L1 stays on the device; each chunk writes
    (and rotates to memory positions) only its own entries, so a build costs O(chunks), not O(chunks^2)
    re-concatenations and re-rotations. Every part is a ``KVBuffer`` (``modeling/kv_buffer.py``) written
    layer by layer during a chunk and committed when the chunk is done: the chunk's later layers see the
    memory of the chunks before it, never its own new entries.
    """

    def __init__(self, model: nn.Module, num_raw: int, num_l1: int, device: torch.device):
        layers = model.config.num_hidden_layers
        kv_heads, head_dim = _kv_shape(model)
        like = torch.empty(layers, kv_heads, 0, head_dim, dtype=next(model.parameters()).dtype)
        self.pinned = device.type == "cuda"
        self.l2 = KVBuffer.empty(like, num_raw, pin_memory=self.pinned)  # pre-RoPE (CPU)
        self.l1 = KVBuffer.empty(like.to(device), num_l1)  # keys rotated to memory positions 0..m-1, values
        self.l1_keys = torch.empty_like(self.l1.keys)  # the same keys, pre-RoPE

    def l1_prefix(self) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None:
        """The L1 memory built so far, as the next chunk's KV prefix (rotated keys, values) per layer."""
        if self.l1.length == 0:
            return None
        return lambda layer: tuple(t[None] for t in self.l1.filled(layer))

    def capture(self, l1_pos: torch.Tensor, raw_pos: torch.Tensor):
        """The capture hook of one chunk: L2 leaves the device as soon as a layer produced it; L1 stays."""
        raw = slice(self.l2.length, self.l2.length + raw_pos.numel())
        new = slice(self.l1.length, self.l1.length + l1_pos.numel())

        def capture(layer: int, _q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
            self.l2.keys[layer, :, raw].copy_(key[0].index_select(1, raw_pos), non_blocking=self.pinned)
            self.l2.values[layer, :, raw].copy_(value[0].index_select(1, raw_pos), non_blocking=self.pinned)
            self.l1_keys[layer, :, new] = key[0].index_select(1, l1_pos)
            self.l1.values[layer, :, new] = value[0].index_select(1, l1_pos)

        return capture

    def close_chunk(self, rope: Rope, num_l1: int, num_raw: int) -> None:
        """Rotate the chunk's new L1 keys to their memory positions; count the chunk as built."""
        new = slice(self.l1.length, self.l1.length + num_l1)
        self.l1.keys[:, :, new] = rope.rotate(self.l1_keys[:, :, new], torch.arange(new.start, new.stop))
        self.l1.commit(num_l1)
        self.l2.commit(num_raw)


def context_digest(ids: Sequence[int] | np.ndarray) -> str:
    """SHA-256 of a context's token ids (what ``chat --load-cache --context`` compares)."""
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's bytes, in name order: flipped bytes in a saved cache are refused."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy())  # no copy of the bytes
    return digest.hexdigest()


def _kv_shape(model: nn.Module) -> tuple[int, int]:
    attn = model.model.layers[0].self_attn
    return model.config.num_key_value_heads, attn.head_dim


def _device_of(model: nn.Module) -> torch.device:
    from .placement import execution_device

    return execution_device(model)


def _t(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array), dtype=torch.long, device=device)
