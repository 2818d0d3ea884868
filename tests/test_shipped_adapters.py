"""The adapters that ship in the package: every card names its weights (by hash), a recipe and inference
settings that load."""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files

import pytest

from acre_train.infer.settings import inference_settings
from acre_train.quickstart import SHIPPED_ADAPTER, STAGE1_ADAPTER, shipped_card

CARDS = sorted(p.name for p in files("acre_train.resources").joinpath("adapters").iterdir() if p.name.endswith(".json"))


@pytest.mark.parametrize("card_name", CARDS)
def test_each_card_names_its_weights_recipe_and_settings_that_parse(card_name):
    from acre_train.train import load_recipe

    adapters = files("acre_train.resources").joinpath("adapters")
    card = json.loads(adapters.joinpath(card_name).read_text(encoding="utf-8"))
    weights = adapters.joinpath(card_name.removesuffix(".json") + ".safetensors")
    # The card describes these very weights: a retrained or swapped file must come with its own card.
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == card["sha256"]
    recipe = files("acre_train").joinpath(f"recipes/{card['recipe']}.yaml")
    assert recipe.is_file() and load_recipe(str(recipe), []).model.lora is not None
    cache, refill = inference_settings({"acre": {"inference": card["inference"]}})
    assert (cache.first_chunk, cache.stride, cache.interval) == tuple(card["inference"][k] for k in ("first_chunk", "stride", "interval"))
    if card.get("calibration"):  # the stored setting is the one the card says calibration chose
        assert refill.replace(bands=None).describe_selection() == card["calibration"]["chosen"]
    if card["inference"].get("bands"):  # and its length bands read back as stored
        assert refill.bands.describe() == card["inference"]["bands"]


def test_the_quickstart_ships_the_refill_simulated_adapter_with_its_calibrated_selection():
    assert {SHIPPED_ADAPTER.split("/")[-1], STAGE1_ADAPTER.split("/")[-1]} <= {c.replace(".json", ".safetensors") for c in CARDS}
    card = shipped_card()
    assert card["recipe"] == "qwen2.5-0.5b/stage2-sim" and card["inference"]["scorer"]["query"] == "question"
