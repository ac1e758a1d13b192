"""Build-on-first-use loader of kvtool's CUDA kernels (kernels/*.cu -> .so -> ctypes).

A leaf: it imports nothing of kvtool but the base modules (its error, the cache root). The op wrappers
sit beside what they speed up (`connectors/paged_cuda.py`,
`codecs/cachegen/gpu.py`) and call `load(name)`.

Each op (`paged_copy`, `cachegen_cuda`) is one .cu file compiled by nvcc into
its own shared library, cached under ``$KVTOOL_CUDA_CACHE`` (default
``<kvtool cache>/cuda`` (``~/.cache/kvtool/cuda``)) by a hash of its sources, the nvcc version, the
flags and the GPU architecture; later loads are a dlopen. Kernels receive
torch tensors' data_ptrs and the current stream, so no torch headers are
involved and a build takes seconds.

Nothing here runs unless ``torch.cuda.is_available()``: a machine without
CUDA never looks for nvcc. ``KVTOOL_CUDA=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import CudaUnavailable
from .fsutil import cache_root
from .notices import notice

_HERE = Path(__file__).resolve().parent
KERNELS = ("paged_copy", "cachegen_cuda")

# The headers a kernel may include (all of kernels/*.h are hashed; cheap).
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo"]


def disabled() -> bool:
    return os.environ.get("KVTOOL_CUDA", "1").strip().lower() in ("0", "false", "no", "off")


def available() -> bool:
    """True when the CUDA kernels may be used here (torch sees a GPU, not disabled)."""
    if disabled():
        return False
    import torch

    return torch.cuda.is_available()


def kernels_dir() -> Path | None:
    """Where the .cu/.h sources are: $KVTOOL_KERNELS_DIR, the package's own
    copy (kvtool/_kernels, in a wheel), or the repository's kernels/."""
    cands = []
    env = os.environ.get("KVTOOL_KERNELS_DIR")
    if env:
        cands.append(Path(env))
    cands += [_HERE / "_kernels", _HERE.parent / "kernels"]
    for c in cands:
        if (c / "paged_index.h").is_file():
            return c
    return None


