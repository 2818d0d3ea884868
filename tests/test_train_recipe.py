"""Recipes: schema errors name the key, cross-field problems are reported before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from acre_train import cli
from acre_train.train import RecipeError, check_recipe, load_recipe, parse_overrides
from acre_train.train import trainer as trainer_module
from acre_train.train.recipe_checks import resolve_accumulation

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny_stage1.yaml"


def test_misspelled_keys_are_named_with_the_nearest_valid_one():
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, ["train.lerning_rate=1e-4", "chekpoint.every_steps=3"])
    text = str(err.value)
    assert "train.lerning_rate: unknown key; did you mean 'learning_rate'?" in text
    assert "chekpoint: unknown key; did you mean 'checkpoint'?" in text


def test_wrong_value_type_names_the_key():
    with pytest.raises(RecipeError, match=r"train.micro_batch_size: .*got 'two'"):
        load_recipe(TINY, ["train.micro_batch_size=two"])


def test_the_refill_loss_refuses_inference_only_scorer_options():
    # the loss ranks spans from the training pass: no question text (query) and its own sink rule
    for spec in ("l2:layers=0,sinks=2,keep_sinks=1,unscored=4", "l2:layers=0,query=question"):
        with pytest.raises(RecipeError, match="train.refill_loss.scorer.*inference settings"):
            load_recipe(TINY, [f"train.refill_loss.scorer={spec}"])


def test_overrides_tolerate_the_deepspeed_local_rank_argument():
    pairs = parse_overrides(["--local_rank=1", "train.learning_rate=1e-4", "--local_rank", "0",
                             "data.prepare.intervals=[4, 8]", "train.deepspeed=null"])
    assert pairs == [("train.learning_rate", 1e-4), ("data.prepare.intervals", [4, 8]), ("train.deepspeed", None)]
    with pytest.raises(RecipeError, match="not of the form key=value"):
        parse_overrides(["learning_rate"])


def test_overrides_reach_nested_sections():
    recipe = load_recipe(TINY, ["train.learning_rate=0.5", "model.tiny_config.num_hidden_layers=3"])
    assert recipe.train.learning_rate == 0.5 and recipe.model.tiny_config["num_hidden_layers"] == 3


@pytest.mark.parametrize("overrides,world,message", [
    (["train.global_batch_size=4", "train.micro_batch_size=3"], 1,
     "train.global_batch_size=4 cannot be split into micro_batch_size=3 x 1 rank(s)"),
    (["train.global_batch_size=8", "train.gradient_accumulation_steps=3"], 2,
     "train.global_batch_size=8 but micro_batch_size=1 x gradient_accumulation_steps=3 x 2 rank(s) = 6"),
    (["data.path=/nonexistent/data", "data.prepare=null"], 1, "data.path /nonexistent/data does not exist"),
    (["stage=2", "data.prepare=null"], 1, "stage 2 starts from stage-1 L1 weights: set model.init_from"),
    (["model.init_from=/nonexistent/run"], 1, "model.init_from: /nonexistent/run is neither"),
    (["train.deepspeed=/nonexistent/ds.json"], 1, "train.deepspeed: /nonexistent/ds.json does not exist"),
    (["model.source=tiny:gpt2"], 1, "tiny architectures are llama, qwen2, qwen3, mistral"),
    (["model.source=./no/such/model", "model.tiny_config={}"], 1, "model.source './no/such/model' does not exist"),
])
def test_cross_field_problems_have_one_actionable_message(overrides, world, message):
    problems = check_recipe(load_recipe(TINY, overrides), world_size=world)
    assert any(message in p for p in problems), problems


def test_data_prepare_is_typed_by_the_stage_at_load():
    """data.prepare is the stage's preparation settings: a key of the other stage, or a misspelled one, fails
    when the recipe loads, named with the nearest valid key; a valid section reads back typed."""
    with pytest.raises(RecipeError, match=r"data.prepare \(stage 2\): Stage2Settings: token_budget: unknown key"):
        load_recipe(TINY, ["stage=2"])
    with pytest.raises(RecipeError, match=r"min_lenght: unknown key; did you mean 'min_length'"):
        load_recipe(TINY, ["data.prepare.min_lenght=8"])
    settings = load_recipe(TINY, []).prepare_settings()
    assert type(settings).__name__ == "Stage1Settings" and str(settings.output) == load_recipe(TINY, []).data.path


def test_deepspeed_values_that_contradict_the_recipe_are_reported(tmp_path):
    config = json.loads((ROOT / "recipes/deepspeed/zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 2
    config["optimizer"] = {"type": "Adam"}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    problems = check_recipe(load_recipe(TINY, [f"train.deepspeed={tmp_path / 'ds.json'}"]), world_size=2)
    assert any("train_micro_batch_size_per_gpu=2 but the recipe implies 1" in p for p in problems)
    assert any("remove 'optimizer'/'scheduler'" in p for p in problems)


def test_accumulation_is_derived_from_the_global_batch():
    recipe = load_recipe(TINY, ["train.global_batch_size=8", "train.micro_batch_size=2"])
    assert resolve_accumulation(recipe, 2)[:2] == (2, 8)


def test_bad_recipe_fails_before_the_model_loads(monkeypatch, tmp_path, capsys):
    def forbidden(*_a, **_k):
        raise AssertionError("the model was loaded before the recipe was checked")

    monkeypatch.setattr(trainer_module, "build_model", forbidden)
    monkeypatch.setattr("acre_train.train.model.load_base", forbidden)
    for bad in (["train.micro_batch_size=3"], ["data.path=/nonexistent", "data.prepare=null"]):
        rc = cli.main(["train", str(TINY), f"output_root={tmp_path}", *bad])
        assert rc == 2
        assert "problem" in capsys.readouterr().err
    rc = cli.main(["train", str(TINY), "train.lerning_rate=1"])
    assert rc == 2 and "did you mean 'learning_rate'" in capsys.readouterr().err


def test_validate_verb(capsys):
    from acre_train.modeling import attach_acre, count_parameters
    from acre_train.tiny import tiny_model

    assert cli.main(["validate", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out
    # The parameter count comes from the meta device and equals the real model's.
    real = count_parameters(attach_acre(tiny_model("qwen2", **load_recipe(TINY).model.tiny_config)))
    assert f"parameters: trainable {real['trainable']:,} of {real['total']:,}" in out
    assert cli.main(["validate", str(TINY), "model.l1=lora", "model.lora.rank=2"]) == 0
    lora = capsys.readouterr().out.split("parameters: trainable ")[1].split(" ")[0]
    assert int(lora.replace(",", "")) < real["trainable"]
    assert cli.main(["validate", str(TINY), "train.micro_batch_size=3", "--world-size", "2"]) == 2
    assert "divisible by 6" in capsys.readouterr().err


def test_lora_settings_are_bounded_and_never_silently_ignored(capsys):
    """``lora.rank`` above the projection's size is refused before peft allocates it (100000 was
    accepted), and ``model.lora`` settings given with full-copy L1 (where they do nothing) are refused;
    the recipes' own defaults with ``model.l1=full`` stay valid."""
    assert cli.main(["validate", str(TINY), "model.l1=lora", "model.lora.rank=100000"]) == 2
    err = capsys.readouterr().err
    assert "LoRA rank 100000 exceeds the L1 projection's size" in err and "Traceback" not in err
    assert cli.main(["validate", str(TINY), "model.lora.rank=8"]) == 2
    assert "model.l1 is 'full'" in capsys.readouterr().err
    assert cli.main(["validate", str(TINY), "model.lora.rank=16", "model.lora.alpha=32"]) == 0  # the defaults


RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))  # every packaged recipe, the CPU-sized real-base ones too


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_recipe_parses_and_starts_with_its_launch_command(path):
    recipe = load_recipe(path)
    head = path.read_text().splitlines()
    comment = [line for line in head[: head.index(next(l for l in head if not l.startswith("#")))]]
    assert any(("acre_train.train" in line or "acre-train train" in line) and line.startswith("#") for line in comment)
    assert any("Overrides people change" in line for line in comment)
    assert recipe.train.deepspeed is None or Path(recipe.train.deepspeed).is_file()


@pytest.mark.parametrize("name", ["qwen2.5-3b", "qwen2.5-7b", "llama3.2-3b"])
def test_paper_settings(name):
    s1 = load_recipe(ROOT / f"recipes/{name}_stage1.yaml")
    s2 = load_recipe(ROOT / f"recipes/{name}_stage2.yaml")
    for recipe, lr, epochs in ((s1, 5e-5, 1), (s2, 1e-5, 2)):
        assert recipe.train.global_batch_size == 8 and recipe.train.learning_rate == lr and recipe.train.epochs == epochs
        assert recipe.train.bf16 and recipe.model.gradient_checkpointing and recipe.train.deepspeed
        assert recipe.data.prepare["intervals"] == [8, 16, 32, 64, 128]
    assert (s1.data.prepare["min_length"], s1.data.prepare["max_length"]) == (4096, 65536)
    assert s2.stage == 2 and s2.model.init_from == f"checkpoints/{s1.run_name}"
    assert resolve_accumulation(s1, 2)[:2] == (4, 8)


