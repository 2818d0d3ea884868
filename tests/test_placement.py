"""Big-model placement (``--device-map``): a max_memory that forces weights onto disk changes nothing.

On this CPU machine the map can only send blocks to ``cpu`` or ``disk``; accelerate's hooks then bring
each offloaded block's weights in while it runs. ACRE's forward calls the embedding, every layer, the
norm and the LM head itself, so each must carry its own hook: these tests would fail (meta tensors
reached, or different numbers) if one did not.
"""

from __future__ import annotations

import pytest
import torch

from acre_train.export.writer import export_model
from acre_train.infer.engine import AcreEngine
from acre_train.infer.load import load_export
from acre_train.infer.placement import Placement, execution_device, parse_max_memory, refine_device_map
from acre_train.modeling.bilayer import CacheSettings
from acre_train.infer.settings import RefillSettings
from acre_train.tiny import tiny_model
from helpers import perturbed_acre_model, random_ids

SETTINGS = CacheSettings(first_chunk=32, stride=16, interval=4)
REFILL = RefillSettings(working_window=40, max_refill=16, max_new_tokens=4)


def _export(tmp_path, adapter_only: bool):
    model = perturbed_acre_model("qwen2", seed=3)
    if adapter_only:
        tiny_model("qwen2", seed=3).save_pretrained(tmp_path / "base")
        return export_model(model, tmp_path / "export", adapter_only=True, base_model=str(tmp_path / "base"))
    return export_model(model, tmp_path / "export")


def _answers(model):
    engine = AcreEngine(model, cache_settings=SETTINGS, refill=REFILL)
    cache = engine.build(random_ids(90, 1))
    return [engine.answer(cache, random_ids(6, 2 + q)) for q in range(2)]


@pytest.mark.parametrize("adapter_only", [False, True])
def test_a_map_that_offloads_to_disk_gives_the_same_logits_and_answers(tmp_path, adapter_only):
    path = _export(tmp_path, adapter_only)
    plain, _, _ = load_export(path)
    total = sum(p.numel() * p.element_size() for p in plain.parameters())
    placement = Placement("auto", {"cpu": int(total * 0.4)}, str(tmp_path / "offload"))
    placed, _, _ = load_export(path, placement=placement)

    where = placed.hf_device_map
    assert "disk" in where.values() and "cpu" in where.values(), where
    assert {"model.embed_tokens", "model.norm", "lm_head", "model.layers.0"} <= set(where)  # each its own hook
    assert where["model.acre_embed_tokens"] == "cpu"  # one row, read directly: never offloaded
    assert any(p.device.type == "meta" for p in placed.parameters())  # the weights really are elsewhere
    assert execution_device(placed) == torch.device("cpu")

    ids = torch.tensor([random_ids(20, 7)])
    with torch.no_grad():
        torch.testing.assert_close(placed(ids).logits, plain(ids).logits, rtol=0, atol=1e-6)
    for got, want in zip(_answers(placed), _answers(plain)):
        assert got.selected == want.selected and got.token_ids == want.token_ids
        torch.testing.assert_close(got.first_logits, want.first_logits, rtol=0, atol=1e-5)


def test_a_map_to_disk_without_a_folder_is_refused(tmp_path):
    path = _export(tmp_path, adapter_only=False)
    with pytest.raises(ValueError, match="--offload-folder"):
        load_export(path, placement=Placement("auto", {"cpu": 1000}))


def test_the_map_is_refined_to_what_acre_calls_directly():
    model = perturbed_acre_model("qwen2")
    refined = refine_device_map({"model": 0, "lm_head": "disk"}, model)
    layers = {f"model.layers.{i}" for i in range(model.config.num_hidden_layers)}
    assert set(refined) == {"model.embed_tokens", "model.acre_embed_tokens", "model.norm", "model.rotary_emb",
                            "lm_head"} | layers
    assert refined["model.layers.0"] == 0 and refined["model.acre_embed_tokens"] == 0
    assert refined["lm_head"] == ("disk" if not model.config.tie_word_embeddings else 0)


def test_max_memory_parses_and_bad_spellings_say_how():
    assert parse_max_memory("0=20GiB, cpu=60GiB") == {0: "20GiB", "cpu": "60GiB"}
    assert parse_max_memory("cpu=20000") == {"cpu": 20000}  # bytes
    assert parse_max_memory(None) is None
    with pytest.raises(ValueError, match="DEVICE=AMOUNT"):
        parse_max_memory("20GiB")


def test_the_shipped_accelerate_config_is_one_accelerate_reads():
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(Path(__file__).resolve().parents[1] / "launch/accelerate_multi_gpu.yaml"))
    assert config.distributed_type == "MULTI_GPU" and config.num_processes == 8 and config.mixed_precision == "no"


def test_an_unknown_map_name_is_refused_with_the_choices(tmp_path):
    path = _export(tmp_path, adapter_only=False)
    with pytest.raises(ValueError, match="auto, balanced, balanced_low_0, sequential or a JSON map"):
        load_export(path, placement=Placement("automatic"))