def find_nvcc() -> str | None:
    """$KVTOOL_NVCC, $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("KVTOOL_NVCC")
    if env:
        return env if os.path.isfile(env) else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    w = shutil.which("nvcc")
    if w:
        return w
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def cache_dir() -> Path:
    env = os.environ.get("KVTOOL_CUDA_CACHE")
    if env:
        return Path(env)
    return cache_root() / "cuda"


def gpu_arch(device: int | None = None) -> str:
    """'90' for sm_90; $KVTOOL_CUDA_ARCH overrides."""
    env = os.environ.get("KVTOOL_CUDA_ARCH")
    if env:
        return env.replace("sm_", "").replace(".", "")
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def arch_flags(arch: str) -> list[str]:
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


_nvcc_version_cache: dict[str, str] = {}


def _nvcc_version(nvcc: str) -> str:
    v = _nvcc_version_cache.get(nvcc)
    if v is None:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        v = _nvcc_version_cache[nvcc] = out.stdout.strip().splitlines()[-1] if out.stdout else "?"
    return v


def compile_cmd(nvcc: str, src: Path, out: Path, arch: str, kdir: Path) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *arch_flags(arch), f"-I{kdir}", "-o", str(out), str(src)]


@dataclass
class Built:
    name: str
    path: Path
    lib: ctypes.CDLL
    arch: str
    fresh: bool  # compiled by this call (not from the cache)


_lock = threading.Lock()
_built: dict[str, Built] = {}
_errors: dict[str, str] = {}


def source_hash(name: str, kdir: Path, nvcc: str, arch: str) -> str:
    h = hashlib.sha256()
    for p in sorted([kdir / f"{name}.cu", *kdir.glob("*.h")]):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(_nvcc_version(nvcc).encode())
    h.update(" ".join(NVCC_FLAGS + arch_flags(arch)).encode())
    return h.hexdigest()[:16]


def cached_path(name: str) -> Path | None:
    """The cached library for this machine's configuration, if it is built already
    (never compiles; None when CUDA/nvcc/sources are missing)."""
    if not available():
        return None
    kdir, nvcc = kernels_dir(), find_nvcc()
    if kdir is None or nvcc is None or not (kdir / f"{name}.cu").is_file():
        return None
    arch = gpu_arch()
    p = cache_dir() / f"{name}-sm{arch}-{source_hash(name, kdir, nvcc, arch)}.so"
    return p if p.is_file() else None


def load(name: str) -> Built:
    """Load (building first if needed) kernels/<name>.cu; CudaUnavailable if impossible.
    A failure is remembered: later calls fail fast with the same reason."""
    with _lock:
        if name in _built:
            return _built[name]
        if name in _errors:
            raise CudaUnavailable(_errors[name])
        try:
            b = _load_locked(name)
        except CudaUnavailable as exc:
            _errors[name] = str(exc)
            raise
        _built[name] = b
        return b


def _load_locked(name: str) -> Built:
    import torch

    if disabled():
        raise CudaUnavailable("disabled by KVTOOL_CUDA=0")
    if not torch.cuda.is_available():
        raise CudaUnavailable("torch sees no CUDA device" if torch.version.cuda else "torch is a CPU-only build")
    kdir = kernels_dir()
    if kdir is None or not (kdir / f"{name}.cu").is_file():
        raise CudaUnavailable(f"kernel sources not found (kernels/{name}.cu; set KVTOOL_KERNELS_DIR)")
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaUnavailable("nvcc not found (set CUDA_HOME or KVTOOL_NVCC)")
    arch = gpu_arch()
    out_dir = cache_dir()
    path = out_dir / f"{name}-sm{arch}-{source_hash(name, kdir, nvcc, arch)}.so"
    fresh = False
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = compile_cmd(nvcc, kdir / f"{name}.cu", Path(tmp), arch, kdir)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            os.unlink(tmp)
            raise CudaUnavailable(f"nvcc failed to run: {exc}") from None
        if r.returncode != 0:
            os.unlink(tmp)
            msg = (r.stderr or r.stdout).strip().splitlines()
            first = next((ln for ln in msg if "error" in ln), msg[0] if msg else "?")
            raise CudaUnavailable(f"nvcc failed on {name}.cu: {first}")
        os.replace(tmp, path)  # atomic: concurrent builders race harmlessly
        fresh = True
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise CudaUnavailable(f"cannot load {path.name}: {exc}") from None
    return Built(name, path, lib, arch, fresh)


def usable_or_notice(wrapper, what: str, fallback: str):
    """`wrapper` (a module whose `library()` loads its kernel, building it on first use) when
    the kernel can run here; None after one notice saying what runs instead (none when the user
    turned the kernels off with KVTOOL_CUDA=0)."""
    if disabled():
        return None
    try:
        wrapper.library()
    except CudaUnavailable as exc:
        notice(f"CUDA {what} unavailable ({exc}); using {fallback}", key=what)
        return None
    return wrapper


def load_error(name: str) -> str | None:
    return _errors.get(name)


def reset_for_tests() -> None:
    with _lock:
        _built.clear()
        _errors.clear()


def backend_status(build: bool = False) -> str:
    """One line for `kvtool info --devices`: which CUDA backend kvtool uses. With
    build=False this never compiles (it reports a cached build, or that the
    kernels will be built on first use)."""
    import torch

    if disabled():
        return "CUDA kernels disabled (KVTOOL_CUDA=0): CPU/torch paths"
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if not torch.version.cuda else "no CUDA device visible"
        return f"no CUDA ({why}): CPU paths only"
    if build:
        for name in KERNELS:
            try:
                load(name)
            except CudaUnavailable:
                pass
    parts = []
    for name in KERNELS:
        if name in _built:
            parts.append(f"{name} loaded")
        elif load_error(name):
            parts.append(f"{name} FAILED ({load_error(name)}; CPU fallback)")
        elif cached_path(name) is not None:
            parts.append(f"{name} built")
        elif find_nvcc() is None:
            parts.append(f"{name} unavailable (no nvcc; CPU fallback)")
        else:
            parts.append(f"{name} not built yet (nvcc builds it on first use)")
    return f"{torch.cuda.get_device_name(0)} (sm_{gpu_arch()}): " + ", ".join(parts)
