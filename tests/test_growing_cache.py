"""GrowingCache (infer/growing_cache.py): the same keys, values and logits as transformers' DynamicCache
through prefill, decoding, crop-and-reuse of a shared context and buffer growth; no per-step copy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from acre_train.infer.growing_cache import GrowingCache
from acre_train.tiny import tiny_model


def _run(model, cache, context: list[int], questions: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of: the context once, then per question its prefill and ``steps`` greedy steps, the cache
    cropped back to the context after each question (the eval's shared-context pattern)."""
    out = []
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
        for q in questions:
            logits = model(input_ids=torch.tensor([q]), cache=cache, use_cache=True).logits[0, -1]
            out.append(logits)
            for _ in range(steps):
                token = int(logits.argmax())
                logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
                out.append(logits)
            cache.crop(len(context) - cache.get_seq_length())
            assert cache.get_seq_length() == len(context)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("capacity", [0, 40, 4096])  # 0 and 40: the buffer must grow (doubling) on the way
def test_growing_cache_equals_dynamic_cache(arch, capacity, one_thread):
    model = tiny_model(arch, vocab_size=256, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    context = torch.randint(3, 256, (37,), generator=g).tolist()
    questions = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9)]
    want = _run(model, DynamicCache(config=model.config), context, questions, steps=6)
    cache = GrowingCache(capacity=capacity)
    got = _run(model, cache, context, questions, steps=6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    layer = cache.layers[0]
    assert layer.length == 37 and layer.buffer.capacity >= 37 + 9 + 6  # the buffer kept its room


def test_decoding_writes_in_place_without_copying_the_cache():
    cache = GrowingCache(capacity=64)
    k = torch.randn(1, 2, 10, 4)
    cache.update(k, k.clone(), 0)
    buffer = cache.layers[0].buffer.keys
    for _ in range(20):
        new = torch.randn(1, 2, 1, 4)
        keys, _ = cache.update(new, new.clone(), 0)
        assert keys.data_ptr() == buffer.data_ptr() and torch.equal(keys[..., -1:, :], new)
    assert cache.get_seq_length() == 30
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(3)


def test_the_kv_buffer_grows_keeping_written_tokens_and_counts_only_committed_ones():
    from acre_train.modeling.kv_buffer import KVBuffer

    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    buf = KVBuffer.empty(keys[:, :, :0], capacity=4)
    buf.append(keys[:, :, :3], values[:, :, :3])
    buf.write(3, keys[0, :, 3:5], values[0, :, 3:5], index=0)  # one layer of a chunk, past the room
    assert buf.length == 3 and buf.capacity >= 5
    for layer in (1, 2):
        buf.write(3, keys[layer, :, 3:5], values[layer, :, 3:5], index=layer)
    assert torch.equal(buf.filled(1)[0], keys[1, :, :3])  # not yet counted
    buf.commit(2)
    assert torch.equal(buf.filled()[0], keys) and torch.equal(buf.filled()[1], values)
    with pytest.raises(ValueError, match="past a buffer"):
        buf.commit(buf.capacity)
