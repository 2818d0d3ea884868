"""Files a user may be handed, and a disk that fills up (issue: nothing lost, nothing silent, items 8-9).

* a crafted DeepSpeed ``*_states.pt`` is refused (never unpickled) by export's consolidation;
* damaged safetensors (checkpoint weights, adapter export) are errors naming the file;
* a full disk during a checkpoint, a preparation or an export leaves nothing that looks complete.
"""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path

import pytest
import torch

from acre_train.cli import main as cli_main
from acre_train.export import export_model
from acre_train.files import DamagedFileError, DiskFullError, UntrustedPickleError, deepspeed_weights_only
from acre_train.modeling import acre_parameters, attach_acre
from acre_train.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class _Payload:
    """Unpickling this runs ``Path(marker).touch()``: what a crafted checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _crafted_zero_checkpoint(folder: Path, marker: Path) -> Path:
    state = folder / "global_step1"
    state.mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        with open(state / name, "wb") as f:
            pickle.dump({"module": {}, "payload": _Payload(str(marker))}, f)
    return folder


def test_a_crafted_deepspeed_checkpoint_is_refused_not_run(tmp_path):
    pytest.importorskip("deepspeed")
    from acre_train.export.checkpoint import consolidate_zero

    marker = tmp_path / "pwned"
    ds = _crafted_zero_checkpoint(tmp_path / "ds", marker)
    with pytest.raises(UntrustedPickleError, match=r"mp_rank_00_model_states\.pt|optim_states\.pt"):
        consolidate_zero(ds)
    assert not marker.exists()
    # The patch is scoped: outside the context torch.load is the library's own again.
    with deepspeed_weights_only():
        assert torch.load.__name__ == "restricted"
    assert torch.load.__name__ == "load"


def test_the_allow_list_loads_what_deepspeed_writes(tmp_path):
    """DeepSpeed's own objects (loss scaler, fragment addresses, ZeRO stage enum) pass weights_only."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    del deepspeed
    path = tmp_path / "optim_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "stage": ZeroStageEnum.gradients,
                "addr": fragment_address(numel=4, start=0), "t": torch.ones(2)}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # without the allow-list
    with deepspeed_weights_only():
        state = torch.load(path)
    assert state["stage"] == ZeroStageEnum.gradients and torch.equal(state["t"], torch.ones(2))


def _model():
    model = attach_acre(tiny_model("qwen2", vocab_size=1024, eos_token_id=0))
    with torch.no_grad():
        for _, p in acre_parameters(model):
            p.add_(0.01)
    return model


def test_damaged_weights_are_errors_naming_the_file(tmp_path, capsys):
    from acre_train.infer.load import load_export
    from acre_train.train.checkpoint import load_trainable

    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "trainable.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(DamagedFileError, match=r"checkpoint-3/trainable\.safetensors is damaged"):
        load_trainable(checkpoint)

    base = tmp_path / "base"
    model = _model()
    tiny_model("qwen2", vocab_size=1024, eos_token_id=0).save_pretrained(base)
    from acre_train.data.tiny_tokenizer import tiny_tokenizer

    export = export_model(model, tmp_path / "export", adapter_only=True, base_model=str(base), tokenizer=tiny_tokenizer())
    weights = export / "acre_adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated copy
    with pytest.raises(ValueError, match=r"acre_adapter\.safetensors is damaged or truncated"):
        load_export(export)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"context": "Paris is in France.", "question": "Where is Paris?"}) + "\n")
    capsys.readouterr()
    assert cli_main(["generate", str(export), "--input", str(rows), "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "acre_adapter.safetensors is damaged" in capsys.readouterr().err


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from acre_train.train import checkpoint as ckpt

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    common = dict(rank=0, barrier=lambda: None, trainable={"w": torch.ones(2)}, meta={"step": 0},
                  recipe_yaml="run_name: x\n", optimizer=opt, scheduler=sched, keep_last=2)
    first = ckpt.save_checkpoint(tmp_path, 1, **common)
    monkeypatch.setattr(ckpt, "save_file", _no_space)
    with pytest.raises(DiskFullError, match="disk is full while writing .*checkpoint-2"):
        ckpt.save_checkpoint(tmp_path, 2, **common)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "latest"]
    assert ckpt.latest_checkpoint(tmp_path) == first
    monkeypatch.undo()

    def stream_writer_full(*_args, **_kwargs):  # what torch.save raises on a full disk: no errno
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(ckpt.torch, "save", stream_writer_full)
    with pytest.raises(DiskFullError, match="writing .*checkpoint-2.* failed .*file write failed.*disk is likely full"):
        ckpt.save_checkpoint(tmp_path, 2, **common)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "latest"]


