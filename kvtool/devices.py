"""Where the engine runs: `--device auto|cpu|cuda|cuda:N`.

The device is chosen once, when the model is loaded; the paged KV buffers,
the connector's copies and (for CacheGen) the coder follow the model's
weights. `auto` takes the GPU when torch sees one. The model's arithmetic on a
GPU differs from the CPU's in the last bits (another matmul order); what the
GPU changes nowhere else is the copies and the codecs: they produce the same
tensors and bytes as on the CPU.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from .errors import UsageError

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d{1,9}))?$")


def check_device_spec(spec: str | None) -> re.Match:
    """The form of `auto`, `cpu`, `cuda`, `cuda:N`, checked without torch (a usage error)."""
    spec = "auto" if spec is None else spec.strip().lower()
    match = _SPEC.match(spec)
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise UsageError(f"--device {spec!r}: expected {DEVICE_CHOICES}")
    return match


def resolve_device(spec: "str | torch.device | None") -> "torch.device":
    """`auto` (or None), `cpu`, `cuda`, `cuda:N` -> a torch.device that exists here."""
    import torch

    if isinstance(spec, torch.device):
        spec = str(spec)
    match = check_device_spec(spec)
    spec = match.group(0)
    kind, index = match.group(1), match.group(2)
    if kind == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if not torch.version.cuda else "torch sees no CUDA device"
        raise UsageError(f"--device {spec}: no CUDA here ({why})")
    n = torch.cuda.device_count()
    i = int(index) if index is not None else torch.cuda.current_device()
    if i >= n:
        raise UsageError(f"--device {spec}: this machine has {n} CUDA device(s)")
    return torch.device("cuda", i)


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say (then nothing is refused)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_share = threading.local()  # .threads: this thread's share of the cores (a worker of a parallel load)


def host_threads() -> int:
    """Threads kvtool's own CPU work may use: KVTOOL_THREADS, else the cores this process may run
    on; within `thread_share(n)`, at most n (a load's workers already use the cores in parallel)."""
    env = os.environ.get("KVTOOL_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        threads = int(env)
    else:
        try:
            threads = max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            threads = max(1, os.cpu_count() or 1)
    share = getattr(_share, "threads", None)
    return threads if share is None else max(1, min(threads, share))


@contextmanager
def thread_share(threads: int) -> Iterator[None]:
    """Within it, this thread's native copies and coders use at most `threads` threads: a worker
    of a load that runs `w` of them in parallel takes cores / w, not every core again."""
    previous = getattr(_share, "threads", None)
    _share.threads = threads
    try:
        yield
    finally:
        _share.threads = previous


def synchronize(device: "torch.device") -> None:
    """Wait for the device's queued work, so a wall-clock timing covers it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def describe(device: "torch.device") -> str:
    """'cpu' or 'cuda:0 (NVIDIA H100 80GB HBM3)': for reports and file metadata."""
    if device.type == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
