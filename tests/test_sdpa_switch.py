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
