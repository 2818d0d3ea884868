"""The one RoPE module: equal to each architecture's own attention; un-rotate inverts rotate; delta
rotation equals rotating at the new position."""

from __future__ import annotations

import pytest
import torch
import transformers

from acre_train.modeling.rope import Rope
from acre_train.tiny import tiny_model


def _rotary(**rope_parameters):
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    if rope_parameters:
        cfg.rope_parameters = {**cfg.rope_parameters, **rope_parameters}
    return Rope.of(transformers.AutoModelForCausalLM.from_config(cfg))


def _plain_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Textbook RoPE in float64: pair (i, i + d/2) rotated by pos * inv_freq[i]."""
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def test_rotate_matches_model_and_textbook():
    rot = _rotary()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 50, 16, generator=g)
    pos = torch.randint(0, 3000, (50,), generator=g)
    # float32 path: exactly what the model's attention applies
    cos, sin = rot.rotary_emb(k, pos[None])
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    _, want = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.equal(rot.rotate(k, pos), want)
    assert torch.allclose(rot.rotate(k.double(), pos), _plain_rope(k.double(), pos, rot.rotary_emb.inv_freq), atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_unrotate_returns_key(dtype, tol):
    rot = _rotary()
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 64, 16, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (64,), generator=g)
    assert torch.allclose(rot.unrotate(rot.rotate(k, pos), pos), k, atol=tol, rtol=0)


def test_unrotate_with_attention_scaling():
    rot = _rotary(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    assert rot.scale != 1.0  # the case the 1/s**2 factor exists for
    k = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    pos = torch.arange(100, 110)
    assert torch.allclose(rot.unrotate(rot.rotate(k, pos), pos), k, atol=1e-12)


def test_delta_rotation_equals_rotation_at_new_position():
    rot = _rotary()
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 40, 16, generator=g, dtype=torch.float64)
    old = torch.randint(0, 5000, (40,), generator=g)
    new = torch.randint(0, 5000, (40,), generator=g)
    moved = rot.delta_rotate(rot.rotate(k, old), new - old)
    assert torch.allclose(moved, rot.rotate(k, new), atol=1e-10)
    # a scalar delta, in float32 at small positions (fp32 angle rounding grows with the position)
    k32 = k.float()
    old = torch.arange(0, 40)
    assert torch.allclose(rot.delta_rotate(rot.rotate(k32, old), 7), rot.rotate(k32, old + 7),
                          atol=1e-5)
    # reposition (un-rotate + rotate) is what methods use; it matches the model's own key in fp32
    old, new = torch.arange(0, 40), torch.arange(3000, 3040)
    assert torch.allclose(rot.reposition(rot.rotate(k32, old), old, new), rot.rotate(k32, new),
                          atol=1e-5)


def test_shape_errors():
    rot = _rotary()
    with pytest.raises(ValueError, match="positions"):
        rot.rotate(torch.zeros(1, 2, 5, 16), torch.arange(4))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_rope_of_a_model_equals_its_own_attention(arch):
    """Keys rotated by Rope.of(model) are bit-identical to what the architecture's attention code
    computes from the same pre-RoPE keys at the same positions (its own rotary_emb and apply fn)."""
    import inspect

    model = tiny_model(arch)
    attn = model.model.layers[0].self_attn
    apply_rotary_pos_emb = inspect.getmodule(type(attn)).apply_rotary_pos_emb
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 30, model.config.head_dim, generator=g)
    pos = torch.randint(0, 20000, (30,), generator=g)
    cos, sin = model.model.rotary_emb(k, pos[None])
    _, want = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.equal(Rope.of(model).rotate(k, pos), want)
