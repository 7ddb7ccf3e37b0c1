"""GPU power-limit control shared by ``PowerLimitOptimizer`` and the sweep: which card, permission, set,
restore what was there, and a crash marker for what no process can catch.

- Which card: :func:`open_gpu` finds this process's CUDA device through the one CUDA -> NVML (UUID)
  mapping the energy sensors use (:func:`lightning_energy.measure.sensors.nvml.nvml_index_of_cuda_device`) and
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
- One controller per card: :meth:`LimitController.take` looks for the card's marker first. A marker
  whose process is gone is honoured: the card is put back to the settings it records, which become
  this controller's "what was there" (one logged warning line), so a killed run's profiled limit never
  becomes the setting to restore. A marker whose process still runs (another process, or another
  controller in this one, controls the card) makes ``take`` refuse with :class:`CardInUseError`, the
  card untouched. The check and the write happen under an exclusive lock on a ``.lock`` file beside
  the marker, so two processes starting at once cannot both take the card or overwrite each other's
  marker; the marker itself is written to a temporary file and renamed.

AMD GPUs (a ROCm build of torch, ``torch.version.hip``): :func:`open_gpu` finds the card through the
amdsmi mapping the AMD sensor uses and drives it through
:class:`lightning_energy.optimize.power_limit.amd_control.AmdSmiCard` (the same interface, mW); the marker
then says ``"vendor": "amd"`` and holds the amdsmi index (``amd-smi -g``) in ``nvml_index``, and
``restore-power-limit`` opens it through amdsmi. AMD cards have no persistence mode: none is recorded or set.

Every hint names the card as ``nvidia-smi -i <NVML index>`` (the index ``nvidia-smi`` shows), or on AMD
``amd-smi set -g <amdsmi index> -o <W>``.
Units: NVML's milliwatts in the marker and at the GPU object, watts in messages.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_energy.extras import check_installed
from lightning_energy.io import atomic_write_json
from lightning_energy.measure.zeus_codecarbon_internals import quiet_zeusd_gpu
from lightning_energy.units import MW_PER_W

MARKER_FORMAT = "lightning-energy power-limit marker 1"
STATE_DIR_ENV = "LIGHTNING_ENERGY_STATE_DIR"
MARKER_MAX_BYTES = 64 * 1024
ZEUS_FEATURE = "setting GPU power limits (Zeus's device layer)"  # what needs the zeus extra here
PERMISSION_FIXES = (
    "Fixes: (1) run the Zeus daemon (zeusd) and export ZEUSD_SOCK_PATH=<its socket>, "
    "see https://ml.energy/zeus/getting_started/#system-privileges; (2) give the process the SYS_ADMIN "
    "capability, e.g. `docker run --cap-add SYS_ADMIN ...` (or run as root)."
)


log = logging.getLogger(__name__)


class GpuControlError(RuntimeError):
    """A card that cannot be found, opened or controlled; the message says which and how to fix it."""


class CardInUseError(GpuControlError):
    """The card's crash marker belongs to a process that still runs (or cannot be judged): another
    controller has the card, and taking it too would make the two overwrite each other's limits."""


# ------------------------------------------------------------------------------------------- which card
def open_gpu(cuda_index: int):
    """Zeus's ``GPU`` object for this process's CUDA device ``cuda_index`` (``gpu_index`` is its NVML index); on
    ROCm an :class:`~lightning_energy.optimize.power_limit.amd_control.AmdSmiCard` (``gpu_index``: amdsmi's)."""
    from lightning_energy.measure.sensors.amdsmi import amd_gpu_of_torch_device, rocm_in_use
    from lightning_energy.measure.sensors.detect import GPU_UNREADABLE, nvml_index_of_cuda_device

    if rocm_in_use():
        try:
            amd_index = amd_gpu_of_torch_device(cuda_index).amdsmi_index
        except GPU_UNREADABLE as err:
            raise GpuControlError(f"cannot tell which AMD GPU device {cuda_index} is ({type(err).__name__}: {err})") from err
        return open_amd_gpu(amd_index, f"torch device cuda:{cuda_index}")
    try:
        nvml_index = nvml_index_of_cuda_device(cuda_index)
    except GPU_UNREADABLE as err:
        raise GpuControlError(f"cannot tell which GPU CUDA device {cuda_index} is ({type(err).__name__}: {err})") from err
    return open_nvml_gpu(nvml_index, f"CUDA device {cuda_index}")


