"""Peak memory of a block of code: CUDA allocator peak on GPU, sampled process RSS on CPU."""

from __future__ import annotations

import os
import threading
import time

import torch


class PeakMemory:
    """Context manager; ``peak_bytes`` is the peak *increase* over the start of the block.

    CUDA: ``torch.cuda.max_memory_allocated`` (exact, tensors only). CPU: the process RSS sampled
    every ``interval`` seconds by a thread (psutil, else /proc), so short spikes can be missed and
    allocator caching can hide frees; treat CPU figures as estimates.
    """

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _rss()
            self._peak = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self._peak = max(self._peak, _rss())
            self.peak_bytes = self._peak - self._base


def _rss() -> int:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:  # Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
