"""The machine a benchmark ran on: CPU, its instruction-set features, cores, memory, torch, load.

The ``masks`` group's bfloat16 bars depend on the CPU: with bf16 dot-product instructions
(``avx512_bf16`` or ``amx_bf16``) bfloat16 must beat float32; without them (AVX2, or AVX-512
without BF16) it must come close to it. :func:`cpu_features` reads the flags that decide this
from ``/proc/cpuinfo``, and every record of a run carries them (:func:`machine`).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BF16_FLAGS",
    "CPU_FLAGS",
    "READ_BYTES",
    "bf16_class",
    "cpu_features",
    "cpu_line",
    "describe_features",
    "last_level_cache_bytes",
    "machine",
    "measure_read_bandwidth",
]

GiB = 1 << 30
#: the tensor :func:`measure_read_bandwidth` sums: far beyond any CPU's last-level cache
READ_BYTES = 1 << 29

#: the flags a record names, in this order: what attnkit's kernels and torch's may use
CPU_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"
)  # fmt: skip
#: the flags that give bfloat16 dot products in hardware
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_features(cpuinfo: str | None = None) -> list[str] | None:
    """Which of :data:`CPU_FLAGS` the CPU has (``None`` where ``/proc/cpuinfo`` is missing).

    >>> cpu_features("flags\\t\\t: fpu sse avx2 fma avx512f\\n")
    ['avx2', 'fma', 'avx512f']
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
    return [f for f in CPU_FLAGS if f in flags]


def bf16_class(features: list[str] | None) -> str:
    """``"bf16"`` where the CPU has bf16 dot products (AVX512-BF16 or AMX), ``"no-bf16"`` where
    it has not (AVX2, AVX-512 without BF16), ``"unknown"`` where the flags were not read."""
    if features is None:
        return "unknown"
    return "bf16" if any(f in features for f in BF16_FLAGS) else "no-bf16"


def describe_features(features: list[str] | None) -> str:
    """``"avx2 fma (no avx512f, avx512_bf16, amx_tile, amx_bf16)"`` for a record's line."""
    if features is None:
        return "CPU flags unknown (no /proc/cpuinfo)"
    missing = [f for f in CPU_FLAGS if f not in features]
    have = " ".join(features) or "none of " + " ".join(CPU_FLAGS)
    return have + (f" (no {', '.join(missing)})" if missing and features else "")


def cpu_line() -> str:
    """One line for a benchmark's header: the CPU's model name and which of :data:`CPU_FLAGS` it
    has (every figure a benchmark prints depends on them)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {name}, {os.cpu_count()} cores; flags: {describe_features(cpu_features())}"


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the CPU's largest cache in bytes (sysfs, ``index*/size`` of the highest
    ``level``), or ``None`` where sysfs does not say.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for i, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "32768K")]):
    ...         p = pathlib.Path(d, f"index{i}"); p.mkdir()
    ...         _ = (p / "level").write_text(f"{level}\\n"); _ = (p / "size").write_text(size)
    ...     last_level_cache_bytes(d) == 32 * 2**20
    True
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best: tuple[int, int] | None = None
    for index in sorted(Path(root).glob("index*")):
        try:
            level = int((index / "level").read_text())
            raw = (index / "size").read_text().strip()
            size = int(raw[:-1]) * units[raw[-1]] if raw[-1] in units else int(raw)
        except (OSError, ValueError, IndexError):
            continue
        if best is None or level > best[0] or (level == best[0] and size > best[1]):
            best = (level, size)
    return None if best is None else best[1]


def measure_read_bandwidth(nbytes: int = READ_BYTES, reps: int = 7) -> float:
    """The machine's memory read bandwidth, GB/s (1e9 bytes), as torch's threads see it: the
    median time of ``torch.sum`` over a float32 tensor of ``nbytes`` (512 MiB: far more than the
    last-level cache, so every byte comes from memory), after one untimed sum. A sum reads each
    byte once and writes nothing, with ``torch.get_num_threads()`` threads: the rate a
    memory-bound kernel on those threads can at most read K/V at.

    >>> measure_read_bandwidth(1 << 20, reps=1) > 0
    True
    """
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def machine() -> dict[str, Any]:
    """The machine line: CPU and its flags, cores, memory, torch and its threads, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    features = cpu_features()
    return {
        "cpu": cpu,
        "cpu_features": features,
        "bf16_class": bf16_class(features),
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1) if mem else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "load_at_start": round(load, 2) if load is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
