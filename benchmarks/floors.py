"""The least a question can cost on this machine: the floor every benchmark prints beside its arms.

A floor is computed from the work an arm chooses to do (the rows it runs through the layers, the KV
entries they attend, the tokens it decodes) at this machine's measured rates, so the ratio
measured / floor is the arm's implementation overhead alone, not its algorithm:

* prefill: the weights' FLOPs for every row, attention's for every (row, key) pair and one LM-head
  row, at the fp32 matmul rate; or the time to read the weights once, whichever is longer;
* each decoding step after the first token: reading the weights and the attended KV once, at the
  bandwidth of torch's own matrix-vector product (the op a decoding step is made of; on 2 cores it
  reads ~0.7x as fast as a plain sum does, which ``gbps`` reports beside it);
* a cache build (full attention's prefill, ACRE's chunked build): the weights' FLOPs for every row
  and attention's for every (row, key) pair it attends, at the matmul rate.

    rates = machine_rates("cpu")
    question_floor(model, rows=32, keys=8192 + 32, new_tokens=8, rates=rates)["floor_question_s"]
"""

from __future__ import annotations

import functools
import time
from collections import Counter


def machine_rates(device: str) -> dict[str, float]:
    """This machine's rates, measured now, best of five: the fp32 matmul rate (``gflops``, a 2048-square
    product), the memory read bandwidth of a sum over 256 MiB (``gbps``), and that of a matrix-vector
    product over a 256 MiB matrix (``gemv_gbps``), which decoding floors are computed at: a decoding step
    reads every weight through that op, and no torch code reads them faster."""
    import torch

    a = torch.randn(2048, 2048, device=device)
    big = torch.ones(64 * 2**20, device=device)  # 256 MiB, touched once so no page fault is timed
    matrix, vector = big.view(8192, 8192), torch.ones(8192, device=device)
    flops, read, gemv = [], [], []
    for _ in range(5):
        tic = time.perf_counter()
        a @ a
        flops.append(2 * 2048**3 / (time.perf_counter() - tic) / 1e9)
        tic = time.perf_counter()
        big.sum()
        read.append(big.numel() * 4 / (time.perf_counter() - tic) / 1e9)
        tic = time.perf_counter()
        matrix @ vector
        gemv.append(big.numel() * 4 / (time.perf_counter() - tic) / 1e9)
    return {"gflops": max(flops), "gbps": max(read), "gemv_gbps": max(gemv)}


def _shape(model) -> tuple[int, int, int, int, int]:
    """(layers, heads, kv heads, head dim, body parameters) of the base (L1 projections not counted)."""
    cfg = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and ".acre_" not in n)
    return (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            model.model.layers[0].self_attn.head_dim, body)


def build_floor(model, *, rows: float, pairs: float, rates: dict[str, float]) -> float:
    """Floor (s) of running ``rows`` token rows through every layer, attending ``pairs`` (row, key) pairs
    in all: the weights' and attention's FLOPs at the matmul rate (one LM-head row)."""
    layers, heads, _, head_dim, body = _shape(model)
    flops = 2 * body * rows + 4 * layers * heads * head_dim * pairs + 2 * model.lm_head.weight.numel()
    return flops / (rates["gflops"] * 1e9)


def acre_build_work(num_raw: int, first_chunk: int, stride: int, interval: int, per_chunk: list | None = None
                    ) -> tuple[int, int]:
    """(rows, attended pairs) of ACRE's cache build: every finished chunk's rows (raw + L1) attend the
    L1 entries of the chunks before it and themselves, causally. ``per_chunk``: filled with each chunk's rows."""
    from acre_train.modeling.bilayer import CacheSettings, finished_chunks
    from acre_train.modeling.interleave import interleave

    import numpy as np

    done, raw_done = finished_chunks(num_raw, CacheSettings(first_chunk, stride, interval))
    plan = interleave(np.zeros(raw_done, dtype=np.int64), first_chunk=first_chunk, stride=stride, intervals=interval)
    rows = pairs = memory = 0
    for t in range(done):
        sel = plan.chunk_ids == t
        r = int(sel.sum())
        if per_chunk is not None:
            per_chunk.append(r)
        rows += r
        pairs += r * memory + r * (r + 1) // 2
        memory += int(plan.is_l1[sel].sum())
    return rows, pairs


