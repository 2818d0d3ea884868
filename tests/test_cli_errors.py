"""One error policy for every verb (acre_train/errors.py, applied once by cli.main): what a user can fix
is one line on stderr and exit code 2, never a traceback, and is found before work starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acre_train.cli import main
from acre_train.files import DiskFullError

REPO = Path(__file__).resolve().parents[1]
TINY1, TINY2 = REPO / "recipes/tiny_stage1.yaml", REPO / "recipes/tiny_stage2.yaml"


def one_line(capsys, verb: str, *expected: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    # (the last line: progress bars may come before it; a recipe's problems follow it as a list)
    lines = err.splitlines()
    head = max(i for i, line in enumerate(lines) if not line.startswith("  - "))
    assert lines[head].startswith(f"acre-train {verb}: error:"), err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("verb", ["train", "preprocess"])
def test_a_full_disk_in_train_and_preprocess_is_one_line(verb, monkeypatch, tmp_path, capsys):
    def full(*_a, **_k):
        raise DiskFullError(f"no space left on the device holding {tmp_path}: free some and resume")

    if verb == "train":
        monkeypatch.setattr("acre_train.train.trainer.train", full)
        argv = ["train", str(TINY1), f"output_root={tmp_path}"]
    else:
        monkeypatch.setattr("acre_train.data.prepare_stage1", full)
        argv = ["preprocess", "stage1", "--builtin", "--tokenizer", "tiny", "--output", str(tmp_path / "d")]
    assert main(argv) == 2
    one_line(capsys, verb, "no space left")


def test_a_binary_json_input_names_the_file(tmp_path, capsys):
    data = tmp_path / "data.json"
    data.write_bytes(b"[" + bytes(range(128, 256)))
    assert main(["preprocess", "stage2", "--input", str(data), "--tokenizer", "tiny", "--output", str(tmp_path / "o")]) == 2
    one_line(capsys, "preprocess", f"{data}: not UTF-8 text")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, expected", [
    (["--tiny", "--output", "FILE"], "is a file, not a folder"),
    (["--tiny", "--steps", "0"], "--steps must be >= 1"),
    (["--tiny", "--context-paragraphs", "0"], "--context-paragraphs must be >= 1"),
    (["--context-paragraphs", "0"], "applies to the --tiny path only"),  # the real path never ran it
    (["--tiny", "--output", ""], "--output is empty"),
    (["--questions", "0"], "--questions must be >= 1"),
])
def test_quickstart_arguments_are_checked_before_any_work(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("mine")
    argv = [a.replace("FILE", str(tmp_path / "FILE")) for a in argv]
    assert main(["quickstart", *argv]) == 2
    one_line(capsys, "quickstart", expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing written, here or anywhere below


def test_an_empty_refill_loss_layer_list_is_a_recipe_error(capsys):
    assert main(["validate", str(TINY2), "train.refill_loss.weight=1", "train.refill_loss.layers=[]"]) == 2
    one_line(capsys, "validate", "train.refill_loss.layers")


def test_a_damaged_init_from_adapter_is_one_line(tmp_path, capsys):
    import torch

    from acre_train.export.writer import export_model
    from acre_train.modeling import attach_acre
    from acre_train.tiny import tiny_model

    base = tiny_model("qwen2", vocab_size=1024, eos_token_id=0)
    base.save_pretrained(tmp_path / "base")
    export = export_model(attach_acre(base), tmp_path / "adapter", adapter_only=True, base_model=str(tmp_path / "base"))
    weights = Path(export) / "acre_adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    torch.set_num_threads(1)
    assert main(["train", str(TINY2), f"output_root={tmp_path}", f"model.init_from={export}",
                 f"model.source={tmp_path / 'base'}", "model.tiny_config={}", "train.max_steps=1"]) == 2
    one_line(capsys, "train", f"{weights} is damaged or truncated")


def test_a_squad_file_of_the_wrong_structure_is_one_line(tmp_path, capsys):
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": 5}))
    assert main(["reproduce", "real", "--squad", str(squad), "--root", str(tmp_path / "r"), "--steps", "streams"]) == 2
    one_line(capsys, "reproduce", f"{squad}: not SQuAD JSON")


def test_a_model_folder_with_custom_code_is_never_run_even_when_stdin_says_yes(tmp_path, monkeypatch):
    """transformers asks "run custom code?" on stdin when a folder names its own classes; chat reads its
    questions from stdin, so a first line of "y" used to answer that prompt. acre-train passes
    trust_remote_code=False wherever it loads a folder that is not its own export."""
    import io
    import json

    from acre_train.data.tiny_tokenizer import tiny_tokenizer
    from acre_train.infer.load import load_for_inference
    from acre_train.tiny import tiny_model

    folder = tmp_path / "custom"
    tok = tiny_tokenizer()
    tiny_model("qwen2", vocab_size=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    marker = tmp_path / "ran.txt"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import Qwen2Config as EvilConfig, Qwen2ForCausalLM as EvilModel\n")
    for name, key in (("config.json", "AutoModelForCausalLM"), ("tokenizer_config.json", "AutoTokenizer")):
        data = json.loads((folder / name).read_text())
        data["auto_map"] = {key: "evil.EvilModel" if key != "AutoTokenizer" else ["evil.EvilModel", None],
                            "AutoConfig": "evil.EvilConfig"}
        (folder / name).write_text(json.dumps(data))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\ny\n"))
    model, tokenizer, _ = load_for_inference(folder, log=lambda *_: None)
    assert not marker.exists() and type(model).__name__ == "Qwen2ForCausalLM" and tokenizer is not None


@pytest.mark.parametrize("verb,args", [("chat", ["--context", "ctx.txt"]), ("generate", ["--input", "in.jsonl", "--output", "o"]),
                                       ("calibrate", ["--data", "niah_multikey"]), ("eval", ["--tasks", "niah_multikey"])])
def test_a_device_this_machine_lacks_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch, verb, args):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ctx.txt").write_text("a context")
    (tmp_path / "in.jsonl").write_text('{"context": "a", "question": "b"}\n')
    model = ["--model", str(tmp_path)] if verb == "eval" else [str(tmp_path)]
    assert main([verb, *model, *args, "--device", "cuda"]) == 2
    one_line(capsys, verb, "--device cuda: no CUDA device here", "use --device cpu")
    assert main([verb, *model, *args, "--device", "gpu"]) == 2
    one_line(capsys, verb, "--device 'gpu' is not a device")