def test_a_full_disk_during_preparation_or_export_leaves_nothing(tmp_path, monkeypatch):
    import datasets

    from acre_train.data import Stage2Settings, prepare_stage2

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", _no_space)
    settings = Stage2Settings(inputs=(str(path),), output=tmp_path / "prepared", first_chunk=64, stride=32,
                              intervals=(4,))
    with pytest.raises(DiskFullError, match="prepared dataset"):
        prepare_stage2(settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    with pytest.raises(DiskFullError, match="export"):
        export_model(_model(), tmp_path / "export", adapter_only=True, base_model="somewhere")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


def test_a_full_disk_while_saving_a_cache_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.torch

    from acre_train.infer import AcreEngine, CacheSettings, save_cache

    engine = AcreEngine(_model(), cache_settings=CacheSettings(16, 8, 4))
    cache = engine.build(list(range(5, 45)))
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    with pytest.raises(DiskFullError, match="cache"):
        save_cache(cache, tmp_path / "ctx.cache")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_is_replace_then_delete_and_a_kill_between_leaves_a_complete_folder(tmp_path, monkeypatch):
    """publish_dir renames the old folder aside before the new one goes in: killed right after that
    rename, ``final`` is the new, complete folder and the old one is a hidden leftover the next run clears."""
    import shutil

    from acre_train import files

    final, new = tmp_path / "export", tmp_path / ".export.partial-1"
    final.mkdir()
    (final / "config.json").write_text("old")
    (final / "weights").write_text("old weights")
    new.mkdir()
    (new / "config.json").write_text("new")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # a kill while the old folder is being deleted

    monkeypatch.setattr(shutil, "rmtree", killed)
    try:
        files.publish_dir(new, final)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert (final / "config.json").read_text() == "new" and not (final / "weights").exists()
    assert list(tmp_path.glob(".export.old-*"))
    files.remove_stale(final)
    assert not list(tmp_path.glob(".export.*")) and (final / "config.json").read_text() == "new"


def test_overwrite_never_deletes_a_folder_whose_manifest_is_not_ours(tmp_path):
    """A folder holding someone else's manifest.json (a web app's) is not a prepared dataset: preparing
    into it with overwrite is refused and nothing in it is touched."""
    from acre_train.data import DataError, Stage1Settings, prepare_stage1
    from acre_train.data.output import is_prepared_dataset

    app = tmp_path / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "My App", "icons": [], "start_url": "/"}')
    (app / "index.html").write_text("<html></html>")
    assert not is_prepared_dataset(app)
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare_stage1(Stage1Settings(builtin=True, output=app, overwrite=True, token_budget=2000,
                                      min_length=64, max_length=128, first_chunk=32, stride=16), log=lambda *_: None)
    assert (app / "index.html").read_text() == "<html></html>"


def test_overwrite_of_a_prepared_dataset_keeps_a_user_s_own_file_by_refusing(tmp_path):
    """A dataset folder of ours with a file its user put there: --overwrite would delete that file with the
    rest, so it is refused naming it; without the file the same preparation replaces the dataset."""
    from acre_train.data import DataError, Stage1Settings, prepare_stage1

    settings = dict(builtin=True, output=tmp_path / "data", token_budget=2000, min_length=64, max_length=128,
                    first_chunk=32, stride=16)
    prepare_stage1(Stage1Settings(**settings), log=lambda *_: None)
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"holds files acre-train did not write \(notes.txt\)"):
        prepare_stage1(Stage1Settings(**settings, overwrite=True, seed=1), log=lambda *_: None)
    assert (tmp_path / "data" / "notes.txt").read_text() == "mine"
    (tmp_path / "data" / "notes.txt").unlink()
    prepare_stage1(Stage1Settings(**settings, overwrite=True, seed=1), log=lambda *_: None)


def test_the_folder_writer_publishes_whole_or_nothing_and_can_keep_what_another_process_made(tmp_path):
    from acre_train.files import atomic_dir

    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("killed midway")
    assert not final.exists() and not list(tmp_path.glob(".out.partial-*"))
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("mine")
    assert (final / "a.txt").read_text() == "mine"
    with atomic_dir(final, keep_existing=True) as tmp:  # someone finished first: theirs stays
        (tmp / "a.txt").write_text("second")
    assert (final / "a.txt").read_text() == "mine" and not list(tmp_path.glob(".out.partial-*"))
    with atomic_dir(final) as tmp:  # the default replaces
        (tmp / "a.txt").write_text("third")
    assert (final / "a.txt").read_text() == "third"


# ----------------------------------------------------------------------------- folder locks

def test_a_planted_link_at_the_lock_path_is_refused_and_its_target_untouched(tmp_path, capsys):
    from acre_train.files import FolderBusy, FolderLock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "export"
    (tmp_path / ".export.lock").symlink_to(victim)
    with pytest.raises(FolderBusy, match="symbolic link"):
        with FolderLock(out, "export"):
            pass
    assert victim.read_text() == "precious\n"
    # Through a verb that takes the lock: one line, exit 2, and still nothing written through the link.
    (tmp_path / ".data.lock").symlink_to(victim)
    assert cli_main(["preprocess", "stage1", "--builtin", "--output", str(tmp_path / "data")]) == 2
    assert "symbolic link" in capsys.readouterr().err and victim.read_text() == "precious\n"
    (tmp_path / ".export.lock").unlink()
    (tmp_path / ".export.lock").mkdir()  # not a regular file either
    with pytest.raises(FolderBusy, match="not a regular file"):
        with FolderLock(out):
            pass


def test_a_lock_on_a_file_its_holder_removed_is_not_taken(tmp_path, monkeypatch):
    """Two lockers race the holder's unlink: the one that locked the removed file must open again (and then
    be refused by the one that made the new file), never both hold "the" lock."""
    import fcntl
    import os

    import acre_train.files as files

    out = tmp_path / "run"
    lock = files.FolderLock(out)
    holder = files.FolderLock(out)
    first = {"done": False}
    real_open = files.FolderLock._open

    def open_then_lose_the_race(self):
        fd = real_open(self)
        if not first["done"]:  # between our open and our flock, the file is removed and made anew by another
            first["done"] = True
            os.unlink(self.path)
            holder.__enter__()
        return fd

    monkeypatch.setattr(files.FolderLock, "_open", open_then_lose_the_race)
    with pytest.raises(files.FolderBusy, match=f"pid {os.getpid()}"):
        lock.__enter__()  # it locked the removed file, saw that, opened the new one: held by `holder`
    holder.__exit__(None, None, None)
    assert not lock.path.exists()
    with files.FolderLock(out) as again:  # free again once the holder is gone
        assert lock.path.read_text() == str(os.getpid())
    del fcntl, again
