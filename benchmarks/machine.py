"""What every benchmark records about the machine it ran on, and how it writes its JSON.

Machines differ between sessions (AMX-BF16, AVX-512 and the core count change what a CPU benchmark
means), so each result names the CPU model and the vector/matrix features that matter to torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

# /proc/cpuinfo flags that change torch's CPU kernels (bf16/fp16 matmuls, wide vectors)
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_model_and_features() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`CPU_FEATURES` it has (empty off Linux)."""
    model, flags = platform.processor(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == platform.processor():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return model, [f for f in CPU_FEATURES if f in flags]


def machine_info(**extra: Any) -> dict[str, Any]:
    """Python, platform, CPU model, its features and core count, plus ``extra`` (versions, threads)."""
    model, features = cpu_model_and_features()
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_model": model,
            "cpu_features": features, "cpu_count": os.cpu_count(), **extra}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a private temporary file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
