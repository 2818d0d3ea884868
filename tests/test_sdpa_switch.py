"""grouped_kv_sdpa: masked SDPA on the CPU without copying KV heads, same logits, switch scoped to the block."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from acre_train.infer.growing_cache import GrowingCache
from acre_train.modeling.sdpa import FORCE_GQA, grouped_kv_sdpa
from acre_train.tiny import tiny_model
from helpers import random_ids


def _question_logits(model, context: list[int], question: list[int], calls: list[dict]) -> torch.Tensor:
    """Logits of a question over a cached context (a masked pass), recording every SDPA call's kwargs."""
    cache = GrowingCache(capacity=len(context) + len(question))
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
        sdpa = F.scaled_dot_product_attention

        def spy(q, k, v, *args, **kwargs):
            calls.append({"kv_heads": k.shape[1], "gqa": kwargs.get("enable_gqa", False),
                          "mask": kwargs.get("attn_mask") is not None})
            return sdpa(q, k, v, *args, **kwargs)

        F.scaled_dot_product_attention = spy
        try:
            return model(input_ids=torch.tensor([question]), cache=cache, use_cache=True).logits[0]
        finally:
            F.scaled_dot_product_attention = sdpa


def test_masked_question_pass_attends_grouped_heads_with_the_same_logits():
    model = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)  # GQA: 2 query heads per KV head
    context, question = random_ids(80, 1), random_ids(7, 2)
    plain_calls: list[dict] = []
    plain = _question_logits(model, context, question, plain_calls)
    grouped_calls: list[dict] = []
    with grouped_kv_sdpa("cpu"):
        grouped = _question_logits(model, context, question, grouped_calls)
    # without the switch transformers copies the 2 KV heads up to 4 under the mask; with it, SDPA groups them
    assert plain_calls and all(c["mask"] and c["kv_heads"] == 4 and not c["gqa"] for c in plain_calls)
    assert grouped_calls and all(c["mask"] and c["kv_heads"] == 2 and c["gqa"] for c in grouped_calls)
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)


def test_switch_is_scoped_and_leaves_other_devices_and_a_users_setting_alone(monkeypatch):
    monkeypatch.delenv(FORCE_GQA, raising=False)
    with grouped_kv_sdpa(torch.device("cpu")):
        assert os.environ[FORCE_GQA] == "1"
    assert FORCE_GQA not in os.environ
    with grouped_kv_sdpa("meta"):  # not the CPU: transformers' own choice stands
        assert FORCE_GQA not in os.environ
    monkeypatch.setenv(FORCE_GQA, "0")  # the user's explicit setting wins and survives the block
    with grouped_kv_sdpa("cpu"):
        assert os.environ[FORCE_GQA] == "0"
    assert os.environ[FORCE_GQA] == "0"


def _single_query_reference(query, key, value, mask, scaling):
    """Each query head on its own copy of its KV head (the obvious form)."""
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scaling)


def test_single_query_attention_equals_per_head_attention():
    from acre_train.modeling.sdpa import single_query_attention

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(*s, generator=g) for s in ((2, 6, 1, 8), (2, 2, 37, 8), (2, 2, 37, 8)))
    visible = torch.rand(2, 1, 1, 37, generator=g) > 0.3
    for mask in (None, visible, torch.zeros(2, 1, 1, 37).masked_fill(~visible, float("-inf"))):
        got = single_query_attention(query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(got, _single_query_reference(query, key, value, mask, 0.3), rtol=1e-6, atol=1e-6)


def test_decoding_steps_fold_single_queries_with_the_same_tokens_and_logits():
    """Greedy decoding over a cache: inside the block each one-token step runs SDPA once per KV head with
    the query heads as rows (no head copied); tokens equal and logits close to the plain run's."""
    model = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    context = random_ids(60, 3)

    def greedy(calls: list[dict]) -> tuple[list[int], list[torch.Tensor]]:
        cache = GrowingCache(capacity=80)
        sdpa = F.scaled_dot_product_attention

        def spy(q, k, v, *args, **kwargs):
            calls.append({"rows": q.shape[2], "heads": q.shape[1], "kv_heads": k.shape[1]})
            return sdpa(q, k, v, *args, **kwargs)

        tokens, logits = [], []
        with torch.no_grad():
            ids = torch.tensor([context])
            for _ in range(6):
                F.scaled_dot_product_attention = spy
                try:
                    out = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
                finally:
                    F.scaled_dot_product_attention = sdpa
                logits.append(out)
                tokens.append(int(out.argmax()))
                ids = torch.tensor([[tokens[-1]]])
        return tokens, logits

    plain_calls: list[dict] = []
    plain_tokens, plain_logits = greedy(plain_calls)
    folded_calls: list[dict] = []
    with grouped_kv_sdpa("cpu"):
        folded_tokens, folded_logits = greedy(folded_calls)
    steps = [c for c in folded_calls if c["heads"] == 2]  # decoding steps: 2 query rows per KV head, 2 KV heads
    assert len(steps) == 5 * model.config.num_hidden_layers and all(c["rows"] == 2 and c["kv_heads"] == 2 for c in steps)
    assert not [c for c in plain_calls if c["heads"] == 2]
    assert folded_tokens == plain_tokens
    torch.testing.assert_close(torch.stack(folded_logits), torch.stack(plain_logits), rtol=1e-5, atol=1e-5)


def test_the_single_query_route_is_scoped_to_the_block():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with grouped_kv_sdpa("cpu"):
        assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "acre_single_query", False)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
