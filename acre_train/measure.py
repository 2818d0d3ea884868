"""One way to measure time and memory, for the trainer's log, generate's rows, eval's table and the benchmarks.

``PeakMemory`` reports two figures with one meaning each, for the block of code it wraps:

* ``peak_bytes``: the most memory in use at any moment of the block -- the CUDA allocator's peak on a
  GPU; on CPU the process's peak resident set (Linux ``VmHWM``, reset at the block's start so the
  figure is the block's own; elsewhere sampled every 2 ms);
* ``added_bytes``: ``peak_bytes`` minus what was in use when the block started (what the block's own
  work cost on top of, e.g., the loaded model).

``Timer`` is a wall-clock stopwatch that synchronises CUDA so GPU work is counted.
"""

from __future__ import annotations

import os
import threading
import time

import torch


class PeakMemory:
    """Context manager: ``peak_bytes`` / ``peak_mib`` and ``added_bytes`` of the wrapped block."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.peak_bytes = 0
        self.added_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _rss()
            self._exact = _reset_high_water_mark()
            self._peak = self._base
            if not self._exact:
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
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
            self.peak_bytes = max(self._peak, _rss(), _high_water_mark() if self._exact else 0)
        self.added_bytes = max(0, self.peak_bytes - self._base)


class Timer:
    """Wall-clock stopwatch (synchronises CUDA so GPU work is counted)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0


def _rss() -> int:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:  # Linux fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_high_water_mark() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS; False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return _high_water_mark() > 0
    except OSError:
        return False


def _high_water_mark() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
