"""Stage 2 in the refilled layout (train/refill_sim.py): the training forward computes what
``AcreEngine.answer`` computes, for the same spans, and trains only L1 weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from acre_train.infer import AcreEngine, RefillSettings
from acre_train.modeling.scorer_spec import ScorerSettings
from acre_train.modeling.scoring import spans_with
from acre_train.modeling import acre_parameters, interleave
from acre_train.train.refill_sim import SimSettings, collate_sim, sim_forward, sim_sample, unpad

from helpers import perturbed_acre_model as _model, random_ids as _ids

pytestmark = pytest.mark.usefixtures("one_thread")



def _engine(model, settings: SimSettings) -> AcreEngine:
    """The inference engine a run trained with ``settings`` answers with."""
    refill = RefillSettings(working_window=settings.working_window, max_refill=settings.max_refill,
                            scorer=settings.scorer, neighbors=settings.neighbors, grow=settings.grow,
                            grow_shape=settings.grow_shape)
    return AcreEngine(model, cache_settings=settings.cache_settings(), refill=refill)

def _row(ctx, question, answer, evidence=(), first_chunk=16, stride=16, interval=4):
    """A stage-2 row as data prep writes it (its own plan and intervals differ from the simulation's)."""
    raw = ctx + question + answer
    labels = [-100] * (len(ctx) + len(question)) + answer
    plan = interleave(raw, first_chunk=first_chunk, stride=stride, intervals=interval, raw_labels=labels)
    return {**plan.as_dict(), "evidence": [list(evidence)] if evidence else [], "question": [len(ctx), len(ctx) + len(question)]}


def _settings(**kw) -> SimSettings:
    base = dict(first_chunk=16, stride=12, interval=4, working_window=1000, max_refill=8,
                scorer=ScorerSettings.parse("l1:layers=-1"))
    return SimSettings(**{**base, **kw})


# 43 tokens: chunks 16 + 12 + 12 and a raw tail of 3; 40: no tail; 33 at interval 5: chunks 16 + 12 (a
# tail of 5) and 3 pending raw tokens after the last L1 entry (28 is no multiple of 5); []: no refill;
# a set: those raw tokens (a grown refill, cutting spans).
@pytest.mark.parametrize("arch,ctx_len,selected,interval", [("qwen2", 43, [1, 4], 4), ("llama", 40, [0, 5], 4),
                                                            ("qwen2", 43, [], 4), ("llama", 33, [2], 5),
                                                            ("qwen2", 43, {2, 3, 6, 7, 8, 21, 30}, 4)])
def test_training_logits_equal_the_engines_answer_for_a_fixed_selection(arch, ctx_len, selected, interval):
    model = _model(arch)
    settings = _settings(interval=interval)
    ctx, question, answer = _ids(ctx_len, 1), _ids(5, 2), _ids(4, 3)
    sample = unpad(collate_sim([sim_sample(_row(ctx, question, answer, first_chunk=8, stride=8, interval=2),
                                           settings)]), 0)
    if isinstance(selected, set):
        selected = torch.tensor([t in selected for t in range(int(sample["span_bounds"][-1]))])
    with torch.no_grad():
        ((out, chosen),) = sim_forward(model, sample, settings, selected=[selected], return_logits=True)
    labels = sample["open_labels"]
    rows = torch.nonzero(labels != -100).reshape(-1)
    assert len(rows) == len(answer) and labels[rows].tolist() == answer

    engine = _engine(model, settings)
    cache = engine.build(ctx)
    closed = 40 if ctx_len >= 40 else 28
    assert len(cache.tail_ids) == ctx_len - closed
    assert (cache.num_pending > 0) == (interval == 5)
    for j, row in enumerate(rows.tolist()):
        # The engine's logits after question + answer[:j] predict answer[j]: the training row's label there.
        want = engine.answer(cache, question + answer[:j], selected=selected, max_new_tokens=1).first_logits
        torch.testing.assert_close(out.logits[0, row].float(), want, atol=2e-5, rtol=1e-5)


def test_the_simulated_selection_is_the_engines_and_forcing_brings_the_evidence():
    model = _model("qwen2")
    settings = _settings(max_refill=8)  # k = 2 spans of 4
    ctx, question, answer = _ids(60, 4), _ids(5, 5), _ids(3, 6)
    row = _row(ctx, question, answer, evidence=(9, 11))
    engine = _engine(model, settings)
    cache = engine.build(ctx)
    plain = unpad(collate_sim([sim_sample(row, settings)]), 0)
    with torch.no_grad():
        ((_, chosen),) = sim_forward(model, plain, settings)
        assert torch.equal(chosen, engine.answer(cache, question, max_new_tokens=1).refilled)
        forced = unpad(collate_sim([sim_sample(row, settings, force=True)]), 0)
        ((_, with_evidence),) = sim_forward(model, forced, settings)
    # Raw tokens 9, 10 lie in span 2 (raw 8..11) of chunk 0.
    assert np.flatnonzero(forced["evidence_spans"].numpy()).tolist() == [2]
    spans = torch.nonzero(spans_with(with_evidence, cache.span_bounds)).flatten().tolist()
    assert 2 in spans and len(spans) == 2


def test_gradients_reach_l1_weights_through_the_refilled_prefix():
    model = _model("qwen2")
    settings = _settings()
    ctx, question, answer = _ids(43, 7), _ids(5, 8), _ids(4, 9)
    sample = unpad(collate_sim([sim_sample(_row(ctx, question, answer), settings)]), 0)
    ((out, _),) = sim_forward(model, sample, settings, selected=[[1, 3]])
    out.loss_sum.backward()
    grads = {n: p.grad for n, p in acre_parameters(model)}
    assert all(g is not None for g in grads.values())
    # The L1 keys of earlier chunks reach the answer only through the prefix: they must get a gradient.
    k_proj = [g for n, g in grads.items() if "acre_k_proj" in n]
    assert k_proj and all(float(g.abs().sum()) > 0 for g in k_proj)
    assert all(p.grad is None for n, p in model.named_parameters() if not n.split(".")[-2].startswith("acre_")
               and "acre_" not in n)


def _packed_row(ctx, qas, evidence, first_chunk=16, stride=16, interval=4):
    """One context followed by several question+answer segments (what a packed stage-2 row holds)."""
    raw, labels, question, ev, owner = list(ctx), [-100] * len(ctx), [], [], []
    for j, (q, a) in enumerate(qas):
        question += [len(raw), len(raw) + len(q)]
        raw += q + a
        labels += [-100] * len(q) + a
    for j, span in enumerate(evidence):
        ev += list(span)
        owner.append(j)
    plan = interleave(raw, first_chunk=first_chunk, stride=stride, intervals=interval, raw_labels=labels)
    return {**plan.as_dict(), "evidence": ev, "evidence_question": owner, "question": question}


def test_a_packed_sample_is_the_sum_of_its_single_questions():
    """One context forward for three questions: the loss (and each question's selection) equals that of the
    three single-question samples, and the gradients agree."""
    from acre_train.modeling import acre_parameters as params
    from acre_train.train.refill_sim import sim_loss_sum

    settings = _settings(max_refill=8, scorer=ScorerSettings.parse("l2:layers=-1,heads=max"))
    ctx = _ids(43, 11)
    qas = [(_ids(5, 12 + j), _ids(3 + j, 20 + j)) for j in range(3)]
    evidence = [(4, 6), (20, 22), (30, 33)]
    packed = _packed_row(ctx, qas, evidence)
    singles = [_row(ctx, q, a, evidence=e) for (q, a), e in zip(qas, evidence)]
    forces = [True, False, True]
    losses, grads = [], []
    for samples in ([sim_sample(packed, settings, force=forces)],
                    [sim_sample(r, settings, force=f) for r, f in zip(singles, forces)]):
        model = _model("qwen2")
        loss, count, _ = sim_loss_sum(model, collate_sim(samples), settings)
        loss.backward()
        losses.append((loss, count))
        grads.append({n: p.grad for n, p in params(model)})
    assert losses[0][1] == losses[1][1] == sum(len(a) for _, a in qas)
    torch.testing.assert_close(losses[0][0], losses[1][0], atol=1e-5, rtol=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4)


def test_training_refuses_a_scorer_that_needs_the_question_s_text():
    """The training pass has token ids only: query=question would select otherwise than the export answers."""
    with pytest.raises(ValueError, match="query=all only"):
        _settings(scorer=ScorerSettings.parse("l2:layers=1,query=question"))