def test_deepspeed_configs_leave_batch_clipping_precision_to_the_recipe():
    for stage in (1, 2):
        config = json.loads((ROOT / f"recipes/deepspeed/zero{stage}.json").read_text())
        assert config["zero_optimization"]["stage"] == stage
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping"):
            assert config[key] == "auto"
        assert config["bf16"]["enabled"] == "auto" and "optimizer" not in config


def test_resolved_recipe_roundtrips_through_yaml():
    recipe = load_recipe(TINY, ["train.learning_rate=0.25"])
    again = yaml.safe_load(recipe.to_yaml())
    assert again["train"]["learning_rate"] == 0.25 and again["run_name"] == "tiny-stage1"


def test_validate_refuses_what_train_would(tmp_path, capsys):
    """A bad world size, an unsupported local model, prepared data whose input changed since."""
    assert cli.main(["validate", str(TINY), "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    assert cli.main(["validate", str(TINY), f"model.source={gpt2}", "model.tiny_config={}"]) == 2
    assert "is a 'gpt2' model; ACRE supports" in capsys.readouterr().err

    from acre_train.data import Stage1Settings, prepare_stage1

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": "word " * 400 + str(i)}) + "\n" for i in range(4)))
    data = tmp_path / "data"
    prepare = ["data.prepare.builtin=false", f"data.prepare.inputs=[{corpus}]", "data.prepare.token_budget=null"]
    args = ["validate", str(TINY), f"data.path={data}", *prepare, f"output_root={tmp_path}"]
    prepare_stage1(Stage1Settings(inputs=(str(corpus),), output=data, tokenizer="tiny", min_length=192,
                                  max_length=384, token_budget=None, first_chunk=64, stride=32, intervals=(4, 8, 16)),
                   log=lambda *_: None)
    assert cli.main(args) == 0
    assert "needs: any device (fp32); model: nothing" in capsys.readouterr().out
    corpus.write_text(corpus.read_text() + json.dumps({"text": "an edit " * 300}) + "\n")
    assert cli.main(args) == 2
    assert "was prepared from other settings, inputs or tokenizer" in capsys.readouterr().err


def test_every_verb_has_examples_that_parse():
    """Each verb's --help ends with examples, and every acre-train example parses with that verb's options."""
    import shlex

    for verb, text in cli.EXAMPLES.items():
        assert verb in cli.VERBS
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            argv = shlex.split(line.split("  #")[0])
            if argv[0] != "acre-train":
                continue
            parser = cli.build_parser_for(argv[1:])
            args, unknown = parser.parse_known_args(argv[1:])
            assert args.verb == verb and all("=" in u for u in unknown), (line, unknown)
    assert set(cli.EXAMPLES) == set(cli.VERBS)


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    bomb = ["run_name: bomb", "data: {path: x}", 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for level in "bcdefghi":  # 9^9 strings once expanded
        prev = chr(ord(level) - 1)
        bomb.append(f"{level}: &{level} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(bomb) + "\n")
    assert path.stat().st_size < 1200
    with pytest.raises(RecipeError, match=r"line 4, column \d+: aliases \(\*name\) are not allowed"):
        load_recipe(path)


def test_yaml_syntax_errors_and_python_tags_are_one_line_recipe_errors(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run_name: x\ndata:\n  path: [unclosed\n")
    with pytest.raises(RecipeError, match=r"not valid YAML at line \d+, column \d+"):
        load_recipe(path)
    path.write_text("run_name: !!python/object/apply:os.system ['echo pwned']\ndata: {path: x}\n")
    with pytest.raises(RecipeError, match="not valid YAML at line 1"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="override value"):
        load_recipe(TINY, ["train.learning_rate=[1e-4"])


@pytest.mark.parametrize("name", ["../escape", "/abs/run", "a/b", "..", ".", "", "back\\slash"])
def test_run_name_is_one_folder_name_inside_output_root(name):
    with pytest.raises(RecipeError, match="run_name must be one folder name"):
        load_recipe(TINY, [f"run_name={name!r}" if name else "run_name=''"])


def test_data_from_another_tokenizer_is_refused_by_validate_and_train(tmp_path, capsys):
    """Ids beyond the model's embedding (a larger tokenizer) and a same-size tokenizer that is not the
    base's own are both refused before any step, naming the data's tokenizer and the model."""
    from acre_train.data import Stage1Settings, prepare_stage1
    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.tiny import tiny_model
    from acre_train.train import train

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"The quick brown fox {i} jumps over the lazy dog. " * 40}) + "\n"
                              for i in range(4)))
    data = tmp_path / "data"
    prepare_stage1(Stage1Settings(inputs=(str(corpus),), output=data, tokenizer="tiny", min_length=192,
                                  max_length=384, token_budget=None, first_chunk=64, stride=32, intervals=(4, 8, 16)),
                   log=lambda *_: None)
    base = [str(TINY), f"data.path={data}", "data.prepare=null", f"output_root={tmp_path}", "train.max_steps=1"]

    small = [*base, "model.tiny_config={vocab_size: 64, eos_token_id: 0}"]
    assert cli.main(["validate", *small]) == 2
    err = capsys.readouterr().err
    assert "(tokenized with tiny) holds token id" in err and "has 64 embedding rows" in err
    with pytest.raises(RecipeError, match="has 64 embedding rows"):
        train(load_recipe(small[0], [*small[1:], "run_name=small"]))

    tok = tiny_tokenizer()  # the same vocabulary, another chat template: another tokenizer
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    folder = tmp_path / "base"
    tiny_model("qwen2", vocab_size=len(tok), eos_token_id=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    foreign = [*base, f"model.source={folder}", "model.tiny_config={}"]
    assert cli.main(["validate", *foreign]) == 2
    assert f"another tokenizer than model.source {folder}'s own" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="another tokenizer than model.source"):
        train(load_recipe(foreign[0], [*foreign[1:], "run_name=foreign"]))
    tiny_tokenizer().save_pretrained(folder)  # its own tokenizer again: accepted
    assert cli.main(["validate", *foreign]) == 0


def test_validate_names_layers_the_model_lacks_a_bad_seed_and_unbounded_epochs(capsys):
    """What training would stop on only after the model loaded (a refill layer the model lacks) or with an
    unnamed error (a negative seed, epochs that overflow the step count) is named by validate."""
    stage2 = ROOT / "recipes" / "tiny_stage2.yaml"
    assert cli.main(["validate", str(stage2), "train.refill_loss.weight=0.5", "train.refill_loss.layers=[7]"]) == 2
    assert "train.refill_loss.layers: layers [7] out of range for this 2-layer model" in capsys.readouterr().err
    assert cli.main(["validate", str(stage2), "train.refill_sim.enabled=true", "train.refill_sim.scorer=l2:layers=-3"]) == 2
    assert "train.refill_sim.scorer: layers [-3] out of range" in capsys.readouterr().err
    assert cli.main(["validate", str(TINY), "seed=-1"]) == 2
    assert "seed: Input should be greater than or equal to 0" in capsys.readouterr().err
    assert cli.main(["validate", str(TINY), "train.epochs=1e308"]) == 2
    assert "train.epochs: Input should be less than or equal to 1000000" in capsys.readouterr().err


def test_refill_sim_takes_the_selection_in_its_one_spelling():
    """train.refill_sim.selection sets the parts (and eta) as the export will store them; parts that
    disagree with it, and inference-only words, are refused by name."""
    stage2 = ROOT / "recipes" / "tiny_stage2.yaml"
    spelled = load_recipe(stage2, ["train.refill_sim.enabled=true",
                                   "train.refill_sim.selection=l2:layers=0,heads=max +grow=2,centered eta=24"])
    parts = load_recipe(stage2, ["train.refill_sim.enabled=true", "train.refill_sim.scorer=l2:layers=0,heads=max",
                                 "train.refill_sim.grow=2", "train.refill_sim.grow_shape=centered",
                                 "train.refill_sim.max_refill=24"])
    plan = {"first_chunk": 64, "stride": 32, "intervals": [4]}
    assert spelled.train.refill_sim.answers_with(plan) == parts.train.refill_sim.answers_with(plan)
    with pytest.raises(RecipeError, match="selection .* and train.refill_sim.grow \\(3\\) disagree"):
        load_recipe(stage2, ["train.refill_sim.selection=l2:layers=0 +grow=2", "train.refill_sim.grow=3"])
    with pytest.raises(RecipeError, match="sentence ends"):
        load_recipe(stage2, ["train.refill_sim.selection=l2:layers=0 +grow=2,sentences"])
