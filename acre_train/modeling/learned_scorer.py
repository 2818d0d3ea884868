"""A learned refill scorer that cannot hurt decoding (``train.refill_loss.params: scorer``).

The refill-aware loss with ``params: shared`` trains the L1 keys that decoding also attends to, so a
better ranking can cost answers. ``params: scorer`` trains its own small parameters instead: per
scoring layer and query head a low-rank map of the question's pre-RoPE query,

    q' = q + B_h (A_h q)            (A_h: rank x D, B_h: D x rank, B starts at zero)

used only to rank spans (``refill.scorer ... learned=1``). It never enters a forward pass: the cache,
the refilled KV and every decoded logit are those of the same L1 weights without it. Because q is the
output of the layer's query projection, the map is a LoRA on that projection's output side.

The weights travel in ``acre_scorer.safetensors`` beside the export's L1 weights (never inside the
model's state dict, so a cache's fingerprint does not depend on them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

SCORER_WEIGHTS = "acre_scorer.safetensors"
STATE_PREFIX = "acre_scorer."  # how a training checkpoint names these weights beside the L1 ones
_ATTR = "_acre_query_map"


class QueryMap(nn.Module):
    """Low-rank per-head maps of the pre-RoPE queries of ``layers`` (identity at initialisation).

    >>> qmap = QueryMap([3], num_heads=2, head_dim=4, rank=2)
    >>> q = torch.randn(2, 5, 4)
    >>> torch.equal(qmap(3, q), q)  # B starts at zero
    True
    """

    def __init__(self, layers: Sequence[int], num_heads: int, head_dim: int, rank: int = 8):
        super().__init__()
        if rank < 1:
            raise ValueError(f"scorer rank must be >= 1, got {rank}")
        self.layers = sorted({int(x) for x in layers})
        self.rank = int(rank)
        self.down = nn.ParameterDict({str(x): nn.Parameter(torch.randn(num_heads, rank, head_dim) / math.sqrt(head_dim))
                                      for x in self.layers})
        self.up = nn.ParameterDict({str(x): nn.Parameter(torch.zeros(num_heads, head_dim, rank)) for x in self.layers})

    @classmethod
    def for_model(cls, model: nn.Module, layers: Sequence[int], rank: int) -> "QueryMap":
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(layers, config.num_attention_heads, head_dim, rank)

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q [H, n, D]`` (pre-RoPE) of ``layer`` -> the mapped queries, fp32."""
        if str(layer) not in self.down:
            raise ValueError(f"the learned scorer holds layers {self.layers}, not layer {layer}")
        down, up = self.down[str(layer)].float(), self.up[str(layer)].float()
        q = q.float()
        return q + torch.matmul(torch.matmul(q, down.to(q.device).transpose(1, 2)), up.to(q.device).transpose(1, 2))

    # ------------------------------------------------------------------------------------ files

    def state(self) -> dict[str, torch.Tensor]:
        """Flat ``{"down.7": ..., "up.7": ...}`` (what checkpoints store under ``acre_scorer.``)."""
        return {k: v.detach() for k, v in self.state_dict().items()}

    def save(self, path: str | Path, spec: str) -> None:
        from safetensors.torch import save_file

        meta = {"format": "pt", "layers": json.dumps(self.layers), "rank": str(self.rank), "scorer": spec}
        save_file({k: v.contiguous().cpu() for k, v in self.state().items()}, str(path), metadata=meta)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "QueryMap":
        layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("down.")})
        if not layers or any(f"up.{x}" not in state for x in layers):
            raise ValueError(f"not a learned-scorer state (keys {sorted(state)[:4]})")
        heads, rank, dim = state[f"down.{layers[0]}"].shape
        qmap = cls(layers, heads, dim, rank)
        qmap.load_state_dict(state)
        return qmap

    @classmethod
    def load(cls, path: str | Path) -> "QueryMap":
        from ..files import read_safetensors

        return cls.from_state(read_safetensors(path))


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's weights -> ``(L1 weights, learned-scorer weights)`` (wrapper prefixes allowed)."""
    l1, scorer = {}, {}
    for key, tensor in state.items():
        at = key.find(STATE_PREFIX)
        if at == 0 or (at > 0 and key[at - 1] == "."):
            scorer[key[at + len(STATE_PREFIX):]] = tensor
        else:
            l1[key] = tensor
    return l1, scorer


def attach_query_map(model: nn.Module, qmap: QueryMap | None) -> None:
    """Give ``model`` a learned scorer for ranking. Stored outside ``nn.Module`` registration on
    purpose: it is in no state dict (no fingerprint change) and no forward can reach it."""
    object.__setattr__(model, _ATTR, qmap)


def query_map_of(model: nn.Module) -> QueryMap | None:
    return getattr(model, _ATTR, None)
