"""Distillation from the frozen base (``train.distill``): the same model with full attention is the teacher.

ACRE's student sees a compressed past (L1 memory, refilled spans); the teacher is the frozen base with
plain causal attention over the same raw tokens and no L1 tokens, run under ``no_grad`` in the same
step. Where compression loses nothing the two agree and the KL gives no gradient; where it loses
something the teacher's whole next-token distribution says what was lost (CEPE, KV-Distill, context
distillation), a denser target than one label.

Which student tokens learn from it (the ``distill`` mask of a batch):

* stage 1: raw tokens of chunks ``>= 1`` with a label -- the ones whose prediction depends on the L1
  memory (chunk 0 sees everything the teacher sees, but for its own L1 tokens);
* stage 2: the answer tokens.

The teacher keeps only its ``top_k`` probabilities (renormalised), both sides at ``temperature`` T:
``KL = sum_i p_i (log p_i - log q_i)`` over the teacher's top-k ids, times ``T^2`` (Hinton's scaling,
so the gradient size does not depend on T). The step's loss per label token is
``weight * KL + (1 - weight) * CE``; ``weight = 0`` runs no teacher at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.interleave import IGNORE_INDEX

ROWS = 512  # logit rows alive at once (x vocab x 4 B)


def distill_rows(batch: dict[str, torch.Tensor], stage: int) -> torch.Tensor:
    """``[B, n]`` bool: the student tokens the KL applies to (see the module docstring)."""
    labelled = batch["labels"] != IGNORE_INDEX
    if stage == 2:
        return labelled
    return labelled & (batch["chunk_ids"] >= 1) & ~batch["is_l1"].bool()


@torch.no_grad()
def teacher_top_k(model: nn.Module, raw_ids: torch.Tensor, at: torch.Tensor, top_k: int,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's ``(log-probabilities [R, k] renormalised over its top-k, token ids [R, k])`` after the
    raw tokens ``at`` of ``raw_ids [n]`` (each predicts the next raw token), with full causal attention."""
    hidden = model.model(input_ids=raw_ids[None], use_cache=False).last_hidden_state[0]
    picked = hidden.index_select(0, at.to(hidden.device))
    logps, index = [], []
    for start in range(0, len(picked), ROWS):
        logits = model.lm_head(picked[start : start + ROWS]).float() / temperature
        top = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
        logps.append(torch.log_softmax(top.values, dim=-1))
        index.append(top.indices)
    if not logps:
        return hidden.new_zeros(0, top_k, dtype=torch.float32), torch.zeros(0, top_k, dtype=torch.long, device=hidden.device)
    return torch.cat(logps), torch.cat(index)


def batch_kl_sum(model: nn.Module, batch: dict[str, torch.Tensor], hidden: torch.Tensor, stage: int, top_k: int,
                 temperature: float) -> tuple[torch.Tensor, int]:
    """``(KL sum, KL tokens)`` of a padded ACRE batch whose student states are ``hidden [B, n, d]``."""
    rows = distill_rows(batch, stage)
    raw = ~batch["is_l1"].bool() & (batch["chunk_ids"] >= 0)
    total, count = hidden.new_zeros((), dtype=torch.float32), 0
    for b in range(rows.shape[0]):
        if not bool(rows[b].any()):
            continue
        raw_index = torch.cumsum(raw[b].long(), 0) - 1  # each student row's place in its raw sequence
        at = raw_index[rows[b]]
        logp, ids = teacher_top_k(model, batch["input_ids"][b][raw[b]], at, top_k, temperature)
        total = total + kl_sum(model.lm_head, hidden[b][rows[b]], logp, ids, temperature)
        count += int(rows[b].sum())
    return total, count


def kl_sum(lm_head: nn.Module, hidden: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor,
           temperature: float) -> torch.Tensor:
    """``sum over rows of T^2 * KL(teacher top-k || student)``; ``hidden [R, d]`` are the student's states."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, len(hidden), ROWS):
        part = slice(start, start + ROWS)
        student = torch.log_softmax(lm_head(hidden[part]).float() / temperature, dim=-1)
        q = student.gather(1, teacher_ids[part])
        p = teacher_logp[part]
        total = total + (p.exp() * (p - q)).sum()
    return total * temperature**2


def reference_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """The definition, slowly (tests): per row, KL over the teacher's top-k renormalised at T, times T^2."""
    total = torch.zeros(())
    for t, s in zip(teacher_logits.float(), student_logits.float()):
        ids = torch.topk(t, top_k).indices
        p = F.softmax(t[ids] / temperature, dim=-1)
        q = F.log_softmax(s / temperature, dim=-1)[ids]
        total = total + (p * (p.log() - q)).sum()
    return total * temperature**2
