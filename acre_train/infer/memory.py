"""Peak memory figures for reports: the CUDA allocator's peak, or the process's peak RSS on CPU."""

from __future__ import annotations

import torch


def peak_memory_mib(device: torch.device | str) -> float:
    """Peak allocated tensor memory on a CUDA device, else the process's peak resident set (VmHWM)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak(device: torch.device | str) -> bool:
    """Reset the peak counter; returns False where that is impossible (then peaks are process-wide)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False
