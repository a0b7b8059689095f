"""What a kernel choice holds for: the machine it was measured on.

A choice of kernels is only as good as the machine, the libraries and the thread settings it was
measured under (``verifier/tuning.py``), so the kernel-plan cache (``verifier/plan_cache.py``) keys
it by this fingerprint, and the native kernels are offered only on the CPU they were built for.
"""

from __future__ import annotations

import functools
import os
import platform

import numpy as np
import torch
from threadpoolctl import ThreadpoolController


@functools.lru_cache(maxsize=None)
def cpu_identity() -> str:
    """The CPU model and its vector flags, as one string."""
    fp = fingerprint()
    return f"{fp['cpu']} {' '.join(fp['flags'])}"


def fingerprint() -> dict:
    """The CPU (model, vector flags), torch's build and dispatch level, numpy and its BLAS."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model == (platform.processor() or platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(f for f in have if f.startswith(("avx", "amx", "fma", "f16c")))
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": flags,
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "numpy": np.__version__,
        "blas": [f"{lib.internal_api} {lib.version} {getattr(lib, 'architecture', '')}" for lib in numpy_blas()],
    }


def numpy_blas() -> list:
    """threadpoolctl's controllers of the BLAS library numpy itself loaded (OpenBLAS in numpy's
    wheels), not of any other BLAS in the process (torch's own, where a build links one)."""
    # numpy's wheels keep it in numpy.libs/ or numpy/.dylibs/. Real paths: through a symlinked
    # environment numpy's module path and the loaded library's path name different directories.
    home = os.path.realpath(os.path.dirname(np.__file__))
    return [
        lib
        for lib in ThreadpoolController().lib_controllers
        if lib.user_api == "blas" and os.path.realpath(lib.filepath).startswith(home)
    ]


def single_thread_blas() -> None:
    """numpy's BLAS runs on the calling thread alone, whatever torch's thread count: its own thread
    pool beside torch's OpenMP one makes the two spin against each other for the cores (measured on
    2 cores: a one-token step went from 57 to 269 ms). So its candidates are timed, and run, as
    one-thread GEMMs, and win only where one thread of OpenBLAS beats all of torch's."""
    for lib in numpy_blas():
        lib.set_num_threads(1)
