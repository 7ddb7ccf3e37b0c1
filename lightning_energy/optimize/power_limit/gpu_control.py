"""GPU power-limit control shared by ``PowerLimitOptimizer`` and the sweep: which card, permission, set,
restore what was there, and a crash marker for what no process can catch.

- Which card: :func:`open_gpu` finds this process's CUDA device through the one CUDA -> NVML (UUID)
  mapping the energy sensors use (:func:`lightning_energy.measure.sensors.detect.nvml_index_of_cuda_device`) and
  opens it through Zeus's device layer (``NVIDIAGPU``, or ``ZeusdNVIDIAGPU`` when the Zeus daemon is
  configured). Zeus's own ``get_gpus()`` reads ``CUDA_VISIBLE_DEVICES`` as integers and ignores
  ``CUDA_DEVICE_ORDER``, so it can control another card than the one measured: it is not used.
- Restore what was there: :class:`LimitController` records the limit and the persistence mode in force
  before it changes anything (an administrator's setting, not NVML's default) and puts both back.
- Crash marker: before the first change it writes a JSON marker (card, NVML index, UUID, the settings
  to restore, pid) into :func:`state_dir`; a clean restore removes it. After SIGKILL or a power loss the
  marker stays, and ``lightning-energy restore-power-limit`` puts the card back (power loss resets
  limits on the next driver load, but not persistence mode set by a service; the command then finds
  the card already at its limit and only removes the marker).

Every hint names the card as ``nvidia-smi -i <NVML index>`` (the index ``nvidia-smi`` shows).
Units: NVML's milliwatts in the marker and at the GPU object, watts in messages.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_energy.io import atomic_write_json
from lightning_energy.measure.zeus_codecarbon_internals import quiet_zeusd_gpu
from lightning_energy.units import MW_PER_W

MARKER_FORMAT = "lightning-energy power-limit marker 1"
STATE_DIR_ENV = "LIGHTNING_ENERGY_STATE_DIR"
MARKER_MAX_BYTES = 64 * 1024
PERMISSION_FIXES = (
    "Fixes: (1) run the Zeus daemon (zeusd) and export ZEUSD_SOCK_PATH=<its socket>, "
    "see https://ml.energy/zeus/getting_started/#system-privileges; (2) give the process the SYS_ADMIN "
    "capability, e.g. `docker run --cap-add SYS_ADMIN ...` (or run as root)."
)


class GpuControlError(RuntimeError):
    """A card that cannot be found, opened or controlled; the message says which and how to fix it."""


# ------------------------------------------------------------------------------------------- which card
def open_gpu(cuda_index: int):
    """Zeus's ``GPU`` object for this process's CUDA device ``cuda_index`` (``gpu_index`` is its NVML index)."""
    from lightning_energy.measure.sensors.detect import GPU_UNREADABLE, nvml_index_of_cuda_device

    try:
        nvml_index = nvml_index_of_cuda_device(cuda_index)
    except GPU_UNREADABLE as err:
        raise GpuControlError(f"cannot tell which GPU CUDA device {cuda_index} is ({type(err).__name__}: {err})") from err
    return open_nvml_gpu(nvml_index, f"CUDA device {cuda_index}")


def open_nvml_gpu(nvml_index: int, what: str | None = None):
    """Zeus's ``GPU`` object for NVML GPU ``nvml_index`` (``ZeusdNVIDIAGPU`` with ``ZEUSD_SOCK_PATH``)."""
    label = f"NVML GPU {nvml_index}" + (f" ({what})" if what else "")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # zeus pulls amdsmi, which prints without ROCm
            import pynvml
            from zeus.device.gpu.nvidia import NVIDIAGPU, ZeusdNVIDIAGPU
            from zeus.utils.zeusd import ZeusdClient, ZeusdConfig

            pynvml.nvmlInit()  # held for the GPU object's life, as zeus.device.get_gpus() does
            config = ZeusdConfig.from_env()
            if config is None:
                return NVIDIAGPU(nvml_index)
            gpu = ZeusdNVIDIAGPU(nvml_index, ZeusdClient(config))
            quiet_zeusd_gpu(gpu)  # as get_gpus() does
            return gpu
    except Exception as err:
        raise GpuControlError(f"Zeus cannot open {label} ({type(err).__name__}: {err})") from err