def open_nvml_gpu(nvml_index: int, what: str | None = None):
    """Zeus's ``GPU`` object for NVML GPU ``nvml_index`` (``ZeusdNVIDIAGPU`` with ``ZEUSD_SOCK_PATH``)."""
    label = f"NVML GPU {nvml_index}" + (f" ({what})" if what else "")
    check_installed("zeus", ZEUS_FEATURE)
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


def open_amd_gpu(amdsmi_index: int, what: str | None = None, amdsmi_module=None):
    """The card object for AMD GPU ``amdsmi_index`` (the index ``amd-smi -g`` takes)."""
    from lightning_energy.measure.sensors.amdsmi import AMD_GPU_UNREADABLE
    from lightning_energy.optimize.power_limit.amd_control import AmdSmiCard

    label = f"AMD GPU {amdsmi_index}" + (f" ({what})" if what else "")
    try:
        return AmdSmiCard(amdsmi_index, amdsmi_module)
    except AMD_GPU_UNREADABLE as err:
        raise GpuControlError(f"amdsmi cannot open {label} ({type(err).__name__}: {err})") from err


def card_vendor(gpu) -> str:
    """``"amd"`` for an amdsmi card, else ``"nvidia"`` (NVML, Zeus and the simulator)."""
    return getattr(gpu, "vendor", "nvidia")


def permission_errors() -> tuple[type[BaseException], ...]:
    """The errors a card raises when this process may not set its limit (Zeus's, and amdsmi's NO_PERM)."""
    from lightning_energy.measure.sensors.amdsmi import AmdSmiNoPermissionError

    errors: tuple[type[BaseException], ...] = (AmdSmiNoPermissionError,)
    with contextlib.suppress(ImportError), contextlib.redirect_stdout(io.StringIO()):
        from zeus.device.gpu import ZeusGPUNoPermissionError

        errors += (ZeusGPUNoPermissionError,)
    return errors


def rank_gpu(device, caller: str = "PowerLimitOptimizer"):
    """Zeus's ``GPU`` object of the CUDA ``device`` (a ``torch.device``: the one a rank trains on), through the
    energy sensors' CUDA -> NVML mapping (``gpu_index`` of the result is the NVML index, the one ``nvidia-smi -i``
    takes). ``caller`` names the component in the ``RuntimeError`` raised for a device that is no NVIDIA GPU or a
    card that cannot be opened."""
    if device.type != "cuda":
        raise RuntimeError(
            f"{caller} needs a GPU's power limits (NVIDIA, or AMD on ROCm), but this rank trains on {device}. Train on a GPU, "
            "or pass gpu=lightning_energy.simulate.gpu_sim.SimulatedGPU(...) to run against the simulator."
        )
    try:
        return open_gpu(device.index)
    except GpuControlError as err:
        raise RuntimeError(f"{caller}: {err}") from err


def visible_gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvml_index(gpu) -> int | str:
    """The index ``nvidia-smi -i`` takes for this card (``<index>`` when the object has none)."""
    return getattr(gpu, "gpu_index", "<index>")


def is_simulated(gpu) -> bool:
    """Whether ``gpu`` is :class:`lightning_energy.simulate.gpu_sim.SimulatedGPU`. Product code never imports the
    simulator: where its module was never imported, no simulated card exists."""
    simulator = sys.modules.get("lightning_energy.simulate.gpu_sim")
    return simulator is not None and isinstance(gpu, simulator.SimulatedGPU)


def gpu_uuid(gpu) -> str | None:
    """NVML's (amdsmi's) UUID of a real card (None for a simulated one, or where NVML does not say)."""
    if callable(getattr(gpu, "card_uuid", None)):
        return gpu.card_uuid()
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
    if callable(getattr(gpu, "permission_problem", None)):  # an AMD card says itself
        return gpu.permission_problem()
    check_installed("zeus", ZEUS_FEATURE)
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


def smi_hint(index, limit_mW: int | None = None, persistence: bool | None = None, vendor: str = "nvidia") -> str:
    """The ``nvidia-smi`` (``amd-smi`` for ``vendor="amd"``) commands that set a card by hand."""
    if vendor == "amd":  # no persistence mode on AMD
        if limit_mW is None:
            return f"amd-smi metric -g {index} --power"
        return f"amd-smi set -g {index} -o {limit_mW / MW_PER_W:g}"
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
    """The card's marker file: named by its UUID (by its NVML index where NVML gives no UUID)."""
    name = uuid if uuid else f"index{index}"
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(name))
    return directory / f"power-limit-{safe}.json"


