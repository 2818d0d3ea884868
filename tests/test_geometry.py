"""One window-geometry type (modeling/geometry.py) from the data manifest to inference:
manifest -> recipe -> export config -> ``inference_settings`` used by chat/generate and eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from acre_train.infer.settings import inference_settings
from acre_train.modeling.geometry import WindowGeometry, export_geometry

ROOT = Path(__file__).resolve().parents[1]


def test_from_mapping_names_a_misspelled_key_and_takes_one_interval():
    with pytest.raises(ValueError, match="did you mean 'max_refill'"):
        WindowGeometry.from_mapping({"max_refil": 3})
    g = WindowGeometry.from_mapping({"first_chunk": 64, "interval": 8})
    assert g.intervals == (8,) and g.interval == 8 and g.stride == WindowGeometry().stride
    assert WindowGeometry(intervals=(4, 8, 32)).interval == 8 and WindowGeometry().interval == 16
    with pytest.raises(ValueError, match="intervals"):
        WindowGeometry(intervals=())


def test_the_geometry_travels_from_manifest_to_inference(tmp_path):
    from acre_train.eval.methods import parse_method
    from acre_train.export.checkpoint import load_checkpoint_model
    from acre_train.export.writer import export_model
    from acre_train.modeling.export_format import check_export_dir
    from acre_train.train import load_recipe
    from acre_train.train.distributed import setup
    from acre_train.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recipe = load_recipe(ROOT / "recipes/tiny_stage1.yaml", [
            "run_name=geo", f"output_root={tmp_path}", f"data.path={tmp_path / 'data'}",
            "data.prepare.token_budget=3000", "data.prepare.min_length=96", "data.prepare.max_length=160",
            "data.prepare.first_chunk=32", "data.prepare.stride=16", "data.prepare.intervals=[4, 8]",
            "train.max_steps=1", "logging.progress_bar=false"])
        Trainer(recipe, setup(use_deepspeed=False), log=lambda *_: None).run()
    finally:
        torch.set_num_threads(threads)
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    trained = WindowGeometry.from_mapping(manifest["settings"], ignore=tuple(
        k for k in manifest["settings"] if k not in ("first_chunk", "stride", "intervals")))
    assert trained.training_dict() == {"first_chunk": 32, "stride": 16, "intervals": [4, 8]}

    loaded = load_checkpoint_model(tmp_path / "geo")
    export = export_model(loaded.model, tmp_path / "export", inference=loaded.inference)
    config = check_export_dir(export)
    assert config["acre"]["inference"] == {"first_chunk": 32, "stride": 16, "interval": 8,
                                           "working_window": 32768, "max_refill": 4096}
    assert export_geometry(config).inference_dict() == config["acre"]["inference"]

    # chat/generate (command-line overrides) and eval (a row's options) read it through one function.
    cache, refill = inference_settings(config, {"max_refill": 0, "working_window": None})
    assert (cache.first_chunk, cache.stride, cache.interval, refill.working_window, refill.max_refill) == (32, 16, 8, 32768, 0)
    row = parse_method("acre-l1")
    from acre_train.infer.load import load_export

    model, _, _ = load_export(export)
    assert row.settings(model) == {"first_chunk": 32, "stride": 16, "interval": 8, "working_window": 32768, "max_refill": 0}