def visible_gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvml_index(gpu) -> int | str:
    """The index ``nvidia-smi -i`` takes for this card (``<index>`` when the object has none)."""
    return getattr(gpu, "gpu_index", "<index>")


def is_simulated(gpu) -> bool:
    """Whether ``gpu`` is :class:`lightning_energy.testing.gpu_sim.SimulatedGPU`. Product code never imports the
    simulator: where its module was never imported, no simulated card exists."""
    simulator = sys.modules.get("lightning_energy.testing.gpu_sim")
    return simulator is not None and isinstance(gpu, simulator.SimulatedGPU)


def gpu_uuid(gpu) -> str | None:
    """NVML's UUID of a real card (None for a simulated one, or where NVML does not say)."""
    handle = getattr(gpu, "handle", None)
    if handle is None:
        return None
    try:
        import pynvml

        value = pynvml.nvmlDeviceGetUUID(handle)
    except Exception:  # an optional detail of the marker
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def permission_problem(gpu) -> str | None:
    """Why this process cannot set the card's limit, or None when it can (read-only check)."""
    flag = getattr(gpu, "can_set_limits", None)
    if flag is not None:
        return None if flag else "the simulated GPU was created with can_set_limits=False"
    with contextlib.redirect_stdout(io.StringIO()):
        from zeus.device.common import has_sys_admin
        from zeus.device.gpu.nvidia import ZeusdNVIDIAGPU
    if isinstance(gpu, ZeusdNVIDIAGPU) or has_sys_admin():
        return None
    return "this process has no SYS_ADMIN capability and no Zeus daemon is configured (ZEUSD_SOCK_PATH is unset)"


def default_limit_mW(gpu) -> int | None:
    """The card's default limit (mW): NVML's default-limit query (read-only), or the simulator's."""
    getter = getattr(gpu, "get_default_power_management_limit", None)
    if getter is not None:
        return int(getter())
    handle = getattr(gpu, "handle", None)
    if handle is None:
        return None
    import pynvml

    return int(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))


def smi_hint(index, limit_mW: int | None = None, persistence: bool | None = None) -> str:
    """The ``nvidia-smi`` commands that set a card by hand."""
    parts = []
    if limit_mW is not None:
        parts.append(f"nvidia-smi -i {index} -pl {limit_mW / MW_PER_W:g}")
    if persistence is not None:
        parts.append(f"nvidia-smi -i {index} -pm {1 if persistence else 0}")
    return " && ".join(parts) or f"nvidia-smi -i {index} -q -d POWER"


# ------------------------------------------------------------------------------------------- crash marker
def state_dir() -> Path:
    """Where crash markers live: ``$LIGHTNING_ENERGY_STATE_DIR``, else ``$XDG_STATE_HOME/lightning-energy``
    (``~/.local/state/lightning-energy``)."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "lightning-energy"


def marker_path(directory: Path, index, uuid: str | None) -> Path:
    name = uuid if uuid else f"index{index}"
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(name))
    return directory / f"power-limit-{safe}.json"


@dataclass(frozen=True)
class Marker:
    """A crash marker: the card and the settings to put back."""

    path: Path
    nvml_index: int
    uuid: str | None
    gpu_name: str
    limit_mW: int
    persistence_mode: bool | None
    pid: int
    host: str
    owner: str
    created: float

    @property
    def process_alive(self) -> bool:
        """Whether the process that wrote it still runs (on this host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # it exists, under another user
            return True
        return True


def read_marker(path: Path) -> Marker:
    """A marker file, checked (ValueError names the problem)."""
    try:
        if path.stat().st_size > MARKER_MAX_BYTES:
            raise ValueError(f"{path} is larger than {MARKER_MAX_BYTES} bytes: not a marker")
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} cannot be read as a power-limit marker: {err}") from None
    if not isinstance(raw, dict) or raw.get("format") != MARKER_FORMAT:
        raise ValueError(f"{path} is not a power-limit marker (format {raw.get('format') if isinstance(raw, dict) else None!r})")
    checks = {"nvml_index": int, "limit_mW": int, "pid": int, "gpu_name": str, "host": str, "owner": str}
    for key, kind in checks.items():
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{path}: `{key}` must be {kind.__name__}, got {value!r}")
    if raw["nvml_index"] < 0 or raw["limit_mW"] <= 0:
        raise ValueError(f"{path}: nvml_index must be >= 0 and limit_mW > 0")
    persistence = raw.get("persistence_mode")
    if persistence is not None and not isinstance(persistence, bool):
        raise ValueError(f"{path}: `persistence_mode` must be true, false or null")
    uuid = raw.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise ValueError(f"{path}: `uuid` must be a string or null")
    created = raw.get("created", 0.0)
    return Marker(path, raw["nvml_index"], uuid, raw["gpu_name"], raw["limit_mW"], persistence, raw["pid"],
                  raw["host"], raw["owner"], float(created) if isinstance(created, (int, float)) else 0.0)


