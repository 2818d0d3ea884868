"""What a saved cache costs in memory once loaded: its raw (L2) KV stays in the file's pages.

    python benchmarks/cache_memory.py                      # tiny model, a random 6K-token context (CI)
    python benchmarks/cache_memory.py --export checkpoints/long/shipped-export \\
        --cache checkpoints/long/dev-caches-16k/long_needles-dev-16384-c0.safetensors \\
        --question "What is the access code of the Medlar Flint archive?"

safetensors maps a file (its default ``mmap`` backend) and the loaded CPU tensors are views of that
mapping, so the L2 keys and values occupy file pages, which the kernel may drop and read again, not
anonymous memory, which must fit the RAM. Printed: the L2's size, and the anonymous memory and file
pages the load and the questions added to this process (Linux ``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path


def _memory() -> dict[str, float]:
    """This process's anonymous and file-backed resident memory, MiB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}


def _engine(args):
    import torch

    from acre_train.infer import AcreEngine, CacheSettings, RefillSettings

    if args.export:
        from acre_train.infer.load import load_export
        from acre_train.infer.settings import inference_settings

        model, tokenizer, data = load_export(args.export, dtype=torch.float32)
        cache_settings, refill = inference_settings(data)
        return AcreEngine(model, tokenizer, cache_settings=cache_settings,
                          refill=refill.replace(max_new_tokens=args.new_tokens, stop_at_eos=False))
    from acre_train.modeling import attach_acre
    from acre_train.tiny import tiny_model

    model = attach_acre(tiny_model("qwen2", vocab_size=512, eos_token_id=0, max_position_embeddings=8192,
                                   hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)).eval()
    return AcreEngine(model, cache_settings=CacheSettings(512, 256, 16),
                      refill=RefillSettings(working_window=4096, max_refill=128, max_new_tokens=args.new_tokens,
                                            stop_at_eos=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", default=None, help="an export folder (default: a tiny random model)")
    p.add_argument("--cache", default=None, help="a cache saved by that export (default: one built here, tiny)")
    p.add_argument("--question", action="append", default=None, help="a question (text; repeat for several)")
    p.add_argument("--tokens", type=int, default=6000, help="the tiny context's length")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if bool(args.export) != bool(args.cache):
        p.error("--export and --cache go together (a cache is tied to the model that built it)")
    import torch

    from acre_train.infer import save_cache

    torch.set_num_threads(args.threads)
    engine = _engine(args)
    questions: list = args.question or [[10 + q + i % 300 for i in range(30)] for q in range(3)]
    engine.answer(engine.build([5 + i % 400 for i in range(700)], progress=False), questions[0])  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        path = args.cache
        if path is None:  # the tiny run saves its own cache first, then frees it
            ids = torch.randint(5, 512, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
            path = save_cache(engine.build(ids, progress=False), Path(tmp) / "tiny.safetensors")
            gc.collect()
        before = _memory()
        tic = time.perf_counter()
        cache = engine.load_cache(path)
        load_s = time.perf_counter() - tic
        loaded = _memory()
        for q in questions:
            engine.answer(cache, q)
        after = _memory()
        l2 = (cache.l2_keys.numel() + cache.l2_values.numel()) * cache.l2_keys.element_size() / 2**20
        print(f"cache {path}: L2 {l2:,.1f} MiB, loaded in {load_s:.2f}s")
        print(f"memory added (MiB)  anonymous (must fit the RAM)  file pages (the kernel may drop them)")
        for name, now in (("after the load", loaded), (f"after {len(questions)} questions", after)):
            print(f"  {name:<18} {now['RssAnon'] - before['RssAnon']:>10,.1f} {now['RssFile'] - before['RssFile']:>28,.1f}")
        print(f"anonymous memory after the questions / L2 size: {(after['RssAnon'] - before['RssAnon']) / l2:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
