"""Export -> reload gives the trained model's logits (fp32, 1e-5): full and adapter-only forms,
in-process, through ``trust_remote_code`` in a process that cannot import acre-train, and from real
DeepSpeed ZeRO-1 / ZeRO-2 training runs."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acre_train.cli import main as cli_main
from acre_train.export import export_model
from acre_train.infer.load import load_export
from acre_train.modeling.export_format import NotAnAcreExport, check_export_dir
from acre_train.modeling import acre_forward, acre_parameters, attach_acre, interleave
from acre_train.modeling.batch import pad_batch
from acre_train.modeling.hf import AcreForCausalLM
from acre_train.tiny import tiny_model

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
IDS = list(range(3, 60)) + list(range(100, 140))


def _plan():
    return interleave(IDS, first_chunk=32, stride=16, intervals=[4, 8, 4, 8, 4, 8])


def _logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(ACRE logits over an interleaved multi-chunk plan, plain base-path logits)."""
    with torch.no_grad():
        acre = acre_forward(model, **pad_batch([_plan().as_dict()]), return_logits=True).logits
        plain = model(torch.tensor([IDS[:40]])).logits
    return acre, plain


def _trained(base_dir: Path | None = None):
    """A tiny ACRE model whose L1 weights moved away from the base (as training would)."""
    base = tiny_model("qwen2", vocab_size=1024, eos_token_id=0)
    if base_dir is not None:
        base.save_pretrained(base_dir)
    model = attach_acre(base)
    torch.manual_seed(7)
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    return model


def _tokenizer():
    return pytest.importorskip("acre_train.data.tiny_tokenizer").tiny_tokenizer()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    model = _trained(root / "base")
    tok = _tokenizer()
    inference = {"first_chunk": 32, "stride": 16, "interval": 4, "working_window": 64}
    full = export_model(model, root / "full", tokenizer=tok, inference=inference)
    adapter = export_model(model, root / "adapter", tokenizer=tok, adapter_only=True, base_model="../base",
                           inference=inference)
    return model, full, adapter, root


def test_full_and_adapter_only_exports_reload_with_the_same_logits(exports):
    model, full, adapter, _ = exports
    expected = _logits(model)
    assert (adapter / "acre_adapter.safetensors").stat().st_size < (full / "model.safetensors").stat().st_size / 3
    for folder in (full, adapter):
        loaded, tokenizer, data = load_export(folder)
        assert data["acre"]["inference"]["interval"] == 4 and tokenizer is not None
        for got, want in zip(_logits(loaded), expected):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_auto_class_loads_offline_in_a_process_without_acre_train(exports, tmp_path):
    model, full, adapter, _ = exports
    acre, plain = _logits(model)
    script = tmp_path / "load.py"
    script.write_text(f"""
import importlib, importlib.util, json, os, sys
# Make acre-train unimportable: drop every sys.path entry holding the package (the repo) and the
# editable-install finder; site-packages (torch, transformers) stay.
sys.path = [p for p in sys.path if p not in ('', '.') and not os.path.isdir(os.path.join(p, 'acre_train'))]
sys.meta_path = [f for f in sys.meta_path if 'acre_train' not in getattr(f, '__module__', '') + repr(f)]
assert importlib.util.find_spec('acre_train') is None, 'acre_train is still importable'
import torch
from transformers import AutoModelForCausalLM
out = {{}}
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    package = type(model).__module__.rsplit('.', 1)[0]
    adapter = importlib.import_module(package + '.adapter')
    interleave = importlib.import_module(package + '.interleave').interleave
    plan = interleave({IDS!r}, first_chunk=32, stride=16, intervals=[4, 8, 4, 8, 4, 8])
    t = lambda a: torch.as_tensor(a)[None]
    with torch.no_grad():
        acre = adapter.acre_forward(model, input_ids=t(plan.input_ids), is_l1=t(plan.is_l1), chunk_ids=t(plan.chunk_ids),
                                    positions=t(plan.positions), memory_positions=t(plan.memory_positions),
                                    return_logits=True).logits
        plain = model(torch.tensor([{IDS[:40]!r}])).logits
    out[folder] = [acre.tolist(), plain.tolist(), type(model).__module__]
print('RESULT' + json.dumps(out))
""")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, "-I", str(script), str(full), str(adapter)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for folder in (full, adapter):
        got_acre, got_plain, module = result[str(folder)]
        assert module.startswith("transformers_modules.")
        torch.testing.assert_close(torch.tensor(got_acre), acre, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(got_plain), plain, atol=ATOL, rtol=0)


