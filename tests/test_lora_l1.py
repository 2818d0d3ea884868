"""LoRA-parameterised L1 projections (``model.l1: lora``): peft's LoRA delta on frozen base copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from acre_train.cli import main as cli_main
from acre_train.export import export_model
from acre_train.infer.load import load_export
from acre_train.modeling import acre_forward, acre_parameters, attach_acre, interleave
from acre_train.modeling.batch import pad_batch
from acre_train.tiny import tiny_model
from acre_train.train.model import LossModule

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = list(range(3, 60)) + list(range(100, 140))
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0}


def _batch():
    plan = interleave(IDS, first_chunk=32, stride=16, intervals=[4, 8, 4, 8, 4, 8])
    return pad_batch([plan.as_dict()])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return acre_forward(model, **_batch(), return_logits=True).logits


def test_untrained_lora_l1_equals_the_full_copy_l1_exactly():
    full = attach_acre(tiny_model("qwen2", vocab_size=1024, eos_token_id=0, seed=1))
    lora = attach_acre(tiny_model("qwen2", vocab_size=1024, eos_token_id=0, seed=1), lora=LORA)
    assert all(torch.count_nonzero(p) == 0 for n, p in acre_parameters(lora) if "lora_B" in n)
    torch.testing.assert_close(_logits(lora), _logits(full), rtol=0, atol=0)


def test_a_step_moves_only_lora_and_l1_embedding_weights():
    model = attach_acre(tiny_model("llama", vocab_size=1024, eos_token_id=0, seed=2), lora=LORA)
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {n for n, _ in acre_parameters(model)}
    assert all(".lora_A." in n or ".lora_B." in n or n.endswith("acre_embed_tokens.weight") for n in names)
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)  # decay would move dead weights too
    for _ in range(2):  # the first step moves only lora_B (lora_A's gradient is zero while B is zero)
        loss_sum, count, _ = LossModule(model)(**_batch())
        (loss_sum / count).backward()
        opt.step()
        opt.zero_grad()
    moved = {n for n, p in model.named_parameters(remove_duplicate=False) if not torch.equal(p, before[n])}
    # The last layer's L1 queries only produce L1 outputs, which no label and no later layer reads:
    # their gradient is exactly zero (with full copies too), so that LoRA B stays put.
    last = model.config.num_hidden_layers - 1
    dead = {f"model.layers.{last}.self_attn.acre_q_proj.lora_B.acre.weight",
            f"model.layers.{last}.self_attn.acre_q_proj.lora_A.acre.weight"}
    assert moved == names - dead


def test_lora_run_trains_exports_adapter_only_and_reloads(tmp_path, capsys):
    """tiny stage 1 with model.l1=lora -> export --adapter-only (a small file) -> same logits."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_stage1.yaml"
    run = f"output_root={tmp_path}"
    assert cli_main(["train", str(recipe), run, "run_name=lora", "model.l1=lora", "model.lora.rank=4",
                     "train.max_steps=3", "checkpoint.every_steps=3", "logging.progress_bar=false",
                     f"data.path={tmp_path}/data"]) == 0
    out = tmp_path / "export"
    assert cli_main(["export", str(tmp_path / "lora"), str(out), "--adapter-only"]) == 0
    weights = out / "acre_adapter.safetensors"
    from safetensors.torch import load_file

    stored = load_file(str(weights))
    assert stored and all(".lora_A." in k or ".lora_B." in k or "acre_embed_tokens" in k for k in stored)
    assert any(torch.count_nonzero(v) for k, v in stored.items() if ".lora_B." in k)  # training moved B
    loaded, _, data = load_export(out)
    assert data["acre"]["l1"] == "lora" and data["acre"]["lora"]["rank"] == 4
    for name, p in acre_parameters(loaded):
        torch.testing.assert_close(p, stored[name], rtol=0, atol=0)

    from acre_train.export.checkpoint import load_checkpoint_model

    trained = load_checkpoint_model(str(tmp_path / "lora")).model
    torch.testing.assert_close(_logits(loaded), _logits(trained), rtol=1e-5, atol=1e-5)
    # A full export of a LoRA run reloads too (frozen copies + LoRA in one folder).
    full = export_model(trained, tmp_path / "full", inference={"first_chunk": 32, "stride": 16, "interval": 4})
    torch.testing.assert_close(_logits(load_export(full)[0]), _logits(trained), rtol=1e-5, atol=1e-5)


def test_chunked_lm_head_loss_gives_the_one_shot_loss_and_l1_gradients():
    """Loss computed 7 labelled tokens at a time (logits recomputed in backward) equals full logits."""
    from acre_train.modeling import adapter

    def grads(rows: int | None):
        model = attach_acre(tiny_model("qwen2", vocab_size=1024, eos_token_id=0, seed=4), lora=LORA)
        with torch.no_grad():
            for name, p in acre_parameters(model):
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        if rows is None:  # reference: every logit at once
            out = acre_forward(model, **_batch(), return_logits=True)
        else:
            old, adapter.LM_HEAD_ROWS = adapter.LM_HEAD_ROWS, rows
            try:
                out = acre_forward(model, **_batch())
            finally:
                adapter.LM_HEAD_ROWS = old
        out.loss_sum.backward()
        return out.loss_sum.detach(), {n: p.grad.clone() for n, p in acre_parameters(model)}

    ref_loss, ref = grads(None)
    loss, got = grads(7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    assert got.keys() == ref.keys()
    for name in ref:
        # fp32, summed in another order (7 rows at a time, logits recomputed in backward): on some CPUs one
        # gradient of ~0.03 of 128 differed by 1.4e-6 (rel 5e-5), so 1e-6 was below the float noise; a wrong
        # gradient (a missed chunk, a doubled row) is off by orders of magnitude more
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)


def test_vanilla_loss_through_the_chunked_head_equals_transformers_loss():
    """Vanilla SFT shares the chunked head: its loss sum and gradients equal the model's own full-logit loss."""
    from acre_train.modeling import adapter

    def run(ours: bool):
        model = tiny_model("qwen2", vocab_size=1024, eos_token_id=0, seed=6)
        ids = torch.randint(5, 1024, (1, 40), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[0, :9] = -100
        if ours:
            old, adapter.LM_HEAD_ROWS = adapter.LM_HEAD_ROWS, 5
            try:  # the collator's labels are already shifted for LossModule: position t predicts labels[t]
                loss, count, _ = LossModule(model)(input_ids=ids[:, :-1], labels=labels[:, 1:],
                                                   attention_mask=torch.ones_like(ids[:, :-1]))
            finally:
                adapter.LM_HEAD_ROWS = old
            loss = loss / count
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    ref_loss, ref_grad = run(False)
    loss, grad = run(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_step_flop_estimate_agrees_with_torch_flop_counter():
    """The trainer's GFLOP/s figure rests on step_flops; torch counts every matmul of the same step."""
    from torch.utils.flop_counter import FlopCounterMode

    from acre_train.train.cost import step_flops

    model = attach_acre(tiny_model("qwen2", vocab_size=1024, eos_token_id=0, seed=5, hidden_size=128,
                                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2), lora=LORA)
    batch = _batch()
    with FlopCounterMode(display=False) as counter:
        loss_sum, count, _ = LossModule(model)(**batch)
        loss_sum.backward()
    measured = counter.get_total_flops()
    estimate = step_flops(model, [batch])
    assert 0.8 < estimate / measured < 1.2, (estimate, measured)
