"""The ACRE model against a slow, obviously-correct reference of DESIGN.md §3 (fp32, 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from acre_train.modeling import (
    IGNORE_INDEX,
    acre_forward,
    acre_parameters,
    attach_acre,
    count_parameters,
    interleave,
)
from acre_train.modeling.batch import pad_batch
from acre_train.tiny import tiny_config, tiny_model

ATOL = 1e-5
ARCHS = ["qwen2", "llama"]


# ------------------------------------------------------------------------------ slow reference

def _rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotate one head vector by RoPE at ``position`` (rotate-half convention), from the formula."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angle = torch.cat([position * inv_freq, position * inv_freq]).to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(angle) + rotated * torch.sin(angle)


def _proj(attn, name: str, x: torch.Tensor, l1: bool) -> torch.Tensor:
    layer = getattr(attn, "acre_" + name) if l1 and hasattr(attn, "acre_" + name) else getattr(attn, name)
    return layer(x)


def reference_logits(model, plan) -> torch.Tensor:
    """Token by token: each query attends to exactly the keys §3 says, at the positions §3 says."""
    cfg = model.config
    theta = cfg.rope_parameters["rope_theta"]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dec = model.model
    ids = torch.as_tensor(plan.input_ids)
    is_l1, chunk, pos, mem = plan.is_l1.tolist(), plan.chunk_ids.tolist(), plan.positions.tolist(), plan.memory_positions.tolist()
    n = len(ids)
    h = dec.embed_tokens(ids).clone()
    for i in range(n):
        if is_l1[i]:
            h[i] = dec.acre_embed_tokens.weight[0]
    for layer in dec.layers:
        attn = layer.self_attn
        hd = attn.head_dim
        x = layer.input_layernorm(h)
        outs = []
        for i in range(n):
            q = _proj(attn, "q_proj", x[i], is_l1[i]).view(heads, hd)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
            q = _rope(q, pos[i], theta)
            keys, values = [], []
            for j in range(n):
                if chunk[j] == chunk[i] and j <= i:
                    key_pos = pos[j]
                elif is_l1[j] and chunk[j] < chunk[i]:
                    key_pos = mem[j]
                else:
                    continue
                k = _proj(attn, "k_proj", x[j], is_l1[j]).view(kv_heads, hd)
                if hasattr(attn, "k_norm"):
                    k = attn.k_norm(k)
                keys.append(_rope(k, key_pos, theta))
                values.append(_proj(attn, "v_proj", x[j], is_l1[j]).view(kv_heads, hd))
            keys, values = torch.stack(keys), torch.stack(values)  # [K, kv_heads, hd]
            head_out = []
            for head in range(heads):
                g = head // (heads // kv_heads)
                weights = torch.softmax(keys[:, g] @ q[head] / math.sqrt(hd), dim=0)
                head_out.append(weights @ values[:, g])
            outs.append(_proj(attn, "o_proj", torch.cat(head_out), is_l1[i]))
        h = h + torch.stack(outs)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(dec.norm(h))


def reference_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    labels = torch.as_tensor(labels)
    keep = labels != IGNORE_INDEX
    return F.cross_entropy(logits[keep], labels[keep])


# ------------------------------------------------------------------------------ helpers

def _acre_model(arch: str, **kw):
    model = attach_acre(tiny_model(arch, **kw))
    # Make L1 weights differ from the base so a path that mixes them up cannot pass.
    torch.manual_seed(1)
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    return model


def _run(model, plans, **kw):
    batch = pad_batch([p.as_dict() for p in plans])
    return acre_forward(model, **batch, return_logits=True, **kw), batch


def _plans(vocab: int = 512):
    torch.manual_seed(3)
    a = torch.randint(2, vocab, (61,)).tolist()
    b = torch.randint(2, vocab, (43,)).tolist()
    # Several chunks, mixed intervals, carry-over across chunk boundaries, an L1 at a chunk end.
    return [
        interleave(a, first_chunk=16, stride=9, intervals=[3, 5, 2, 7, 4, 3]),
        interleave(b, first_chunk=12, stride=11, intervals=[4, 2, 6, 3]),
    ]


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", ["chunked", "dense"])
def test_no_l1_single_chunk_equals_base_model(arch, kernel):
    model = tiny_model(arch)
    ids = torch.randint(2, 512, (1, 40))
    with torch.no_grad():
        expected = model(ids).logits
        attach_acre(model)
        plan = interleave(ids[0].tolist(), first_chunk=64, stride=64, intervals=1000)
        assert plan.num_l1 == 0 and plan.num_chunks == 1
        out, _ = _run(model, [plan], kernel=kernel)
    torch.testing.assert_close(out.logits, expected, atol=ATOL, rtol=0)


_REFERENCES: dict[str, list[torch.Tensor]] = {}


def _reference_for(arch: str, model, plans) -> list[torch.Tensor]:
    """The slow reference is the same for every kernel of one architecture: compute it once."""
    if arch not in _REFERENCES:
        with torch.no_grad():
            _REFERENCES[arch] = [reference_logits(model, plan) for plan in plans]
    return _REFERENCES[arch]


@pytest.mark.parametrize("arch", ARCHS + ["qwen3", "mistral"])
@pytest.mark.parametrize("kernel,backend", [("chunked", "sdpa"), ("chunked", "eager"), ("dense", "sdpa"), ("dense", "eager")])
def test_fast_paths_equal_reference(arch, kernel, backend):
    model = _acre_model(arch)  # deterministic: same weights for every kernel
    plans = _plans()
    references = _reference_for(arch, model, plans)
    with torch.no_grad():
        out, batch = _run(model, plans, kernel=kernel, backend=backend)
        total, count = 0.0, 0
        for row, plan in enumerate(plans):
            ref = references[row]
            torch.testing.assert_close(out.logits[row, : len(plan)], ref, atol=ATOL, rtol=0)
            n = int((torch.as_tensor(plan.labels) != IGNORE_INDEX).sum())
            total += float(reference_loss(ref, plan.labels)) * n
            count += n
    assert out.num_tokens == count
    assert abs(float(out.loss) - total / count) < ATOL


def test_flex_kernel_is_refused_on_cpu():
    model = _acre_model("qwen2")
    with pytest.raises(ValueError, match="kernel 'flex' is refused on CPU"):
        _run(model, _plans(), kernel="flex")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention is CUDA-only here")
def test_flex_kernel_equals_reference():
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = _acre_model("qwen2").cuda()
    plans = _plans()
    with torch.no_grad():
        try:
            out, _ = _run(model, plans, kernel="flex")
        except Exception as exc:  # pragma: no cover - depends on the platform's compiler
            pytest.skip(f"flex attention unavailable here: {type(exc).__name__}: {exc}")
        for row, plan in enumerate(plans):
            torch.testing.assert_close(out.logits[row, : len(plan)], reference_logits(model, plan), atol=ATOL, rtol=0)


def test_padding_does_not_change_a_sample():
    model = _acre_model("qwen2")
    plans = _plans()
    with torch.no_grad():
        together, _ = _run(model, plans)
        alone, _ = _run(model, plans[1:])
    n = len(plans[1])
    torch.testing.assert_close(together.logits[1, :n], alone.logits[0, :n], atol=ATOL, rtol=0)


def test_one_optimizer_step_changes_only_l1_parameters():
    model = _acre_model("qwen2").train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in acre_parameters(model)}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    out, _ = _run(model, _plans())
    out.loss.backward()
    opt.step()
    acre_names = {n for n, _ in acre_parameters(model)}
    for name, p in model.named_parameters():
        if name in acre_names:
            assert not torch.equal(p, before[name]), f"{name} did not move"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_last_chunk_loss_reaches_first_chunk_l1_projections(checkpointing):
    model = _acre_model("llama").train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(2, 512, (40,)).tolist()
    # Only chunk 0 has L1 tokens; later chunks' intervals exceed their size. So any gradient in the
    # L1 k/v projections must come through chunk 0's L1 memory.
    plan = interleave(ids, first_chunk=16, stride=8, intervals=[4, 100, 100, 100])
    assert plan.is_l1[plan.chunk_ids != 0].sum() == 0 and plan.is_l1[plan.chunk_ids == 0].sum() == 4
    labels = plan.labels.copy()
    labels[plan.chunk_ids != plan.chunk_ids.max()] = IGNORE_INDEX
    sample = {**plan.as_dict(), "labels": labels}
    batch = pad_batch([sample])
    acre_forward(model, **batch).loss.backward()
    grads = {n: p.grad for n, p in acre_parameters(model)}
    for layer in range(model.config.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            g = grads[f"model.layers.{layer}.self_attn.acre_{proj}.weight"]
            assert g is not None and g.abs().sum() > 0, f"no gradient in layer {layer} acre_{proj}"
    assert grads["model.acre_embed_tokens.weight"].abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = _acre_model("qwen2").train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        out, _ = _run(model, _plans())
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in acre_parameters(model)})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=0)


def test_trainable_count_of_a_qwen25_3b_shaped_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True, eos_token_id=151645,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = count_parameters(attach_acre(model))
    assert counts["trainable"] == 188_837_888
    assert counts["acre_embed_tokens"] == 2048
    assert counts["acre_q_proj"] == 36 * (2048 * 2048 + 2048)


def test_l1_weights_start_as_copies_of_the_base():
    model = attach_acre(tiny_model("qwen2"), train_o_proj=True)
    attn = model.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(attn, "acre_" + name).weight, getattr(attn, name).weight)
    assert torch.equal(model.model.acre_embed_tokens.weight[0], model.model.embed_tokens.weight[model.config.eos_token_id])


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(first_chunk=8, stride=8, intervals=0), "interval"),
    (dict(first_chunk=0, stride=8, intervals=4), "first_chunk"),
    (dict(first_chunk=8, stride=0, intervals=4), "stride"),
    (dict(first_chunk=8, stride=8, intervals=[4, 4, 4]), "3 intervals for 2 chunks"),
])
def test_bad_plan_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        interleave(list(range(16)), **kwargs)


def test_positions_beyond_the_model_maximum_are_an_error():
    model = attach_acre(tiny_model("qwen2", max_position_embeddings=32))
    plan = interleave(list(range(2, 50)), first_chunk=48, stride=48, intervals=1000)
    with pytest.raises(ValueError, match="max_position_embeddings is 32"):
        _run(model, [plan])
    # The same text fits once chunking compresses positions.
    ok = interleave(list(range(2, 50)), first_chunk=16, stride=16, intervals=8)
    assert ok.max_position < 32
    _run(model, [ok])


def test_unsupported_architecture_is_named():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"llama, qwen2, qwen3, mistral; got model_type='gpt2'"):
        attach_acre(model)


def test_unknown_kernel_is_an_error():
    model = attach_acre(tiny_model("qwen2"))
    plan = interleave(list(range(2, 20)), first_chunk=8, stride=8, intervals=4)
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        _run(model, [plan], kernel="fast")


def test_plain_calls_still_behave_like_the_base_model():
    base = tiny_model("llama")
    ids = torch.randint(2, 512, (2, 20))
    with torch.no_grad():
        expected = base(ids).logits
        got = attach_acre(base)(ids).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_tiny_config_has_gqa():
    config = tiny_config("llama")
    assert config.num_key_value_heads < config.num_attention_heads


@pytest.mark.parametrize("num_prefix,length", [(0, 5), (3, 1), (4, 4), (7, 3), (2, 9)])
def test_chunk_mask_is_the_rule_and_the_padded_causal_form(num_prefix, length):
    from acre_train.modeling.visibility import chunk_mask, visible

    mask = chunk_mask(num_prefix, length, torch.device("cpu"))[0, 0]
    # From the rule directly: memory keys of an earlier chunk, then the chunk's own keys.
    q_pos = torch.arange(length)
    expected = torch.stack([
        torch.stack([
            visible(torch.tensor(1), q_pos[i], torch.tensor(0 if k < num_prefix else 1),
                    torch.tensor(0 if k < num_prefix else k - num_prefix), torch.tensor(k < num_prefix))
            for k in range(num_prefix + length)
        ]) for i in range(length)
    ])
    assert torch.equal(mask, expected)
    # The SDPA fast path relies on this: rows P.. of a square causal mask.
    square = torch.ones(num_prefix + length, num_prefix + length, dtype=torch.bool).tril()
    assert torch.equal(mask, square[num_prefix:])