def test_generate_with_a_device_map_that_offloads_to_disk_answers_as_without(exports, tmp_path, capsys):
    """--device-map / --max-memory / --offload-folder through the verb: the same answers, weights on disk."""
    _, full, _, _ = exports
    context = "The lighthouse keeper Ada painted the tower blue every spring. " * 6
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "q", "context": context, "question": "Who?"}) + "\n")
    answers = []
    for extra in ([], ["--device-map", "auto", "--max-memory", "cpu=20000", "--offload-folder", str(tmp_path / "off")]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        assert cli_main(["generate", str(full), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                         "--max-new-tokens", "4", *extra]) == 0
        answers.append(json.loads(out.read_text())["answer"])
    placed = capsys.readouterr().out
    assert "placed by the device map: " in placed and "disk: " in placed  # something really went to disk
    assert answers[0] == answers[1]
    assert cli_main(["generate", str(full), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "x.jsonl"),
                     "--max-memory", "cpu=1GiB"]) == 2  # without --device-map: said, not ignored


def test_generate_and_chat_commands_answer_from_an_export(exports, tmp_path, capsys):
    _, full, _, _ = exports
    context = "The lighthouse keeper Ada painted the tower blue every spring. " * 6
    rows = [{"id": "q1", "context": context, "question": "Who painted the tower?"},
            {"id": "q2", "context": context, "question": "Which colour?"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main(["generate", str(full), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--max-new-tokens", "3"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == ["q1", "q2"] and [r["cache_reused"] for r in out] == [False, True]
    for key in ("answer", "build_s", "score_s", "refill_s", "prefill_s", "decode_s", "peak_memory_mib", "k"):
        assert key in out[0]
    assert cli_main(["generate", str(full), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "closed.jsonl"), "--max-new-tokens", "3", "--close-tail"]) == 0
    closed = [json.loads(line) for line in (tmp_path / "closed.jsonl").read_text().splitlines()]
    assert [r["id"] for r in closed] == ["q1", "q2"] and all(r["answer"] is not None for r in closed)
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": "q3", "question": "?"}) + "\n")
    assert cli_main(["generate", str(full), "--input", str(tmp_path / "bad.jsonl"), "--output",
                     str(tmp_path / "bad-out.jsonl")]) == 2
    assert "bad.jsonl:2: a row needs 'question' and 'context'" in capsys.readouterr().err
    assert not (tmp_path / "bad-out.jsonl").exists()

    from acre_train.infer.cli import run_chat
    from acre_train.cli import build_parser_for

    (tmp_path / "ctx.txt").write_text(context)
    argv = ["chat", str(full), "--context", str(tmp_path / "ctx.txt"), "--max-new-tokens", "2",
            "--save-cache", str(tmp_path / "c.safetensors")]
    args = build_parser_for(argv).parse_args(argv)
    capsys.readouterr()  # drop what generate printed
    assert run_chat(args, stdin=io.StringIO("Who?\nWhat?\n\n")) == 0
    printed = capsys.readouterr().out
    assert printed.count("refilled") == 2 and (tmp_path / "c.safetensors").is_file()

    # The saved cache is reused only with the context it holds; flipped bytes are refused (one-line
    # errors, exit 2: the CLI's policy, errors.user_errors, as cli.main applies it).
    from acre_train.errors import user_errors

    chat = user_errors(run_chat, verb="chat")
    (tmp_path / "other.txt").write_text("Another text entirely. " * 6)
    for ctx, code in (("ctx.txt", 0), ("other.txt", 2), ("missing.txt", 2)):
        argv = ["chat", str(full), "--context", str(tmp_path / ctx), "--load-cache", str(tmp_path / "c.safetensors")]
        assert chat(build_parser_for(argv).parse_args(argv), stdin=io.StringIO("\n")) == code, ctx
    assert "holds another context" in capsys.readouterr().err
    raw = bytearray((tmp_path / "c.safetensors").read_bytes())
    raw[-7] ^= 0xFF  # a flipped byte inside the tensor data
    (tmp_path / "c.safetensors").write_bytes(bytes(raw))
    argv = ["chat", str(full), "--context", str(tmp_path / "ctx.txt"), "--load-cache", str(tmp_path / "c.safetensors")]
    assert chat(build_parser_for(argv).parse_args(argv), stdin=io.StringIO("\n")) == 2
    assert "checksum" in capsys.readouterr().err


def test_generate_keeps_the_previous_output_when_a_row_is_bad(exports, tmp_path, capsys):
    _, full, _, _ = exports
    out = tmp_path / "answers.jsonl"
    out.write_text("previous answers\n")
    for bad in ({"id": 1, "question": "Who?", "context": 42}, {"id": 2, "question": "", "context": "text"},
                {"id": 3, "question": "Who?", "context_file": str(tmp_path / "nowhere.txt")}):
        (tmp_path / "in.jsonl").write_text(json.dumps({"question": "ok?", "context": "fine text"}) + "\n" + json.dumps(bad) + "\n")
        assert cli_main(["generate", str(full), "--input", str(tmp_path / "in.jsonl"), "--output", str(out)]) == 2
        assert "in.jsonl:2:" in capsys.readouterr().err
        assert out.read_text() == "previous answers\n" and not list(tmp_path.glob(".answers*"))


# ------------------------------------------------------------------------------------- bad input

def test_folders_that_are_not_acre_exports_are_clear_errors(exports, tmp_path, capsys):
    _, _, _, root = exports
    with pytest.raises(NotAnAcreExport, match="is not a directory"):
        check_export_dir(tmp_path / "missing")
    with pytest.raises(NotAnAcreExport, match="has no config.json"):
        check_export_dir(tmp_path)
    with pytest.raises(NotAnAcreExport, match="model_type 'qwen2', expected 'acre'"):
        load_export(root / "base")
    (tmp_path / "x.jsonl").write_text(json.dumps({"question": "q?", "context": "some text"}) + "\n")
    out = tmp_path / "y.jsonl"
    assert cli_main(["generate", str(root / "base"), "--input", str(tmp_path / "x.jsonl"), "--output", str(out)]) == 2
    assert "holds no tokenizer files" in capsys.readouterr().err and not out.exists()
    assert cli_main(["generate", str(tmp_path), "--input", str(tmp_path / "x.jsonl"), "--output", str(out)]) == 2
    assert "is not an ACRE export: it has no config.json" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "no-run"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint directory nor a run directory" in capsys.readouterr().err


def test_a_damaged_full_export_is_a_one_line_error_in_chat_generate_and_eval(exports, tmp_path, capsys):
    import shutil

    _, full, _, _ = exports
    broken = tmp_path / "broken"
    shutil.copytree(full, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # a copy cut short
    (tmp_path / "ctx.txt").write_text("some long text " * 20)
    (tmp_path / "in.jsonl").write_text(json.dumps({"question": "q?", "context": "some text"}) + "\n")
    for argv in (["chat", str(broken), "--context", str(tmp_path / "ctx.txt")],
                 ["generate", str(broken), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")],
                 ["eval", "--model", str(broken), "--tasks", "niah_single", "--methods", "acre", "--num-examples", "1",
                  "--context-tokens", "64", "--out", str(tmp_path / "eval")]):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"acre-train {argv[0]}: error: {broken}: its weights cannot be read" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_export_refuses_bad_requests(exports, tmp_path):
    model, full, _, _ = exports
    with pytest.raises(ValueError, match="needs the base model"):
        export_model(model, tmp_path / "a", adapter_only=True)
    with pytest.raises(ValueError, match="without L1 parameters"):
        export_model(tiny_model("qwen2"), tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export_model(model, tmp_path / "c")
    with pytest.raises(FileExistsError, match="not an ACRE export"):
        export_model(model, tmp_path / "c", overwrite=True)


# ------------------------------------------------------------------------------ real ZeRO-1/2 runs

def _deepspeed_run(out_root: Path, stage: int, ranks: int) -> Path:
    """Train the tiny stage-1 recipe for 2 steps with DeepSpeed ZeRO-``stage`` on ``ranks`` CPU ranks."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    if not Path(launcher).exists():
        pytest.skip("the deepspeed launcher is not installed")
    name = f"zero{stage}"
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(29600 + stage), "--module", "acre_train.train",
           "recipes/tiny_stage1.yaml", f"train.deepspeed=recipes/deepspeed/zero{stage}.json",
           f"output_root={out_root}", f"run_name={name}", "train.max_steps=2", "checkpoint.every_steps=2"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out_root / name


@pytest.mark.slow
@pytest.mark.parametrize("stage,ranks", [(1, 1), (2, 2)])
def test_export_of_a_zero_run_reproduces_the_trained_model(stage, ranks, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = _deepspeed_run(tmp_path, stage, ranks)
    checkpoint = run / "checkpoint-2"
    assert (checkpoint / "ds").is_dir()
    # The trained model as the trainer left it: its base + the live L1 weights it saved (rank 0).
    trained = attach_acre(AutoModelForCausalLM.from_pretrained(run / "base_model"))
    live = load_file(str(checkpoint / "trainable.safetensors"))
    with torch.no_grad():
        for name, p in acre_parameters(trained):
            p.copy_(live[name])
    expected = _logits(trained.eval())
    assert not torch.equal(live["model.acre_embed_tokens.weight"],
                           trained.model.embed_tokens.weight[trained.config.eos_token_id][None])  # it trained

    for extra in ([], ["--adapter-only"]):
        out = tmp_path / ("export" + "".join(extra))
        assert cli_main(["export", str(run), str(out), *extra]) == 0
        data = check_export_dir(out)
        assert data["acre"]["source"]["weights_from"] == "deepspeed-zero"
        assert data["acre"]["inference"] == {"first_chunk": 64, "stride": 32, "interval": 16,
                                             "working_window": 32768, "max_refill": 4096}
        loaded = AcreForCausalLM.from_pretrained(out)
        for got, want in zip(_logits(loaded), expected):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_consolidated_names_are_matched_onto_l1_parameters():
    from acre_train.export.checkpoint import match_acre_names

    model = _trained()
    state = {"model." + k: v for k, v in ((n, p.detach()) for n, p in acre_parameters(model))}
    assert set(match_acre_names(state, model)) == {n for n, _ in acre_parameters(model)}
    with pytest.raises(ValueError, match="non-L1 weight"):
        match_acre_names({"model.lm_head.weight": torch.zeros(1)}, model)


@pytest.mark.parametrize("kind", ["full", "adapter"])
def test_an_export_whose_config_names_more_layers_than_its_weights_is_refused(kind, exports, tmp_path):
    """An edited num_hidden_layers would build that many layers, the missing ones random (100,000 of them:
    out of memory); the weights' headers are compared first, and nothing is built."""
    import shutil

    from acre_train.files import DamagedFileError
    from acre_train.infer.load import load_export

    _, full, adapter, root = exports
    folder = tmp_path / kind
    shutil.copytree(full if kind == "full" else adapter, folder)
    if kind == "adapter":
        (folder / "config.json").write_text((folder / "config.json").read_text().replace('"../base"', json.dumps(str(root / "base"))))
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    load_export(folder)  # as exported: loads
    config["num_hidden_layers"] = 100_000
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DamagedFileError, match=f"names 100000 layers but the weights hold {layers}"):
        load_export(folder)


def test_an_export_whose_config_implies_other_shapes_is_refused_naming_one(exports, tmp_path):
    """An edited width (intermediate_size) met transformers' re-initialisation report and a traceback; the
    headers' shapes are compared with the config's on the meta device first."""
    import shutil

    from acre_train.files import DamagedFileError
    from acre_train.infer.load import load_export

    _, full, _, _ = exports
    folder = tmp_path / "wide"
    shutil.copytree(full, folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DamagedFileError, match=r"do not fit its config.json \(model.layers.0.mlp.down_proj.weight"):
        load_export(folder)


def test_chat_refuses_a_context_longer_than_the_export_serves_before_reading_it_all(exports, tmp_path, capsys):
    from acre_train.infer import AcreEngine, CacheSettings, ContextTooLongError, RefillSettings
    from acre_train.infer.load import load_export

    _, full, _, _ = exports
    big = tmp_path / "big.txt"
    big.write_text("The harbour master kept a ledger of every ship that came in. " * 140_000)  # ~8.5 MB
    assert cli_main(["chat", str(full), "--context", str(big)], ) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (after the weights' loading bar)
    assert last.startswith("acre-train chat: error: ") and "holds more than the" in last
    assert "tokens this export can serve" in last

    model, tok, _ = load_export(full)
    seen = []

    class Counting:  # the tokenizer, counting the characters it is given
        def __call__(self, text, **kw):
            seen.append(len(text))
            return tok(text, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    engine = AcreEngine(model, Counting(), cache_settings=CacheSettings(32, 16, 4),
                        refill=RefillSettings(working_window=64))
    with pytest.raises(ContextTooLongError, match="stopped reading after 1,048,576 characters"):
        engine.read_context(big)
    assert sum(seen) == 1 << 20 < big.stat().st_size / 8
    small = tmp_path / "small.txt"
    small.write_text("A short context. " * 10)
    assert engine.read_context(small) == small.read_text()