def list_markers(directory: Path | None = None) -> list[Path]:
    directory = state_dir() if directory is None else Path(directory)
    return sorted(directory.glob("power-limit-*.json")) if directory.is_dir() else []


# ------------------------------------------------------------------------------------------- the controller
@dataclass(frozen=True)
class Settings:
    """What was in force on a card: its limit (mW) and persistence mode (None where it cannot be read)."""

    limit_mW: int
    persistence_mode: bool | None


class LimitController:
    """One card under our control: what was there, the limits we set, putting it back.

    :meth:`take` records the limit and persistence mode in force, writes the crash marker (real cards)
    and turns persistence mode on (as Zeus does before changing limits: without it the driver may unload
    between processes and drop the limit); :meth:`set_limit` sets a limit; :meth:`restore` puts the
    recorded limit and persistence mode back and removes the marker, and is safe to call twice.

    Args:
        gpu: a Zeus ``GPU`` object (``NVIDIAGPU``, ``ZeusdNVIDIAGPU``, ``SimulatedGPU``).
        owner: who controls it (named in the marker and in messages).
        marker_dir: where the crash marker goes (default :func:`state_dir`); markers are written for
            real cards only (a simulated card dies with its process).
    """

    def __init__(self, gpu, owner: str, marker_dir: Path | None = None) -> None:
        self.gpu = gpu
        self.owner = owner
        self.marker_dir = Path(marker_dir) if marker_dir is not None else None
        self.before: Settings | None = None
        self.marker: Path | None = None
        self._lock = threading.Lock()

    @property
    def index(self):
        return nvml_index(self.gpu)

    def take(self) -> Settings:
        """Record what is in force, write the marker, turn persistence mode on. Raises the card's
        permission error (``ZeusGPUNoPermissionError``) untouched where persistence mode cannot be set."""
        if self.before is not None:
            return self.before
        limit_mW = int(self.gpu.get_power_management_limit())
        try:
            persistence = bool(self.gpu.get_persistence_mode())
        except Exception:  # not every GPU object can tell; then it is left alone
            persistence = None
        self.before = Settings(limit_mW, persistence)
        if not is_simulated(self.gpu):
            self._write_marker()
        if persistence is False:
            self.gpu.set_persistence_mode(True)
        return self.before

    def _write_marker(self) -> None:
        directory = self.marker_dir if self.marker_dir is not None else state_dir()
        uuid = gpu_uuid(self.gpu)
        path = marker_path(directory, self.index, uuid)
        document = {
            "format": MARKER_FORMAT, "nvml_index": int(self.index) if isinstance(self.index, int) else -1,
            "uuid": uuid, "gpu_name": str(self.gpu.get_name()), "limit_mW": self.before.limit_mW,
            "persistence_mode": self.before.persistence_mode, "pid": os.getpid(), "host": socket.gethostname(),
            "owner": self.owner, "created": time.time(),
            "restore": f"lightning-energy restore-power-limit (or: "
                       f"{smi_hint(self.index, self.before.limit_mW, self.before.persistence_mode)})",
        }
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, document)
        except OSError as err:
            raise GpuControlError(f"{self.owner}: cannot write the crash marker {path} ({err}); set "
                                  f"{STATE_DIR_ENV} to a writable directory") from err
        self.marker = path

    def set_limit(self, limit_W: int) -> None:
        self.gpu.set_power_management_limit(int(limit_W) * MW_PER_W)

    def restore(self) -> list[str]:
        """Put back the recorded limit and persistence mode; the problems (one line each, with the
        ``nvidia-smi -i`` command that fixes it), empty when all went back (the marker is then removed)."""
        with self._lock:
            before = self.before
            if before is None:
                return []
            problems = []
            try:
                if int(self.gpu.get_power_management_limit()) != before.limit_mW:
                    self.gpu.set_power_management_limit(before.limit_mW)
            except Exception as err:
                problems.append(f"could not restore the power limit of GPU {self.index} to {before.limit_mW / MW_PER_W:g} W "
                                f"({type(err).__name__}: {err}); set it by hand: {smi_hint(self.index, before.limit_mW)}")
            if before.persistence_mode is not None:
                try:
                    if bool(self.gpu.get_persistence_mode()) != before.persistence_mode:
                        self.gpu.set_persistence_mode(before.persistence_mode)
                except Exception as err:
                    problems.append(f"could not restore persistence mode {'on' if before.persistence_mode else 'off'} of "
                                    f"GPU {self.index} ({type(err).__name__}: {err}); set it by hand: "
                                    f"{smi_hint(self.index, persistence=before.persistence_mode)}")
            if not problems:
                self.before = None
                if self.marker is not None:
                    self.marker.unlink(missing_ok=True)
                    self.marker = None
            return problems