def question_floor(model, *, rows: float, keys: float, new_tokens: int, rates: dict[str, float]) -> dict[str, float]:
    """Floor of answering with ``rows`` token rows through every layer, each attending ``keys`` KV
    entries (the mean), then ``new_tokens - 1`` decoding steps over ``keys`` entries (fp32 weights)."""
    layers, heads, kv_heads, head_dim, body = _shape(model)
    head = model.lm_head.weight.numel()
    prefill_flops = 2 * body * rows + 4 * layers * heads * head_dim * rows * keys + 2 * head
    weight_bytes = 4 * (body + head)
    kv_bytes = 2 * layers * kv_heads * head_dim * 4 * keys
    read = rates.get("gemv_gbps", rates["gbps"]) * 1e9
    prefill = max(prefill_flops / (rates["gflops"] * 1e9), weight_bytes / read)
    step = (weight_bytes + kv_bytes) / read
    return {"floor_prefill_s": prefill, "floor_decode_s": (new_tokens - 1) * step,
            "floor_question_s": prefill + (new_tokens - 1) * step}


@functools.lru_cache(maxsize=16)  # one measurement per (model, rows): score and prefill share theirs
def gemm_seconds(model, rows: int, repeats: int = 3) -> float:
    """Measured time of the weight products alone for ``rows`` token rows through every layer: one
    layer's own ``Linear`` modules (q, k, v, o, gate, up, down; L1 copies not counted) run on random
    ``[rows, in]`` inputs, best of ``repeats``, times the number of layers, plus one LM-head row.

    The peak-rate floor prices every FLOP at a 2048-square product's rate; a question's few dozen rows
    (and a decoding step's one) multiply the same matrices far slower on a CPU. This is the floor at the
    rate torch reaches for those very shapes: what no implementation built on its products beats."""
    import torch

    layer = model.model.layers[0]
    linears = [m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and "acre" not in n]
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    inputs = [torch.randn(rows, m.in_features, device=device, dtype=dtype) for m in linears]
    head_in = torch.randn(1, model.lm_head.in_features, device=device, dtype=dtype)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            tic = time.perf_counter()
            for m, x in zip(linears, inputs):
                m(x)
            per_layer = time.perf_counter() - tic
            tic = time.perf_counter()
            model.lm_head(head_in)
            best = min(best, per_layer * len(model.model.layers) + time.perf_counter() - tic)
    return best


def shape_floor(model, *, rows: int, keys: float, rates: dict[str, float]) -> float:
    """Floor (s) of ``rows`` rows attending ``keys`` entries, with the weight products at their measured
    shape rate (:func:`gemm_seconds`) and attention's FLOPs at the matmul rate."""
    layers, heads, _, head_dim, _ = _shape(model)
    return gemm_seconds(model, rows) + 4 * layers * heads * head_dim * rows * keys / (rates["gflops"] * 1e9)


def build_shape_floor(model, *, chunks: list[int], pairs: float, rates: dict[str, float]) -> float:
    """Floor (s) of a build that runs ``chunks`` row counts through every layer (one forward each: ACRE's
    chunks, or full attention's single prefill), attending ``pairs`` (row, key) pairs in all: the weight
    products at the rate torch measures for those very shapes (:func:`gemm_seconds`, measured at up to
    2048 rows and scaled by rows beyond), attention's FLOPs at the matmul rate."""
    layers, heads, _, head_dim, _ = _shape(model)
    weights = 0.0
    for rows, count in sorted(Counter(chunks).items()):
        measured = min(rows, 2048)
        weights += count * gemm_seconds(model, measured) * rows / measured
    return weights + 4 * layers * heads * head_dim * pairs / (rates["gflops"] * 1e9)
