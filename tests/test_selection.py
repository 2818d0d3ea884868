"""The typed refill selection: one spelling, length bands the engine picks from, and a sink rule whose cost
does not grow with the number of chunks."""

from __future__ import annotations

import pytest
import torch

from acre_train.infer import AcreEngine, CacheSettings, RefillSettings
from acre_train.infer.settings import inference_settings
from acre_train.modeling.ranking import question_mass
from acre_train.modeling.scorer_spec import ScorerSettings
from acre_train.modeling.span_choice import grow_tokens
from acre_train.modeling.selection import LengthBands, Selection

from helpers import perturbed_acre_model as _model, random_ids as _ids

SETTINGS = CacheSettings(first_chunk=16, stride=8, interval=4)


@pytest.mark.parametrize("spec", ["l1:layers=-1", "l2:layers=3,heads=max +neighbors",
                                  "l2:layers=0+2,heads=max,sinks=4,keep_sinks=first +grow=2,densest @text eta=48",
                                  "bounds:layers=1,sinks=2,keep_sinks=1 close_tail",
                                  "l2:layers=1,heads=max +grow=2,sentences eta=64 close_tail refill_after_tail",
                                  "l2:layers=1,heads=max +grow=2,sentences close_tail refill_after_tail reuse_score_pass"])
def test_a_selection_reads_back_what_it_writes_in_both_spellings(spec):
    s = Selection.parse(spec)
    assert s.describe() == spec
    assert Selection.from_mapping(s.to_dict()) == s


@pytest.mark.parametrize("spec,message", [("l2:layers=1 +grow=2 +neighbors", "not both"),
                                          ("l1:layers=-1 +grow=1", "l2 scorer"),
                                          ("l2:layers=1 +grow=1,round", "grow_shape"),
                                          ("l2:layers=1 @gapped", "positions"),
                                          ("l2:layers=1 grow=2", "selection word 'grow=2'"),
                                          ("l2:layers=1 refill_after_tail", "needs close_tail"),
                                          ("l2:layers=1 @text close_tail refill_after_tail", "needs @compact"),
                                          ("l2:layers=1 reuse_score_pass", "needs close_tail")])
def test_a_selection_that_cannot_be_made_names_why(spec, message):
    with pytest.raises(ValueError, match=message):
        Selection.parse(spec)


def test_a_misspelled_stored_key_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match="'grow_shap'.*grow_shape"):
        Selection.from_mapping({"scorer": "l2:layers=1", "grow_shap": "densest"})


def test_length_bands_pick_by_length_and_must_increase():
    bands = LengthBands.parse(["100: l2:layers=1 +grow=1", {"up_to": 400, "selection": "l2:layers=1 +grow=2"},
                               "l2:layers=1,sinks=1,keep_sinks=first +grow=3 eta=64"])
    assert [bands.pick(n).grow for n in (1, 100, 101, 400, 401, 10**6)] == [1, 1, 2, 2, 3, 3]
    assert LengthBands.parse(bands.describe()) == bands
    with pytest.raises(ValueError, match="must increase"):
        LengthBands.parse(["400: l2:layers=1", "100: l2:layers=1", "l2:layers=1"])
    with pytest.raises(ValueError, match="open-ended"):
        LengthBands.parse(["400: l2:layers=1"])


def test_the_engine_answers_with_the_band_of_the_context_s_length():
    config = {"acre": {"inference": {"first_chunk": 16, "stride": 8, "interval": 4, "working_window": 34,
                                     "max_refill": 24, "scorer": "l2:layers=1",
                                     "bands": ["30: l2:layers=1 +grow=1", "l2:layers=0,heads=max +grow=2,densest eta=16"]}}}
    cache_settings, refill = inference_settings(config)
    engine = AcreEngine(_model("llama"), cache_settings=cache_settings, refill=refill.replace(max_new_tokens=2))
    short, long = engine.build(_ids(28, 1)), engine.build(_ids(46, 2))
    assert short.context_tokens == 28 and long.context_tokens == 46
    assert engine.settings_for(short).selection.describe() == "l2:layers=1 +grow=1"
    picked = engine.settings_for(long)
    assert picked.selection.describe() == "l2:layers=0,heads=max +grow=2,densest" and picked.max_refill == 16
    q = _ids(6, 7)
    # The band's answer is the answer of the band's selection given outright (bands dropped).
    by_band = engine.answer(long, q)
    given = engine.answer(long, q, scorer="l2:layers=0,heads=max", grow=2, grow_shape="densest", max_refill=16)
    assert torch.equal(by_band.refilled, given.refilled) and by_band.token_ids == given.token_ids
    assert by_band.k == 16 // 4
    # A selection asked for on the command line holds at every length.
    _, asked = inference_settings(config, {"grow": 3})
    assert asked.bands is None and asked.grow == 3 and asked.scorer.describe() == "l2:layers=1"


