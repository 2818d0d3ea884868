"""The trainer in one process: exact resume, L1-only checkpoints, accumulation, stage 2, vanilla, logging."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from acre_train.modeling.scorer_spec import ScorerSettings
from acre_train.modeling import acre_parameters, attach_acre
from acre_train.tiny import tiny_model
from acre_train.train import CheckpointMismatch, load_recipe
from acre_train.train import checkpoint as ckpt_module
from acre_train.train.batching import epoch_batches, rank_micro_batches
from acre_train.train.distributed import setup
from acre_train.train.model import build_model
from acre_train.train.trainer import Trainer

from helpers import SMALL_DATA

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    # Intra-op threads only slow the tiny model down (thread sync dominates its small matmuls).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path_factory.mktemp("train")
    torch.set_num_threads(threads)


def recipe(workdir: Path, run: str, *overrides: str, stage: int = 1):
    base = ROOT / f"recipes/tiny_stage{stage}.yaml"
    data = [f"data.path={workdir / 'data1'}", *SMALL_DATA] if stage == 1 else [
        f"data.path={workdir / 'data2'}", "data.prepare.max_samples=16", "data.prepare.context_tokens=128",
        "data.prepare.max_length=256", "data.prepare.first_chunk=32", "data.prepare.stride=16"]
    return load_recipe(base, [f"run_name={run}", f"output_root={workdir}", "logging.progress_bar=false",
                              "train.max_steps=4", "checkpoint.every_steps=2", *data, *overrides])


def run(recipe_):
    trainer = Trainer(recipe_, setup(use_deepspeed=False), log=lambda *_: None)
    return trainer, trainer.run()


def test_resume_continues_exactly(workdir):
    _, full = run(recipe(workdir, "full", "checkpoint.keep_last=null"))
    _, first = run(recipe(workdir, "cut", "checkpoint.stop_after_step=2"))
    assert first.steps == 2 and first.losses == full.losses[:2]
    _, second = run(recipe(workdir, "cut", "checkpoint.resume_from_checkpoint=latest"))
    assert second.steps == 4 and len(second.losses) == 2
    np.testing.assert_allclose(second.losses, full.losses[2:], rtol=0, atol=1e-6)
    a, b = load_file(str(full.last_checkpoint / "trainable.safetensors")), load_file(str(second.last_checkpoint / "trainable.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    assert not torch.equal(a["model.acre_embed_tokens.weight"], load_file(
        str(workdir / "full/checkpoint-2/trainable.safetensors"))["model.acre_embed_tokens.weight"])
    meta = json.loads((second.last_checkpoint / "acre_checkpoint.json").read_text())
    assert meta["step"] == 4 and meta["samples_seen"] == 4 * 4 and meta["base_model"]["source"] == "tiny:qwen2"


def test_a_kill_between_a_checkpoint_and_its_log_line_leaves_no_gap_in_the_metrics(workdir, monkeypatch):
    """The step a kill stopped after its checkpoint but before its metrics line is filled in on resume
    from the checkpoint's own record, so metrics.jsonl has every step once, as an uninterrupted run."""
    from acre_train.train.callbacks import StepLogger

    _, full = run(recipe(workdir, "gap-full", "checkpoint.keep_last=null"))
    write = StepLogger.log_step

    def killed_at_2(self, step, metrics):
        if step == 2:
            raise KeyboardInterrupt  # after checkpoint-2 was saved, before its line
        write(self, step, metrics)

    monkeypatch.setattr(StepLogger, "log_step", killed_at_2)
    with pytest.raises(KeyboardInterrupt):
        run(recipe(workdir, "gap"))
    steps = lambda name: [json.loads(x)["step"] for x in (workdir / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps("gap") == [1] and (workdir / "gap" / "checkpoint-2").is_dir()
    monkeypatch.setattr(StepLogger, "log_step", write)
    run(recipe(workdir, "gap", "checkpoint.resume_from_checkpoint=latest"))
    assert steps("gap") == steps("gap-full") == [1, 2, 3, 4]
    line = lambda name: json.loads((workdir / name / "metrics.jsonl").read_text().splitlines()[1])  # noqa: E731
    assert line("gap")["loss"] == line("gap-full")["loss"] and line("gap")["tokens"] == line("gap-full")["tokens"]


def test_prepared_data_made_from_other_inputs_is_refused(workdir):
    run(recipe(workdir, "fresh"))  # prepares data1 (or reuses it: same settings and inputs)
    with pytest.raises(ValueError, match="(made with|prepared from) other settings.*data.prepare.overwrite=true"):
        run(recipe(workdir, "stale", "data.prepare.token_budget=13000"))


def test_base_is_frozen_and_checkpoints_hold_only_l1_state(workdir):
    trainer, result = run(recipe(workdir, "frozen"))
    fresh = tiny_model("qwen2", seed=0, vocab_size=1024, eos_token_id=0)
    trained = dict(trainer.model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(trained[name].detach(), p), f"frozen base weight {name} changed"
    acre = dict(acre_parameters(trainer.model))
    untouched = attach_acre(tiny_model("qwen2", seed=0, vocab_size=1024, eos_token_id=0))
    assert any(not torch.equal(acre[n], p) for n, p in acre_parameters(untouched)), "L1 weights did not train"

    checkpoint = result.last_checkpoint
    weights = load_file(str(checkpoint / "trainable.safetensors"))
    assert set(weights) == set(acre)
    l1_bytes = sum(p.numel() * 4 for p in acre.values())
    base_bytes = sum(p.numel() * 4 for p in fresh.parameters())
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    # weights + AdamW's two moments, plus small RNG / json / yaml files; far below the base.
    assert 3 * l1_bytes <= size <= 3 * l1_bytes + 120_000 < base_bytes
    assert (checkpoint / "recipe.yaml").is_file() and (workdir / "frozen/recipe.yaml").is_file()
    assert (workdir / "frozen/base_model/config.json").is_file()


def test_accumulation_split_does_not_change_the_step(workdir):
    # micro-batch 1 x accumulation 2 against micro-batch 2 x accumulation 1 (global batch 2).
    _, a = run(recipe(workdir, "mb1", "train.micro_batch_size=1", "train.global_batch_size=2", "train.max_steps=3"))
    _, c = run(recipe(workdir, "mb2", "train.micro_batch_size=2", "train.global_batch_size=2", "train.max_steps=3"))
    assert a.losses[0] != a.losses[1]
    np.testing.assert_allclose(a.losses, c.losses, rtol=0, atol=1e-5)
    wa, wc = load_file(str(a.last_checkpoint / "trainable.safetensors")), load_file(str(c.last_checkpoint / "trainable.safetensors"))
    for name in wa:
        torch.testing.assert_close(wa[name], wc[name], atol=1e-5, rtol=0)


def test_a_checkpoint_from_another_recipe_fails_with_the_reason(workdir):
    run(recipe(workdir, "mismatch", "train.max_steps=2"))
    with pytest.raises(CheckpointMismatch, match=r"global_batch_size: checkpoint has 4, the recipe gives 8") as err:
        run(recipe(workdir, "mismatch", "train.global_batch_size=8", "checkpoint.resume_from_checkpoint=latest"))
    assert "seed" not in str(err.value)
    with pytest.raises(CheckpointMismatch, match=r"seed: checkpoint has 0, the recipe gives 1"):
        run(recipe(workdir, "mismatch", "seed=1", "checkpoint.resume_from_checkpoint=latest"))


def test_interrupted_save_leaves_no_checkpoint(workdir, monkeypatch):
    run(recipe(workdir, "atomic", "train.max_steps=2"))
    before = (workdir / "atomic/latest").read_text()

    def crash(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        run(recipe(workdir, "atomic", "train.max_steps=4", "checkpoint.resume_from_checkpoint=latest"))
    assert not (workdir / "atomic/checkpoint-4").exists()
    assert (workdir / "atomic/latest").read_text() == before
    assert [p.name for p in ckpt_module.list_checkpoints(workdir / "atomic")] == ["checkpoint-2"]


def test_stage2_starts_from_stage1_weights(workdir):
    _, stage1 = run(recipe(workdir, "s1", "train.max_steps=2"))
    stage1_weights = load_file(str(stage1.last_checkpoint / "trainable.safetensors"))
    r2 = recipe(workdir, "s2", f"model.init_from={workdir / 's1'}", "train.max_steps=2", stage=2)
    model = build_model(r2)
    fresh = dict(acre_parameters(attach_acre(tiny_model("qwen2", seed=0, vocab_size=1024, eos_token_id=0))))
    loaded = dict(acre_parameters(model))
    for name, tensor in stage1_weights.items():
        assert torch.equal(loaded[name].detach(), tensor), name
    assert any(not torch.equal(loaded[n], fresh[n]) for n in fresh), "stage-1 weights equal a fresh init"
    _, stage2 = run(r2)
    assert stage2.steps == 2 and all(np.isfinite(stage2.losses))
    # A stage-1 run on another base cannot seed stage 2.
    other = recipe(workdir, "s2b", f"model.init_from={workdir / 's1'}", "model.tiny_seed=5", stage=2)
    with pytest.raises(ValueError, match="was trained on base"):
        build_model(other)


def test_vanilla_mode_trains_the_whole_base_without_acre(workdir):
    trainer, result = run(recipe(workdir, "vanilla", "mode=vanilla", "train.max_steps=2"))
    assert not hasattr(trainer.model.model, "acre_embed_tokens")
    assert all(p.requires_grad for p in trainer.model.parameters())
    weights = load_file(str(result.last_checkpoint / "trainable.safetensors"))
    assert set(weights) == {n for n, _ in trainer.model.named_parameters()}
    fresh = tiny_model("qwen2", seed=0, vocab_size=1024, eos_token_id=0)
    assert not torch.equal(weights["model.embed_tokens.weight"], fresh.model.embed_tokens.weight)
    # The collator dropped every L1 slot: the batch holds only raw tokens.
    row = trainer.data.dataset[0]
    batch = trainer.data.collate([row])
    assert batch["input_ids"].shape[1] == int((~np.asarray(row["is_l1"], bool)).sum()) and "is_l1" not in batch


def test_logging_writes_the_named_scalars(workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (workdir / "frozen/metrics.jsonl").exists():
        run(recipe(workdir, "frozen"))
    events = EventAccumulator(str(workdir / "frozen/tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "peak_memory_mib", "l1_interval_mix/4"):
        assert f"train/{tag}" in tags, tags
    lines = [json.loads(l) for l in (workdir / "frozen/metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4] and lines[1]["tokens_seen"] > lines[0]["tokens_seen"]
    assert abs(lines[0]["l1_interval_mix/4"] + lines[0]["l1_interval_mix/8"] - 1) < 1e-9


def test_liger_toggles_are_refused_without_cuda(workdir):
    from acre_train.train.liger import apply_liger
    from acre_train.train.recipe_schema import LigerSection

    messages = []
    model = tiny_model("qwen2")
    forward = model.forward
    active = apply_liger(model, LigerSection(rms_norm=True, fused_linear_cross_entropy=True), log=messages.append)
    assert not any(active.values()) and "CUDA is not available" in messages[0]
    assert model.forward == forward


def test_batches_depend_on_the_global_batch_only_and_group_chunk_counts():
    chunks = np.array([1, 2, 2, 3, 3, 3, 2, 1, 3, 2, 1, 3, 2, 2, 3, 1] * 3)
    batches = epoch_batches(chunks, 4, epoch=0, seed=0)
    assert sorted(np.concatenate(batches).tolist()) == sorted(range(len(chunks)))[: len(batches) * 4] or \
        len(np.unique(np.concatenate(batches))) == len(batches) * 4
    bucketed = [b for b in batches if len(set(chunks[b])) == 1]
    assert len(bucketed) >= len(batches) - 2  # only the leftover batches mix chunk counts
    for batch in bucketed:
        for world, micro, gas in ((2, 1, 2), (2, 2, 1), (4, 1, 1)):
            per_rank = [sum(int(chunks[m].max()) for m in rank_micro_batches(batch, rank=r, world_size=world, micro=micro,
                                                                              accumulation=gas)) for r in range(world)]
            assert len(set(per_rank)) == 1
    split = [np.concatenate(rank_micro_batches(batches[0], rank=r, world_size=2, micro=1, accumulation=2)) for r in range(2)]
    assert set(split[0]).isdisjoint(split[1]) and set(np.concatenate(split)) == set(batches[0])
    assert [b.tolist() for b in epoch_batches(chunks, 4, epoch=0, seed=0)] == [b.tolist() for b in batches]
    assert [b.tolist() for b in epoch_batches(chunks, 4, epoch=1, seed=0)] != [b.tolist() for b in batches]


def test_gradient_checkpointing_trains_identically(workdir):
    """Recipes for long sequences turn checkpointing on: it must be non-reentrant and change nothing."""
    trainer, plain = run(recipe(workdir, "no-ckpt", "train.max_steps=2"))
    trainer_ckpt, ckpt = run(recipe(workdir, "ckpt", "train.max_steps=2", "model.gradient_checkpointing=true"))
    assert trainer_ckpt.model.model.layers[0].gradient_checkpointing
    np.testing.assert_allclose(ckpt.losses, plain.losses, rtol=0, atol=1e-6)
    a = load_file(str(plain.last_checkpoint / "trainable.safetensors"))
    b = load_file(str(ckpt.last_checkpoint / "trainable.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0)


def test_a_run_dir_belongs_to_one_run(workdir, capsys):
    """Relaunching a finished run without resume is refused (nothing of it is touched); overwrite
    replaces it; a shorter run never has its own newest checkpoint pruned."""
    from acre_train.cli import main as cli_main
    from acre_train.train.recipe_checks import check_recipe

    _, long = run(recipe(workdir, "owned", "train.max_steps=6"))
    before = sorted(p.name for p in (workdir / "owned").iterdir())
    problems = check_recipe(recipe(workdir, "owned", "train.max_steps=2"))
    assert any("already belongs to a run (its newest checkpoint is checkpoint-6)" in p for p in problems)
    args = ["train", str(ROOT / "recipes/tiny_stage1.yaml"), f"run_name=owned", f"output_root={workdir}",
            f"data.path={workdir / 'data1'}", *SMALL_DATA, "train.max_steps=2", "logging.progress_bar=false"]
    assert cli_main(args) == 2
    assert "checkpoint.resume_from_checkpoint=latest" in capsys.readouterr().err
    assert sorted(p.name for p in (workdir / "owned").iterdir()) == before
    assert cli_main(args + ["--overwrite", "checkpoint.every_steps=1"]) == 0
    kept = sorted(p.name for p in (workdir / "owned").glob("checkpoint-*"))
    assert kept == ["checkpoint-1", "checkpoint-2"]  # the earlier run's 4 and 6 are gone, the new 2 is kept
    assert (workdir / "owned" / "latest").read_text().strip() == "checkpoint-2"
    steps = [json.loads(line)["step"] for line in (workdir / "owned" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # no lines of the replaced run


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    for step in (38, 39, 40):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "acre_checkpoint.json").write_text("{}")
    from acre_train.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(tmp_path, 5, rank=0, barrier=lambda: None, trainable={"w": model.weight}, meta={"step": 5},
                    recipe_yaml="", optimizer=opt, scheduler=sched, keep_last=2)
    assert (tmp_path / "checkpoint-5" / "acre_checkpoint.json").is_file()
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-5"


def test_resume_refuses_a_changed_learning_rate_and_applies_a_longer_run(workdir):
    run(recipe(workdir, "changed", "checkpoint.stop_after_step=2"))
    with pytest.raises(CheckpointMismatch, match=r"train.learning_rate: 0.001 -> 0.0005"):
        run(recipe(workdir, "changed", "checkpoint.resume_from_checkpoint=latest", "train.learning_rate=5e-4"))
    messages: list[str] = []
    trainer = Trainer(recipe(workdir, "changed", "checkpoint.resume_from_checkpoint=latest", "train.max_steps=5"),
                      setup(use_deepspeed=False), log=messages.append)
    assert trainer.run().steps == 5
    assert any("train.max_steps: 4 -> 5 (applied)" in m for m in messages)


def test_resume_unpickles_nothing(workdir, monkeypatch):
    """A checkpoint holds no pickle: RNG as JSON + safetensors, optimizer/scheduler read weights-only,
    so a crafted file in a checkpoint someone hands over cannot run code on resume."""
    run(recipe(workdir, "nopickle", "checkpoint.stop_after_step=2"))
    folder = workdir / "nopickle" / "checkpoint-2"
    assert not list(folder.glob("rng_state_*.pt"))
    json.loads((folder / "rng_state_0.json").read_text())

    class Payload:
        def __reduce__(self):
            return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))

    torch.save({"state": {}, "param_groups": [], "x": Payload()}, folder / "optimizer.pt")
    monkeypatch.chdir(workdir)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global|is damaged|every one is damaged"):
        run(recipe(workdir, "nopickle", "checkpoint.resume_from_checkpoint=latest"))
    assert not (workdir / "PWNED").exists()


def test_ctrl_c_saves_the_last_finished_step_and_exits_130(workdir, monkeypatch, capsys):
    from acre_train.cli import main as cli_main

    real_step = Trainer.train_step

    def interrupt_in_step_3(self, batch, step, logger):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(self, batch, step, logger)

    monkeypatch.setattr(Trainer, "train_step", interrupt_in_step_3)
    args = ["train", str(ROOT / "recipes/tiny_stage1.yaml"), "run_name=ctrlc", f"output_root={workdir}",
            f"data.path={workdir / 'data1'}", *SMALL_DATA, "train.max_steps=4", "checkpoint.every_steps=null",
            "logging.progress_bar=false"]
    assert cli_main(args) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "interrupted: saved checkpoint-2" in captured.out + captured.err
    assert (workdir / "ctrlc" / "latest").read_text().strip() == "checkpoint-2"


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(workdir):
    run(recipe(workdir, "damaged", "checkpoint.stop_after_step=4", "checkpoint.every_steps=2",
               "checkpoint.keep_last=null", "train.max_steps=6"))
    weights = workdir / "damaged" / "checkpoint-4" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, as a full disk would leave it
    messages: list[str] = []
    trainer = Trainer(recipe(workdir, "damaged", "checkpoint.resume_from_checkpoint=latest", "train.max_steps=6",
                             "checkpoint.every_steps=2", "checkpoint.keep_last=null"),
                      setup(use_deepspeed=False), log=messages.append)
    result = trainer.run()
    assert any("checkpoint-4 is damaged" in m for m in messages)
    assert any("resumed from" in m and m.endswith("at step 2") for m in messages)
    assert result.steps == 6


def test_refill_loss_in_the_trainer_weight_zero_is_plain_stage2(workdir):
    """Stage 2 from an adapter-only export of stage 1; the refill loss logs and trains; weight 0 is plain."""
    from acre_train.export import export_model
    from acre_train.export.checkpoint import load_checkpoint_model

    _, stage1 = run(recipe(workdir, "r1", "train.max_steps=2"))
    loaded = load_checkpoint_model(str(workdir / "r1"))
    base = workdir / "r1" / "base_model"
    export = export_model(loaded.model, workdir / "r1-export", adapter_only=True, base_model=str(base))
    common = [f"model.init_from={export}", f"model.source={base}", "model.tiny_config={}", "train.max_steps=2"]
    results = {}
    for name, weight in (("plain", None), ("zero", 0.0), ("aware", 1.0)):
        extra = [] if weight is None else [f"train.refill_loss.weight={weight}"]
        trainer, result = run(recipe(workdir, f"r2-{name}", *common, *extra, stage=2))
        metrics = [json.loads(x) for x in (workdir / f"r2-{name}" / "metrics.jsonl").read_text().splitlines()]
        results[name] = (result.losses, load_file(str(result.last_checkpoint / "trainable.safetensors")), metrics)
    assert results["plain"][0] == results["zero"][0]
    assert all(torch.equal(results["plain"][1][k], results["zero"][1][k]) for k in results["plain"][1])
    aware = results["aware"][2]
    assert all(m["refill_samples"] > 0 and m["refill_loss"] > 0 for m in aware if "refill_loss" in m)
    assert sum("refill_loss" in m for m in aware) == 2
    assert results["aware"][0][0] == results["plain"][0][0]  # the first step's answer loss is the same forward
    assert any(not torch.equal(results["aware"][1][k], results["plain"][1][k]) for k in results["plain"][1])


def test_a_learned_scorer_trains_apart_from_decoding(workdir):
    """params=scorer: the L1 weights and answer losses equal plain stage 2 bit for bit; the scorer's own
    weights train, are checkpointed, exported beside the adapter and rank at inference."""
    from acre_train.export.checkpoint import load_checkpoint_model
    from acre_train.export.writer import export_model
    from acre_train.infer import AcreEngine
    from acre_train.modeling.learned_scorer import SCORER_WEIGHTS, QueryMap, query_map_of
    from acre_train.infer.load import load_export
    from acre_train.infer.settings import inference_settings

    run(recipe(workdir, "ls-s1", "train.max_steps=2"))
    base = workdir / "ls-s1" / "base_model"
    stage1 = export_model(load_checkpoint_model(str(workdir / "ls-s1")).model, workdir / "ls-s1-export", adapter_only=True,
                          base_model=str(base))
    common = [f"model.init_from={stage1}", f"model.source={base}", "model.tiny_config={}", "train.max_steps=3",
              "train.learning_rate=1e-2"]
    out = {}
    for name, extra in (("plain", []), ("scorer", ["train.refill_loss.weight=1", "train.refill_loss.params=scorer",
                                                    "train.refill_loss.scorer=l2:layers=-1,heads=max,sinks=1",
                                                    "train.refill_loss.rank=2"])):
        _, result = run(recipe(workdir, f"ls-{name}", *common, *extra, stage=2))
        out[name] = (result.losses, load_file(str(result.last_checkpoint / "trainable.safetensors")))
    assert out["plain"][0] == out["scorer"][0]
    plain, learned = out["plain"][1], out["scorer"][1]
    scorer_keys = sorted(k for k in learned if k.startswith("acre_scorer."))
    assert scorer_keys and set(learned) - set(scorer_keys) == set(plain)
    assert all(torch.equal(plain[k], learned[k]) for k in plain)
    up = next(k for k in scorer_keys if ".up." in k)
    assert float(learned[up].abs().sum()) > 0  # B starts at zero: it moved

    loaded = load_checkpoint_model(str(workdir / "ls-scorer"))
    assert loaded.scorer_spec == "l2:layers=-1,heads=max,sinks=1,learned=1"
    export = export_model(loaded.model, workdir / "ls-export", inference={"scorer": loaded.scorer_spec},
                          scorer=(QueryMap.from_state(loaded.scorer_state), loaded.scorer_spec))
    assert (export / SCORER_WEIGHTS).is_file()
    model, _, _ = load_export(export)
    qmap = query_map_of(model)
    assert qmap is not None and torch.equal(qmap.up[up.rsplit(".", 1)[1]].detach(), learned[up])
    cache_settings, refill = inference_settings(model.config, {"first_chunk": 32, "stride": 16, "interval": 4, "working_window": 1000, "max_refill": 24})
    assert refill.scorer.learned
    engine = AcreEngine(model, cache_settings=cache_settings, refill=refill)
    cache = engine.build(list(range(5, 200)))
    answer = engine.answer(cache, [7, 8, 9], max_new_tokens=2)
    assert answer.scores is not None and 0 < len(answer.selected) < cache.num_l1


def test_scorer_only_trains_the_scorer_over_fixed_l1_weights(workdir):
    """scorer_only: the L1 weights stay bit-identical to model.init_from; the loss is the refill loss, and
    it falls (every step sees the same 16 samples)."""
    from acre_train.export.checkpoint import load_checkpoint_model
    from acre_train.export.writer import export_model
    from acre_train.modeling import acre_state_dict

    run(recipe(workdir, "so1", "train.max_steps=2"))
    base = workdir / "so1" / "base_model"
    loaded = load_checkpoint_model(str(workdir / "so1"))
    stage1 = export_model(loaded.model, workdir / "so1-export", adapter_only=True, base_model=str(base))
    _, result = run(recipe(workdir, "so2", f"model.init_from={stage1}", f"model.source={base}", "model.tiny_config={}",
                           "train.max_steps=6", "train.learning_rate=3e-2", "train.global_batch_size=16",
                           "train.lr_scheduler=constant", "train.refill_loss.weight=1",
                           "train.refill_loss.params=scorer", "train.refill_loss.scorer=l2:layers=0",
                           "train.refill_loss.scorer_only=true", stage=2))
    saved = load_file(str(result.last_checkpoint / "trainable.safetensors"))
    before = acre_state_dict(loaded.model)
    assert all(torch.equal(saved[k], v) for k, v in before.items())
    losses = result.losses
    assert all(loss > 0 for loss in losses) and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 1e-3


def test_refill_sim_trains_and_resumes_exactly(workdir):
    """train.refill_sim: stage 2 in the refilled layout runs in the trainer, its losses differ from plain
    stage 2's, and a run cut at step 2 and resumed repeats the uninterrupted one (teacher-forcing coins
    included)."""
    from acre_train.export.checkpoint import load_checkpoint_model
    from acre_train.export.writer import export_model

    run(recipe(workdir, "rs1", "train.max_steps=2"))
    base = workdir / "rs1" / "base_model"
    stage1 = export_model(load_checkpoint_model(str(workdir / "rs1")).model, workdir / "rs1-export",
                          adapter_only=True, base_model=str(base))
    common = [f"model.init_from={stage1}", f"model.source={base}", "model.tiny_config={}", "train.max_steps=4",
              "checkpoint.keep_last=null"]
    sim = ["train.refill_sim.enabled=true", "train.refill_sim.force_evidence=0.5", "train.refill_sim.max_refill=8",
           "train.refill_sim.interval=4", "train.refill_sim.scorer=l2:layers=0,heads=max", "train.refill_sim.grow=2",
           "train.refill_sim.grow_shape=centered"]
    _, plain = run(recipe(workdir, "rs-plain", *common, stage=2))
    sim_trainer, full = run(recipe(workdir, "rs-full", *common, *sim, stage=2))
    assert all(np.isfinite(full.losses)) and full.losses != plain.losses
    _, first = run(recipe(workdir, "rs-cut", *common, *sim, "checkpoint.stop_after_step=2", stage=2))
    _, second = run(recipe(workdir, "rs-cut", *common, *sim, "checkpoint.resume_from_checkpoint=latest", stage=2))
    assert first.losses == full.losses[:2]
    np.testing.assert_allclose(second.losses, full.losses[2:], rtol=0, atol=1e-6)
    # Its export answers in the layout it trained in: l, eta, scorer and selection rule (grown tokens) of refill_sim.
    from acre_train.cli import main as cli_main

    assert cli_main(["export", str(workdir / "rs-full"), str(workdir / "rs-export"), "--adapter-only"]) == 0
    stored = json.loads((workdir / "rs-export" / "config.json").read_text())["acre"]["inference"]
    assert (stored["interval"], stored["max_refill"], stored["neighbors"], stored["grow"], stored["grow_shape"]) == \
        (4, 8, False, 2, "centered")
    assert ScorerSettings.parse(stored["scorer"]) == ScorerSettings.parse("l2:layers=0,heads=max")
    simulated = sim_trainer.data.sim  # what training answered with is what the export stores, field by field
    for key in ("first_chunk", "stride", "interval", "working_window", "max_refill", "neighbors", "grow", "grow_shape"):
        assert getattr(simulated, key) == stored[key], key
    assert simulated.scorer == ScorerSettings.parse(stored["scorer"])
    assert cli_main(["export", str(workdir / "rs-plain"), str(workdir / "plain-export"), "--adapter-only"]) == 0
    plain_stored = json.loads((workdir / "plain-export" / "config.json").read_text())["acre"]["inference"]
    assert not {"scorer", "neighbors", "grow", "grow_shape"} & set(plain_stored)


def test_distillation_in_the_trainer_stage1_and_refilled_stage2(workdir):
    """train.distill: weight 0 repeats the plain run; weight 0.5 logs a positive KL per distilled token, in
    stage 1 and in stage 2 in the refilled layout."""
    from acre_train.export.checkpoint import load_checkpoint_model
    from acre_train.export.writer import export_model

    _, plain = run(recipe(workdir, "d-plain", "train.max_steps=2"))
    _, zero = run(recipe(workdir, "d-zero", "train.max_steps=2", "train.distill.weight=0"))
    assert plain.losses == zero.losses
    _, mixed = run(recipe(workdir, "d-half", "train.max_steps=2", "train.distill.weight=0.5", "train.distill.top_k=16"))
    metrics = [json.loads(x) for x in (workdir / "d-half" / "metrics.jsonl").read_text().splitlines() if '"kl"' in x]
    assert len(metrics) == 2 and all(m["kl"] > 0 and m["kl_tokens"] > 0 for m in metrics)
    assert mixed.losses != plain.losses
    base = workdir / "d-half" / "base_model"
    stage1 = export_model(load_checkpoint_model(str(workdir / "d-half")).model, workdir / "d-export",
                          adapter_only=True, base_model=str(base))
    run(recipe(workdir, "d-s2", f"model.init_from={stage1}", f"model.source={base}", "model.tiny_config={}",
               "train.max_steps=2", "train.refill_sim.enabled=true", "train.refill_sim.max_refill=8",
               "train.refill_sim.interval=4", "train.distill.weight=0.5", stage=2))
    metrics = [json.loads(x) for x in (workdir / "d-s2" / "metrics.jsonl").read_text().splitlines() if '"kl"' in x]
    assert len(metrics) == 2 and all(m["kl"] > 0 for m in metrics)


@pytest.mark.parametrize("setting", ["train.learning_rate=1e30", "train.refill_loss.weight=inf"])
def test_a_non_finite_run_stops_naming_the_step_and_keeps_the_last_finite_checkpoint(workdir, setting, capsys):
    """A NaN/inf loss or gradient stops the run (rc 2, the step named); no all-NaN checkpoint is written,
    the last finite one stays latest, and export refuses non-finite weights."""
    from acre_train.cli import main as cli_main

    stage = 2 if "refill_loss" in setting else 1
    if stage == 2:
        run(recipe(workdir, "nan-s1", "train.max_steps=1"))
    name = f"nan-{stage}"
    args = ["train", str(ROOT / f"recipes/tiny_stage{stage}.yaml"), f"run_name={name}", f"output_root={workdir}",
            "logging.progress_bar=false", "train.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=null",
            *((f"data.path={workdir / 'data1'}", *SMALL_DATA) if stage == 1 else (
                f"data.path={workdir / 'data2'}", "data.prepare.max_samples=16", "data.prepare.context_tokens=128",
                "data.prepare.max_length=256", "data.prepare.first_chunk=32", "data.prepare.stride=16",
                f"model.init_from={workdir / 'nan-s1'}")), setting]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "step " in err and "Traceback" not in err
    run_dir = workdir / name
    for ckpt in sorted(run_dir.glob("checkpoint-*")):
        weights = load_file(str(ckpt / "trainable.safetensors"))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values()), ckpt
    latest = run_dir / "latest"
    assert not latest.exists() or (run_dir / latest.read_text().strip()).is_dir()


def test_skip_nonfinite_steps_tolerates_that_many(workdir):
    """train.skip_nonfinite_steps=N: an inf-weighted refill loss skips its steps (no update) up to N."""
    run(recipe(workdir, "skip-s1", "train.max_steps=1"))
    trainer = Trainer(recipe(workdir, "skip", "train.max_steps=2", "train.skip_nonfinite_steps=5",
                             "train.refill_loss.weight=inf", f"model.init_from={workdir / 'skip-s1'}", stage=2),
                      setup(use_deepspeed=False), log=lambda *_: None)
    result = trainer.run()
    assert result.steps == 2 and trainer.nonfinite_steps == 2


def test_export_refuses_non_finite_weights(workdir):
    from acre_train.export.writer import export_model

    model = attach_acre(tiny_model("qwen2", seed=0))
    with torch.no_grad():
        next(p for _, p in acre_parameters(model)).fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        export_model(model, workdir / "nan-export")
    assert not (workdir / "nan-export").exists()


def test_export_takes_the_geometry_the_model_trained_with_not_the_papers(workdir):
    """A run on prepared data (data.path only, no data.prepare) exports its data's W0/S, from the
    checkpoint's record or, for older checkpoints, from the data's manifest."""
    from acre_train.export.checkpoint import load_checkpoint_model

    run(recipe(workdir, "geo-prep", "train.max_steps=1"))  # prepares data1 with W0 32, S 16
    _, result = run(recipe(workdir, "geo", "train.max_steps=1", "data.prepare=null"))
    loaded = load_checkpoint_model(str(workdir / "geo"))
    assert (loaded.inference["first_chunk"], loaded.inference["stride"]) == (32, 16)
    meta_file = result.last_checkpoint / "acre_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta["geometry"]["first_chunk"] == 32
    meta.pop("geometry")
    meta_file.write_text(json.dumps(meta))
    assert load_checkpoint_model(str(workdir / "geo")).inference["stride"] == 16


def test_one_owner_per_folder_runs_preparations_and_exports(workdir):
    """While another process holds a run dir, a data folder or an export folder, a second job there is
    refused at once naming the holder's pid; resuming another run's checkpoint into a used run dir too."""
    import os

    from acre_train.data import prepare_stage1
    from acre_train.export.writer import export_model
    from acre_train.files import FolderBusy, FolderLock
    from acre_train.train.recipe_checks import validate_recipe
    from acre_train.train.recipe_schema import RecipeError

    _, first = run(recipe(workdir, "own-a", "train.max_steps=2"))
    with FolderLock(workdir / "own-b"):  # another process training there
        with pytest.raises(FolderBusy, match=f"pid {os.getpid()}"):
            run(recipe(workdir, "own-b", "train.max_steps=1"))
    assert not (workdir / "own-b" / "metrics.jsonl").exists()
    settings = recipe(workdir, "own-c", "data.prepare.overwrite=true").prepare_settings()
    with FolderLock(settings.output):
        with pytest.raises(FolderBusy, match="in use by another preparation"):
            prepare_stage1(settings, log=lambda *_: None)
    with FolderLock(workdir / "own-export"):
        with pytest.raises(FolderBusy, match="export"):
            export_model(attach_acre(tiny_model("qwen2", seed=0)), workdir / "own-export")
    with pytest.raises(RecipeError, match="already belongs to a run"):
        validate_recipe(recipe(workdir, "own-a", f"checkpoint.resume_from_checkpoint={workdir / 'own-b-x'}"))


def test_vanilla_lora_trains_only_a_lora_on_the_base_s_own_qkv_and_exports_a_plain_model(workdir, tmp_path):
    """The SFT-vanilla control (recipes/qwen2.5-0.5b/stage2-vanilla-lora.yaml's model section on the tiny
    stage-2 data): two steps train only q/k/v LoRA weights, and the export is a plain model folder whose
    q/k/v weights are the base's plus (alpha / r) B A."""
    from transformers import AutoModelForCausalLM

    from acre_train.export.run import export_run
    from acre_train.train import load_recipe as load

    shipped = load(ROOT / "recipes/qwen2.5-0.5b/stage2-vanilla-lora.yaml", [])
    assert (shipped.mode, shipped.model.vanilla, shipped.model.lora.rank) == ("vanilla", "lora", 16)
    trainer, result = run(recipe(workdir, "sft-vanilla", "mode=vanilla", "model.vanilla=lora", "model.lora.rank=4",
                                 "model.lora.alpha=8", "train.max_steps=2", "model.init_from=null", stage=2))
    assert result.steps == 2 and all(np.isfinite(result.losses))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n and any(f".{t}." in n for t in ("q_proj", "k_proj", "v_proj")) for n in trained)
    weights = load_file(str(result.last_checkpoint / "trainable.safetensors"))
    assert set(weights) == trained
    out = export_run(workdir / "sft-vanilla", tmp_path / "plain", log=lambda *_: None)
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert plain.config.model_type == "qwen2" and (out / "tokenizer.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(workdir / "sft-vanilla" / "base_model")
    key = "model.layers.0.self_attn.q_proj"
    a = next(v for k, v in weights.items() if key in k and "lora_A" in k)
    b = next(v for k, v in weights.items() if key in k and "lora_B" in k)
    want = base.get_submodule(key).weight + (8 / 4) * b @ a
    torch.testing.assert_close(plain.get_submodule(key).weight, want, rtol=0, atol=1e-6)
    assert not torch.equal(plain.get_submodule(key).weight, base.get_submodule(key).weight)
    torch.testing.assert_close(plain.get_submodule("model.layers.0.mlp.up_proj").weight,
                               base.get_submodule("model.layers.0.mlp.up_proj").weight, rtol=0, atol=0)
    from acre_train.train.recipe_checks import check_recipe

    assert any("model.vanilla applies to mode: vanilla" in p
               for p in check_recipe(recipe(workdir, "bad", "model.vanilla=lora", stage=2), 1))


def test_a_folder_acre_train_did_not_make_is_neither_run_in_nor_cleared(workdir):
    """--overwrite clears only a run folder of ours: a folder holding someone's files (or a recipe.yaml no
    run wrote) is refused before anything in it is touched; a run folder carries acre-train's marker."""
    from acre_train.train.recipe_checks import RUN_MARKER, check_recipe

    theirs = workdir / "theirs"
    (theirs / "tensorboard").mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    (theirs / "metrics.jsonl").write_text("{}\n")
    for extra in ([], ["checkpoint.overwrite=true"]):
        problems = check_recipe(recipe(workdir, "theirs", *extra), 1)
        assert any("holds files no acre-train run wrote (notes.txt)" in p for p in problems), problems
    with pytest.raises(ValueError, match="no acre-train run wrote"):
        run(recipe(workdir, "theirs", "checkpoint.overwrite=true"))
    assert sorted(p.name for p in theirs.iterdir()) == ["metrics.jsonl", "notes.txt", "tensorboard"]
    lone = workdir / "lone"
    lone.mkdir()
    (lone / "recipe.yaml").write_text("run_name: mine\n")
    assert any("recipe.yaml that no acre-train run wrote" in p for p in check_recipe(recipe(workdir, "lone"), 1))
    _, done = run(recipe(workdir, "ours", "train.max_steps=2"))
    assert (workdir / "ours" / RUN_MARKER).is_file()
    (workdir / "ours" / "notes.txt").write_text("a user's notes in a run folder of ours")
    _, again = run(recipe(workdir, "ours", "train.max_steps=2", "checkpoint.overwrite=true"))
    assert again.steps == 2 and (workdir / "ours" / "notes.txt").read_text().startswith("a user's")


def test_sigterm_saves_the_last_finished_step_like_ctrl_c_and_exits_143(workdir, monkeypatch, capsys):
    import os
    import signal

    from acre_train.cli import main as cli_main
    from acre_train.errors import EXIT_TERMINATED

    original = Trainer.train_step

    def step(self, batch, number, logger):
        if number == 3:  # a scheduler stops the job during step 3: steps 1-2 are finished
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, batch, number, logger)

    monkeypatch.setattr(Trainer, "train_step", step)
    before = signal.getsignal(signal.SIGTERM)
    args = ["train", str(ROOT / "recipes/tiny_stage1.yaml"), "run_name=term", f"output_root={workdir}",
            f"data.path={workdir / 'data1'}", *SMALL_DATA, "train.max_steps=6", "checkpoint.every_steps=5",
            "logging.progress_bar=false"]
    assert cli_main(args) == EXIT_TERMINATED
    assert (workdir / "term" / "latest").read_text().strip() == "checkpoint-2"
    assert [json.loads(x)["step"] for x in (workdir / "term" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the run's only
    out = capsys.readouterr()
    assert "interrupted: saved checkpoint-2" in out.out + out.err


def test_ctrl_c_inside_a_save_keeps_that_step_its_checkpoint_and_its_metrics_line(workdir, monkeypatch):
    """A step interrupted while its checkpoint is written is finished: it is saved again and its line is
    written, and a resume continues with no gap and no repeat."""
    from acre_train.train.run_folder import RunFolder

    save = RunFolder.save
    calls = []

    def interrupted_once(self, state, progress, log=None):
        calls.append(progress.step)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while checkpoint-2 is being written
        return save(self, state, progress, log)

    monkeypatch.setattr(RunFolder, "save", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        run(recipe(workdir, "in-save", "checkpoint.every_steps=2"))
    steps = lambda: [json.loads(x)["step"] for x in (workdir / "in-save" / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert calls == [2, 2] and steps() == [1, 2]
    assert (workdir / "in-save" / "latest").read_text().strip() == "checkpoint-2"
    monkeypatch.setattr(RunFolder, "save", save)
    run(recipe(workdir, "in-save", "checkpoint.every_steps=2", "checkpoint.resume_from_checkpoint=latest"))
    assert steps() == [1, 2, 3, 4]
