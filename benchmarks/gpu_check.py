"""The GPU check: ACRE training and inference against full attention on one accelerator, in one command.

For a session that has a GPU (no download: random weights from configs shaped like Qwen2.5-3B and 7B,
bf16). It measures, each in a try block that records an out-of-memory as "OOM":

1. **Training step** (stage 1, one sample, forward + backward of what the trainer runs): ACRE with
   the ``chunked`` and ``flex`` kernels, liger fused linear+CE on and off, against full-attention
   fine-tuning of the same model (SDPA; every weight trains, as SFT-Vanilla) at 16K, 32K, 64K
   tokens: tokens/s and peak GPU memory.
2. **Inference** (the shape of the paper's Table 2): ACRE cache build and one question (score,
   refill, 16 decoded tokens) at 128K and 256K tokens, against full attention's prefill + the same
   question: seconds and peak memory.
3. **flex equals chunked** on CUDA: the ACRE logits of both kernels on one 8K sample (bf16 tolerance).

    python benchmarks/gpu_check.py --out docs/gpu.json           # on the GPU node, <= 8 minutes on one H200
    python benchmarks/gpu_check.py --tiny                        # CPU, tiny shapes (CI: keeps the script alive)

``--tiny`` runs the same code paths at tiny shapes and lengths on CPU in fp32 (``flex`` and liger
are skipped there: they need CUDA). The JSON holds every figure; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {  # Qwen2 configs of the released models (hidden, layers, heads, kv heads, intermediate, vocab)
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}


def _model(shape: str, device, dtype, acre: bool = True, lora: bool = False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from acre_train.modeling import attach_acre

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=1 << 20, rope_theta=1e6, tie_word_embeddings=False,
                         eos_token_id=2)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    if acre:
        attach_acre(model, lora={"rank": 16, "alpha": 32, "dropout": 0.0} if lora else None)
    return model.train()


def _peak(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _reset(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _guard(fn):
    """Run ``fn``; an out-of-memory becomes {"status": "OOM"}."""
    import torch

    try:
        return {"status": "ok", **fn()}
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            return {"status": "OOM"}
        return {"status": f"error: {str(exc).splitlines()[0][:200]}"}


def train_step(shape: str, length: int, arm: str, device, dtype, geometry) -> dict:
    import numpy as np
    import torch

    from acre_train.modeling import interleave
    from acre_train.modeling.batch import pad_batch
    from acre_train.train.model import LossModule

    _reset(device)
    vanilla = arm == "full"
    model = _model(shape, device, dtype, acre=not vanilla)
    if vanilla:
        model.requires_grad_(True)
    # Non-reentrant, as the trainer does (model.build_model): a chunk's loss reaches earlier L1 keys.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = np.random.default_rng(0).integers(10, model.config.vocab_size - 10, length)
    first, stride, interval = geometry
    if vanilla:
        batch = {"input_ids": torch.as_tensor(ids)[None], "labels": torch.as_tensor(ids)[None],
                 "attention_mask": torch.ones(1, length, dtype=torch.long)}
    else:
        batch = pad_batch([interleave(ids, first_chunk=first, stride=stride, intervals=interval).as_dict()])
    batch = {k: v.to(device) for k, v in batch.items()}
    kernel = "flex" if arm.startswith("flex") else "chunked"
    module = LossModule(model, kernel=None if vanilla else kernel, fused_ce=arm.endswith("+liger"))
    times = []
    for _ in range(2):  # the first step compiles / warms up; the second is timed
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, count, _ = module(**dict(batch))
        (loss / max(int(count), 1)).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - tic)
    return {"seconds": times[-1], "tokens_per_s": length / times[-1], "peak_gib": _peak(device)}


def inference(shape: str, length: int, arm: str, device, dtype, geometry) -> dict:
    import numpy as np
    import torch

    from acre_train.infer import AcreEngine, CacheSettings, RefillSettings

    _reset(device)
    ids = np.random.default_rng(1).integers(10, SHAPES[shape]["vocab_size"] - 10, length).tolist()
    question = ids[:32]
    first, stride, interval = geometry
    if arm == "acre":
        model = _model(shape, device, dtype).eval()
        engine = AcreEngine(model, cache_settings=CacheSettings(first, stride, interval),
                            refill=RefillSettings(working_window=1 << 20, max_refill=4096, max_new_tokens=16,
                                                  stop_at_eos=False))
        tic = time.perf_counter()
        with torch.no_grad():
            cache = engine.build(ids, progress=False)
        build = time.perf_counter() - tic
        tic = time.perf_counter()
        engine.answer(cache, question)
        return {"build_s": build, "question_s": time.perf_counter() - tic, "peak_gib": _peak(device)}
    model = _model(shape, device, dtype, acre=False).eval()
    tic = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, device=device)[None], use_cache=True, logits_to_keep=1)
        build = time.perf_counter() - tic
        tic = time.perf_counter()
        cache = out.cache  # transformers' dynamic cache, grown in place
        step = model(input_ids=torch.as_tensor(question, device=device)[None], cache=cache, use_cache=True,
                     logits_to_keep=1)
        token = step.logits[:, -1:].argmax(-1)
        for _ in range(16):
            step = model(input_ids=token, cache=cache, use_cache=True)
            token = step.logits[:, -1:].argmax(-1)
    return {"build_s": build, "question_s": time.perf_counter() - tic, "peak_gib": _peak(device)}


def flex_equals_chunked(device, dtype, geometry) -> dict:
    import numpy as np
    import torch

    from acre_train.modeling import acre_forward, interleave
    from acre_train.modeling.batch import pad_batch

    model = _model("qwen2.5-3b", device, dtype).eval()
    ids = np.random.default_rng(2).integers(10, 150000, 8192)
    first, stride, interval = geometry
    batch = {k: v.to(device) for k, v in pad_batch([interleave(ids, first_chunk=first, stride=stride,
                                                             intervals=interval).as_dict()]).items()}
    batch.pop("labels")
    with torch.no_grad():
        a = acre_forward(model, **batch, kernel="chunked", return_logits=True).logits.float()
        b = acre_forward(model, **batch, kernel="flex", return_logits=True).logits.float()
    diff = float((a - b).abs().max())
    return {"max_abs_diff": diff, "equal": bool(torch.allclose(a, b, atol=0.05 * float(a.abs().max()), rtol=0))}


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if row["status"] == "ok" else row["status"]


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes and lengths (CI)")
    parser.add_argument("--shapes", default="qwen2.5-3b,qwen2.5-7b")
    parser.add_argument("--train-lengths", default="16384,32768,65536")
    parser.add_argument("--infer-lengths", default="131072,262144")
    parser.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, shapes = torch.device("cpu"), torch.float32, ["tiny"]
        train_lengths, infer_lengths, geometry = [96, 160], [256], (32, 16, 4)
        train_arms = ["acre", "full"]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --tiny on CPU, or on a GPU node", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, args.shapes.split(",")
        train_lengths = [int(x) for x in args.train_lengths.split(",")]
        infer_lengths = [int(x) for x in args.infer_lengths.split(",")]
        geometry = (4096, 2048, 16)
        train_arms = ["acre", "acre+liger", "flex", "flex+liger", "full"]
    results: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                     "dtype": str(dtype), "geometry": geometry, "train": [], "inference": []}
    for shape in shapes:
        for length in train_lengths:
            for arm in train_arms:
                row = {"shape": shape, "length": length, "arm": arm, **_guard(lambda: train_step(
                    shape, length, arm.replace("acre", "chunked"), device, dtype, geometry))}
                results["train"].append(row)
                print(json.dumps(row), flush=True)
        for length in infer_lengths:
            for arm in ("acre", "full"):
                row = {"shape": shape, "length": length, "arm": arm,
                       **_guard(lambda: inference(shape, length, arm, device, dtype, geometry))}
                results["inference"].append(row)
                print(json.dumps(row), flush=True)
    if device.type == "cuda":
        results["flex_equals_chunked"] = _guard(lambda: flex_equals_chunked(device, dtype, geometry))
        print(json.dumps(results["flex_equals_chunked"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print("\n| shape | tokens | arm | tokens/s | peak GiB |\n|---|---|---|---|---|")
    for r in results["train"]:
        print(f"| {r['shape']} | {r['length']} | {r['arm']} | {_cell(r, 'tokens_per_s', '.0f')} | {_cell(r, 'peak_gib', '.1f')} |")
    print("\n| shape | tokens | arm | build s | question s | peak GiB |\n|---|---|---|---|---|---|")
    for r in results["inference"]:
        print(f"| {r['shape']} | {r['length']} | {r['arm']} | {_cell(r, 'build_s', '.2f')} | "
              f"{_cell(r, 'question_s', '.2f')} | {_cell(r, 'peak_gib', '.1f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