def test_keep_sinks_first_costs_one_span_however_many_chunks_the_context_has():
    model = _model("llama")
    scorer = ScorerSettings.parse("l2:layers=1,heads=max,sinks=1,keep_sinks=first")
    for length in (30, 70):  # 2 and 7 chunks
        engine = AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(
            working_window=10 + 4 * 4, scorer=scorer, grow=1, grow_shape="densest", max_new_tokens=2))
        cache, q = engine.build(_ids(length, 3)), _ids(6, 7)
        answer = engine.answer(cache, q)
        plan, k = engine.open_chunk(cache, q)
        n = int(cache.span_bounds[-1])
        mass = question_mass(model, cache, engine.question_queries(cache, plan, num_tail=len(cache.tail_ids),
                                                                   layers=[1]), scorer)
        first = torch.zeros(n, dtype=torch.bool)
        first[:4] = True  # the first span (4 raw tokens), and nothing of any later chunk
        want = grow_tokens(mass, num_tokens=n, budget=4 * k, width=4, seeds=1, heads="max", taken=first,
                           shape="densest")
        assert torch.equal(answer.refilled, want) and int(want.sum()) == 4 * k
        assert bool(answer.refilled[:4].all())
    # keep_sinks=1 at 7 chunks: the first k = 2 chunk-start spans are the whole refill, nothing the question asked.
    spans = AcreEngine(model, cache_settings=SETTINGS, refill=RefillSettings(
        working_window=10 + 4 * 4, scorer="l2:layers=1,heads=max,sinks=1,keep_sinks=1", grow=1, max_new_tokens=2))
    sinks = spans.answer(spans.build(_ids(70, 3)), q)
    assert sinks.k == 2 and sinks.refilled.nonzero().flatten().tolist() == [0, 1, 2, 3, 16, 17, 18, 19]


def test_a_stored_scorer_layer_the_model_lacks_fails_when_the_engine_is_made():
    config = {"acre": {"inference": {"first_chunk": 16, "stride": 8, "interval": 4, "scorer": "l2:layers=1",
                                     "bands": ["30: l2:layers=1 +grow=1", "l2:layers=9 +grow=2"]}}}
    cache_settings, refill = inference_settings(config)
    with pytest.raises(ValueError, match=r"scoring layers \(9,\) out of range"):
        AcreEngine(_model("llama"), cache_settings=cache_settings, refill=refill)


BANDED = {"acre": {"inference": {"first_chunk": 16, "stride": 8, "interval": 4, "max_refill": 32, "scorer": "l2:layers=1",
                                 "bands": ["40: l2:layers=1 +grow=1", "l2:layers=1 +grow=2,densest eta=48"]}}}


def test_the_selection_flags_are_the_words_table_and_reach_the_engine_settings():
    """chat/generate's flags come from one table; --selection replaces the export's selection and bands
    (its eta included, an explicit --max-refill winning), --close-tail (and --refill-after-tail) keeps the
    bands and sets each's tail."""
    import argparse

    from acre_train.modeling.selection_words import FLAGS, add_selection_flags, selection_overrides

    parser = argparse.ArgumentParser()
    add_selection_flags(parser)
    args = parser.parse_args(["--selection", "l2:layers=0,heads=max +grow=3,sentences eta=24"])
    assert set(selection_overrides(args)) == set(FLAGS)
    _, refill = inference_settings(BANDED, selection_overrides(args))
    assert refill.bands is None and refill.max_refill == 24
    assert refill.selection.describe() == "l2:layers=0,heads=max +grow=3,sentences"
    _, refill = inference_settings(BANDED, selection_overrides(args) | {"max_refill": 40})
    assert refill.max_refill == 40
    _, refill = inference_settings(BANDED, selection_overrides(parser.parse_args(["--close-tail"])))
    assert [s.close_tail for _, s in refill.bands.bands] == [True, True] and refill.close_tail
    _, refill = inference_settings(BANDED, selection_overrides(parser.parse_args(["--close-tail", "--refill-after-tail"])))
    assert [(s.close_tail, s.refill_after_tail) for _, s in refill.bands.bands] == [(True, True)] * 2
    assert refill.for_length(100).grow == 2 and refill.for_length(100).refill_after_tail  # the band kept, the tail set
    _, refill = inference_settings(BANDED, selection_overrides(parser.parse_args(["--close-tail", "--reuse-score-pass"])))
    assert [s.reuse_score_pass for _, s in refill.bands.bands] == [True, True]
    with pytest.raises(ValueError, match="needs close_tail"):
        inference_settings(BANDED, selection_overrides(parser.parse_args(["--refill-after-tail"])))
    _, refill = inference_settings(BANDED, selection_overrides(parser.parse_args(["--grow", "4"])))
    assert refill.bands is None and refill.grow == 4 and refill.grow_shape == "attention"


@pytest.mark.parametrize("row,scorer", [
    ("acre:scorer=l2:layers=1,heads=max,sinks=2", "l2:layers=1,heads=max,sinks=2"),  # what --scorer takes
    ("acre:scorer=l2:layers=1:heads=max:sinks=2", "l2:layers=1,heads=max,sinks=2"),  # the older colon spelling
    ("acre:scorer=l2:layers=0+1,learned=1", "l2:layers=0+1,learned=1"),
])
def test_the_acre_row_takes_the_scorer_as_the_command_line_spells_it(row, scorer):
    from acre_train.eval.methods import parse_methods

    full, acre, last = parse_methods(f"full,{row},truncated:budget=64")
    assert (full.name, last.name) == ("full", "truncated")
    assert acre.scorer_settings(None) == ScorerSettings.parse(scorer)


def test_the_acre_row_takes_a_whole_selection_and_answers_as_chat_does_with_it():
    from acre_train.eval.methods import parse_methods

    spec = "l2:layers=1,heads=max,sinks=2,keep_sinks=first +grow=2,sentences eta=24"
    (row,) = parse_methods(f"acre:selection={spec}")
    assert Selection.parse(row.selection).describe() == spec
    model = _model("llama")
    model.config.acre = BANDED["acre"]
    _, refill = inference_settings(model.config, row.overrides() | {"selection": row.selection})
    _, chat = inference_settings(BANDED, {"selection": spec})
    assert refill == chat and refill.max_refill == 24 and refill.bands is None