@contextlib.contextmanager
def marker_lock(path: Path):
    """Hold an exclusive lock on ``<marker>.lock`` (blocking): the look-at-the-marker-then-write (or
    remove) steps of :meth:`LimitController.take` and :func:`restore_from_marker` happen under it, so two
    processes never both act on what they read. The lock file stays (removing it would race a waiter);
    without ``fcntl`` (not POSIX) nothing is locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - power-limit control runs on Linux
        yield
        return
    with open(path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# marker path -> the live controller of this process holding it. A marker with this process's pid whose
# controller is gone (its restore failed, then it was dropped) is an orphan, honoured like a dead run's.
_HELD_MARKERS: "weakref.WeakValueDictionary[Path, LimitController]" = weakref.WeakValueDictionary()
_HELD_LOCK = threading.RLock()  # re-entrant: restore() may run in a signal handler on this thread


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
    vendor: str = "nvidia"  # "amd": nvml_index holds the amdsmi index (amd-smi -g)

    @property
    def settings(self) -> "Settings":
        """The settings it says to put back."""
        return Settings(self.limit_mW, self.persistence_mode)

    def same_as(self, other: "Marker") -> bool:
        """Whether ``other`` is this marker read again (same writer, same time), not a newer one."""
        return (self.pid, self.host, self.created, self.owner) == (other.pid, other.host, other.created, other.owner)

    @property
    def process_alive(self) -> bool:
        """Whether the process that wrote it still runs (on this host; False for another host's marker)."""
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
    vendor = raw.get("vendor", "nvidia")  # markers written before AMD support name no vendor
    if vendor not in ("nvidia", "amd"):
        raise ValueError(f"{path}: `vendor` must be \"nvidia\" or \"amd\", got {vendor!r}")
    return Marker(path, raw["nvml_index"], uuid, raw["gpu_name"], raw["limit_mW"], persistence, raw["pid"],
                  raw["host"], raw["owner"], float(created) if isinstance(created, (int, float)) else 0.0, vendor)


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

    :meth:`take` looks for the card's crash marker (real cards), records the settings to put back,
    writes its own marker and turns persistence mode on (as Zeus does before changing limits: without
    it the driver may unload between processes and drop the limit); :meth:`set_limit` sets a limit;
    :meth:`restore` puts the recorded limit and persistence mode back and removes the marker, and is
    safe to call twice.

    What :meth:`take` records as "what was there":

    - no marker: the limit and persistence mode in force;
    - a marker whose process is gone (SIGKILL, OOM kill, power loss): the settings the marker records,
      which the card is put back to at once (a warning line says so); the card's present limit is the
      dead run's, not an administrator's;
    - a marker whose process still runs, or one that cannot be read: :class:`CardInUseError`, the card
      untouched (a second controller would overwrite the first one's limits and marker).

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
        self._written: Marker | None = None  # the marker as written, to remove only our own
        self._lock = threading.Lock()

    @property
    def index(self):
        return nvml_index(self.gpu)

    @property
    def vendor(self) -> str:
        return card_vendor(self.gpu)

    def take(self) -> Settings:
        """Record what was there (see the class docstring), write the marker, turn persistence mode on.

        Raises :class:`CardInUseError` (nothing changed) where another live controller has the card,
        :class:`GpuControlError` where the marker cannot be written, and the card's permission error
        (``ZeusGPUNoPermissionError``) untouched where a setting cannot be changed."""
        if self.before is not None:
            return self.before
        if is_simulated(self.gpu):
            before = self._settings_in_force()
            persistence_now = before.persistence_mode
        else:
            before, persistence_now = self._take_marked_card()
        self.before = before
        if persistence_now is False:
            self.gpu.set_persistence_mode(True)
        return before

    def _settings_in_force(self) -> Settings:
        try:
            persistence = bool(self.gpu.get_persistence_mode())
        except Exception:  # not every GPU object can tell; then it is left alone
            persistence = None
        return Settings(int(self.gpu.get_power_management_limit()), persistence)

    def _take_marked_card(self) -> tuple[Settings, bool | None]:
        """Under the marker's lock: honour or refuse an existing marker, then write ours. Returns the
        settings to put back and the persistence mode in force now."""
        directory = self.marker_dir if self.marker_dir is not None else state_dir()
        uuid = gpu_uuid(self.gpu)
        path = marker_path(directory, self.index, uuid)
        with contextlib.ExitStack() as locked:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                locked.enter_context(marker_lock(path))
            except OSError as err:
                raise GpuControlError(f"{self.owner}: cannot lock the crash marker {path} ({err}); set "
                                      f"{STATE_DIR_ENV} to a writable directory") from err
            in_force = self._settings_in_force()
            left = self._marker_left_behind(path, uuid)
            before = in_force if left is None else left.settings
            if left is not None and in_force.limit_mW != left.limit_mW:
                self.gpu.set_power_management_limit(left.limit_mW)  # the administrator's limit back first
            if left is not None:
                log.warning(self._adopted_message(left, in_force))
            self._write_marker(path, uuid, before)
        return before, in_force.persistence_mode

    def _marker_left_behind(self, path: Path, uuid: str | None) -> Marker | None:
        """The card's marker of a run that is gone (None without one); raises :class:`CardInUseError`
        where its process still runs, it is another host's, or it cannot be read."""
        if not path.exists():
            return None
        try:
            marker = read_marker(path)
        except ValueError as err:
            raise CardInUseError(f"{self.owner}: GPU {self.index} has a crash marker that cannot be read ({err}); "
                                 f"nothing was changed. Check the card ({smi_hint(self.index, vendor=self.vendor)}), set what it "
                                 f"should run at, then delete {path}") from None
        holder = f"{marker.owner} (pid {marker.pid} on {marker.host}, marker {path})"
        if marker.host != socket.gethostname() and not (uuid and marker.uuid == uuid):
            raise CardInUseError(f"{self.owner}: GPU {self.index} has a crash marker of another host: {holder}; "
                                 f"nothing was changed. Run `lightning-energy restore-power-limit` on {marker.host}")
        with _HELD_LOCK:
            held_here = path in _HELD_MARKERS
        orphan_of_this_process = marker.pid == os.getpid() and marker.host == socket.gethostname() and not held_here
        if held_here or (marker.process_alive and not orphan_of_this_process):
            raise CardInUseError(
                f"{self.owner}: GPU {self.index} is already under power-limit control by {holder}; nothing was "
                f"changed (two controllers would overwrite each other's limits). Wait for that run to end; if it "
                f"is not one of ours (a reused pid), `lightning-energy restore-power-limit --force` puts the "
                f"card back and removes the marker")
        return marker

    def _adopted_message(self, left: Marker, in_force: Settings) -> str:
        persistence = "" if left.persistence_mode is None else f", persistence mode {'on' if left.persistence_mode else 'off'}"
        return (f"{self.owner}: GPU {self.index} was left at {in_force.limit_mW / MW_PER_W:g} W by {left.owner} "
                f"(pid {left.pid} on {left.host}, no longer running); put back to {left.limit_mW / MW_PER_W:g} W"
                f"{persistence}, the setting its crash marker recorded, which this run restores at its end")

    def _write_marker(self, path: Path, uuid: str | None, before: Settings) -> None:
        document = {
            "format": MARKER_FORMAT, "nvml_index": int(self.index) if isinstance(self.index, int) else -1,
            "uuid": uuid, "gpu_name": str(self.gpu.get_name()), "limit_mW": before.limit_mW,
            "persistence_mode": before.persistence_mode, "pid": os.getpid(), "host": socket.gethostname(),
            "owner": self.owner, "created": time.time(), "vendor": self.vendor,
            "restore": f"lightning-energy restore-power-limit (or: "
                       f"{smi_hint(self.index, before.limit_mW, before.persistence_mode, self.vendor)})",
        }
        try:
            atomic_write_json(path, document)
            written = read_marker(path)  # validate what is written
        except (OSError, ValueError) as err:
            raise GpuControlError(f"{self.owner}: cannot write the crash marker {path} ({err}); set "
                                  f"{STATE_DIR_ENV} to a writable directory") from err
        with _HELD_LOCK:
            _HELD_MARKERS[path] = self
        self.marker, self._written = path, written

    def set_limit(self, limit_W: int) -> None:
        self.gpu.set_power_management_limit(int(limit_W) * MW_PER_W)

    def restore(self) -> list[str]:
        """Put back the recorded limit and persistence mode; the problems (one line each, with the
        ``nvidia-smi -i`` command that fixes it), empty when all went back (the marker is then removed,
        unless another process has replaced it since)."""
        with self._lock:
            before = self.before
            if before is None:
                return []
            problems = put_back(self.gpu, before)
            if not problems:
                self.before = None
                self._remove_marker()
            return problems

    def _remove_marker(self) -> None:
        """Remove our marker if the file still is ours (``restore-power-limit --force`` may have removed it
        and another run written its own since). No lock: this may run in a signal handler."""
        path, written = self.marker, self._written
        self.marker = self._written = None
        if path is None:
            return
        with _HELD_LOCK:
            _HELD_MARKERS.pop(path, None)
        try:
            still_ours = written is not None and read_marker(path).same_as(written)
        except ValueError:  # gone, or not ours to judge
            still_ours = False
        if still_ours:
            path.unlink(missing_ok=True)


def put_back(gpu, settings: Settings) -> list[str]:
    """Set ``gpu`` to ``settings`` (limit, and persistence mode where known); the problems, one line each
    with the ``nvidia-smi -i`` command that fixes it."""
    index, vendor = nvml_index(gpu), card_vendor(gpu)
    problems = []
    try:
        if int(gpu.get_power_management_limit()) != settings.limit_mW:
            gpu.set_power_management_limit(settings.limit_mW)
    except Exception as err:
        problems.append(f"could not restore the power limit of GPU {index} to {settings.limit_mW / MW_PER_W:g} W "
                        f"({type(err).__name__}: {err}); set it by hand: {smi_hint(index, settings.limit_mW, vendor=vendor)}")
    if settings.persistence_mode is not None:
        try:
            if bool(gpu.get_persistence_mode()) != settings.persistence_mode:
                gpu.set_persistence_mode(settings.persistence_mode)
        except Exception as err:
            problems.append(f"could not restore persistence mode {'on' if settings.persistence_mode else 'off'} of "
                            f"GPU {index} ({type(err).__name__}: {err}); set it by hand: "
                            f"{smi_hint(index, persistence=settings.persistence_mode)}")
    return problems


def restore_from_marker(marker: Marker, opener: Callable[[int], Any] | None = None) -> list[str]:
    """Put the card of a marker back (limit, persistence mode); the problems, empty on success (the
    marker is then removed). ``opener``: opens the card by the marker's index (default: NVML's, amdsmi's for
    an AMD marker). The card's UUID must be the marker's where both are known (indices can change).
    Done under the marker's lock, and only if the file still holds the marker read (a run that took the
    card since has written its own: that one is left alone, and so is the card)."""
    with contextlib.ExitStack() as locked:
        try:
            locked.enter_context(marker_lock(marker.path))
        except OSError as err:
            return [f"{marker.path.name}: cannot lock it ({err})"]
        try:
            current = read_marker(marker.path)
        except ValueError:
            current = None
        if current is None or not current.same_as(marker):
            return []  # removed or replaced meanwhile: nothing of this marker is left to do
        amd = marker.vendor == "amd"
        if opener is None:
            opener = open_amd_gpu if amd else open_nvml_gpu
        try:
            gpu = opener(marker.nvml_index)
        except Exception as err:
            return [f"{marker.path.name}: cannot open {'AMD' if amd else 'NVML'} GPU {marker.nvml_index} ({err}); "
                    f"set it by hand: {smi_hint(marker.nvml_index, marker.limit_mW, marker.persistence_mode, marker.vendor)}"]
        try:
            uuid = gpu_uuid(gpu)
            if marker.uuid and uuid and uuid != marker.uuid:
                if amd:
                    return [f"{marker.path.name}: AMD GPU {marker.nvml_index} is {uuid}, not {marker.uuid} (indices "
                            f"changed); find the card with `amd-smi list` and set it by hand: amd-smi set -g <index> "
                            f"-o {marker.limit_mW / MW_PER_W:g}"]
                return [f"{marker.path.name}: NVML GPU {marker.nvml_index} is {uuid}, not {marker.uuid} (indices changed); "
                        f"find the card with `nvidia-smi -L` and set it by hand: nvidia-smi -i <index> -pl "
                        f"{marker.limit_mW / MW_PER_W:g}"]
            problems = put_back(gpu, marker.settings)
        finally:
            if callable(getattr(gpu, "close", None)):  # an AMD card gives its share of amdsmi back
                gpu.close()
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
