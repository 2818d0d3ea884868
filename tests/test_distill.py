"""Distillation from the frozen base (train/distill.py): the batched top-k KL equals its definition,
vanishes where the student is the teacher, and weight 0 is the plain loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from acre_train.modeling import acre_forward, acre_parameters, interleave
from acre_train.modeling.batch import pad_batch
from acre_train.train.distill import batch_kl_sum, distill_rows, kl_sum, reference_kl, teacher_top_k
from acre_train.train.model import LossModule

from helpers import perturbed_acre_model as _model, random_ids as _ids

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(lengths, first_chunk=16, stride=12, interval=4):
    rows = [interleave(_ids(n, 10 + i), first_chunk=first_chunk, stride=stride, intervals=interval).as_dict()
            for i, n in enumerate(lengths)]
    return pad_batch(rows)


@pytest.mark.parametrize("arch,top_k,temperature", [("qwen2", 5, 1.0), ("llama", 17, 2.0)])
def test_batched_kl_equals_the_definition(arch, top_k, temperature):
    model = _model(arch)
    batch = _batch([41, 30])  # two rows of different length (padding), chunks >= 1 in both
    with torch.no_grad():
        out = acre_forward(model, **batch)
        got, count = batch_kl_sum(model, batch, out.hidden_states, stage=1, top_k=top_k, temperature=temperature)
        rows = distill_rows(batch, stage=1)
        want = torch.zeros(())
        for b in range(2):
            raw = ~batch["is_l1"][b].bool() & (batch["chunk_ids"][b] >= 0)
            teacher = model.lm_head(model.model(input_ids=batch["input_ids"][b][raw][None]).last_hidden_state[0])
            raw_at = torch.cumsum(raw.long(), 0) - 1
            student = model.lm_head(out.hidden_states[b][rows[b]])
            want = want + reference_kl(teacher[raw_at[rows[b]]], student, top_k, temperature)
    assert count == int(rows.sum()) > 0 and not bool((rows & (batch["chunk_ids"] == 0)).any())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(got) > 0


def test_kl_vanishes_where_the_student_is_the_teacher_and_a_single_chunk_has_none():
    model = _model("qwen2")
    ids = torch.as_tensor(_ids(20, 3))
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
        vocab = model.config.vocab_size
        logp, top = teacher_top_k(model, ids, torch.arange(20), top_k=vocab, temperature=1.5)
        assert float(kl_sum(model.lm_head, hidden, logp, top, 1.5)) == pytest.approx(0.0, abs=1e-4)
        single = _batch([14])  # one chunk: the student's memory holds nothing the teacher lacks
        out = acre_forward(model, **single)
        kl, count = batch_kl_sum(model, single, out.hidden_states, stage=1, top_k=8, temperature=1.0)
    assert count == 0 and float(kl) == 0.0


def test_weight_zero_is_the_plain_loss_and_weight_one_trains_only_l1():
    batch = _batch([41])
    plain = LossModule(_model("qwen2"))(**dict(batch))[0]
    zero = LossModule(_model("qwen2"), distill={"weight": 0.0, "temperature": 1.0, "top_k": 8, "stage": 1})(**dict(batch))[0]
    assert torch.equal(plain, zero)
    model = _model("qwen2")
    module = LossModule(model, distill={"weight": 1.0, "temperature": 1.0, "top_k": 8, "stage": 1})
    loss, _, _ = module(**dict(batch))
    assert module.last_kl[1] > 0 and float(loss) == pytest.approx(module.last_kl[0], rel=1e-6)
    loss.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for n, p in acre_parameters(model) if "acre_k_proj" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if "acre_" not in n)