def restore_from_marker(marker: Marker, opener: Callable[[int], Any] = open_nvml_gpu) -> list[str]:
    """Put the card of a marker back (limit, persistence mode); the problems, empty on success (the
    marker is then removed). The card is found by UUID where the marker has one (indices can change)."""
    try:
        gpu = opener(marker.nvml_index)
    except Exception as err:
        return [f"{marker.path.name}: cannot open NVML GPU {marker.nvml_index} ({err}); set it by hand: "
                f"{smi_hint(marker.nvml_index, marker.limit_mW, marker.persistence_mode)}"]
    uuid = gpu_uuid(gpu)
    if marker.uuid and uuid and uuid != marker.uuid:
        return [f"{marker.path.name}: NVML GPU {marker.nvml_index} is {uuid}, not {marker.uuid} (indices changed); "
                f"find the card with `nvidia-smi -L` and set it by hand: nvidia-smi -i <index> -pl "
                f"{marker.limit_mW / MW_PER_W:g}"]
    controller = LimitController(gpu, f"restore-power-limit ({marker.owner})")
    controller.before = Settings(marker.limit_mW, marker.persistence_mode)
    problems = controller.restore()
    if not problems:
        marker.path.unlink(missing_ok=True)
    return problems


# ------------------------------------------------------------------------------------------- SIGHUP
class HangupGuard:
    """While installed, SIGHUP first puts the cards back (``restore``), then does what it did before (the
    default: the process ends by SIGHUP). Not installed where SIGHUP is ignored (``nohup``: the run goes
    on) or off the main thread (Python delivers signals there only)."""

    def __init__(self, restore: Callable[[], object]) -> None:
        self._restore = restore
        self._previous = None
        self.installed = False

    def install(self) -> None:
        if self.installed or not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGHUP)
        if previous == signal.SIG_IGN or previous is None:
            return
        self._previous = previous
        signal.signal(signal.SIGHUP, self._on_hangup)
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGHUP) == self._on_hangup:
            signal.signal(signal.SIGHUP, self._previous)

    def _on_hangup(self, signum, frame) -> None:
        self._restore()
        previous = self._previous
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end the way a hang-up ends a process
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGHUP)
