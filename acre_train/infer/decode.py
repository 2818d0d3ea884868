"""The one decoding loop: greedy, or sampling through transformers' logits processors.

Every answer -- the bi-layer cache engine, the evaluation rows, plain full attention -- is decoded by
:func:`decode`; what differs between them is only how the next logits are computed (``step``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def decode(first_logits: torch.Tensor, step: Callable[[int], torch.Tensor], *, max_new_tokens: int,
           stop_ids: Iterable[int] = (), temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[int]:
    """Generated token ids: the first from ``first_logits``, each next from ``step(previous_token)``.

    Stops after a token in ``stop_ids`` (kept in the output) or ``max_new_tokens``. ``temperature``
    0 is greedy; otherwise transformers' temperature and top-p warpers shape the distribution and a
    CPU generator seeded with ``seed`` samples it (same seed, same answer).
    """
    stop = set(stop_ids)
    pick = _sampler(temperature, top_p, seed)
    tokens: list[int] = []
    logits = first_logits
    for _ in range(max_new_tokens):
        token = pick(logits)
        tokens.append(token)
        if token in stop or len(tokens) == max_new_tokens:
            break
        logits = step(token)
    return tokens


def _sampler(temperature: float, top_p: float, seed: int) -> Callable[[torch.Tensor], int]:
    if temperature == 0:
        return lambda logits: int(torch.argmax(logits))
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    no_ids = torch.zeros((1, 0), dtype=torch.long)

    def sample(logits: torch.Tensor) -> int:
        scores = warpers(no_ids, logits.detach().float().cpu().reshape(1, -1))
        return int(torch.multinomial(torch.softmax(scores[0], dim=-1), 1, generator=generator))

    return sample
