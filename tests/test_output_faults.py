"""Faults outside the sensors never kill a fit: a full disk, a read-only log dir, a failing TensorBoard
writer, a trace that cannot be written, a locked, damaged or full catalog. Each is one line (and one
warning) saying what is missing; no exception reaches training; no half-written file is left. The power
figure is drawn off the training thread."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
import threading
import time
import warnings

import lightning as L
import pytest

import lightning_energy.catalog as catalog_module
import lightning_energy.io as io_module
import lightning_energy.outputs.tensorboard as tensorboard_module
import lightning_energy.outputs.trace as trace_module
from conftest import ROWS, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.catalog import CATALOG_FILE, Catalog, CatalogError
from lightning_energy.measure.sampler import Reading
from lightning_energy.outputs.tensorboard import TensorBoardExtras
from lightning_energy.outputs.trace import TraceWriter, read_trace

WAIT_S = 30.0  # a generous bound for background work in Event waits (never a timing assertion)


def enospc(what: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what or None)


def ours(caught, text: str) -> list:
    return [w for w in caught if "lightning-energy" in str(w.message) and text in str(w.message)]


# ---------------------------------------------------------------- fakes
class FullDiskFile:
    """A text file on a disk that fills after ``limit`` characters: the write past it (``fail_on="write"``)
    or the next flush or close (``fail_on="flush"``, as buffered I/O reports it) raises ENOSPC."""

    def __init__(self, path, limit: int, fail_on: str = "write") -> None:
        self._file = open(path, "w", newline="")
        self.limit, self.fail_on, self.written, self.full = limit, fail_on, 0, False

    def write(self, text: str) -> int:
        room = self.limit - self.written
        if len(text) > room:
            self._file.write(text[:max(room, 0)])  # what fitted is on disk: a truncated row
            self.written = self.limit
            self.full = True
            if self.fail_on == "write":
                raise enospc(self._file.name)
            return len(text)
        self.written += len(text)
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()
        if self.full:
            raise enospc(self._file.name)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        if self.full and self.fail_on == "flush":
            self.full = False
            raise enospc(self._file.name)

    @property
    def closed(self) -> bool:
        return self._file.closed


def full_disk_for(monkeypatch, name_part: str, limit: int, fail_on: str = "write") -> list:
    """Make the trace module's ``open`` hand out a FullDiskFile for files whose name contains ``name_part``."""
    made = []

    def fake_open(path, mode="r", *args, **kwargs):
        if name_part in os.fspath(path) and "w" in mode:
            made.append(FullDiskFile(path, limit, fail_on))
            return made[-1]
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(trace_module, "open", fake_open, raising=False)
    return made


def readings(t: float) -> list[Reading]:
    return [Reading("device", 100.0 * t, 100.0, {"temperature_C": 50.0}), Reading("host", 20.0 * t, 20.0, {})]


class FakeWriter:
    """A SummaryWriter stand-in recording which thread made each call; ``fail`` names a method that raises."""

    def __init__(self, fail: str | None = None, error: Exception | None = None, log_dir: str = "fake") -> None:
        self.fail, self.error, self.log_dir = fail, error or enospc(), log_dir
        self.calls: list[tuple[str, int]] = []
        self.images: list[tuple[str, int]] = []

    def _call(self, name: str) -> None:
        self.calls.append((name, threading.get_ident()))
        if name == self.fail:
            raise self.error

    def add_custom_scalars(self, layout) -> None:
        self._call("add_custom_scalars")

    def add_figure(self, tag, figure, global_step=None, close=True) -> None:
        self._call("add_figure")
        self.images.append((tag, global_step))

    def add_image(self, tag, image, global_step=None, dataformats="CHW") -> None:
        self._call("add_image")
        assert image.ndim == 3 and image.shape[2] == 3 and dataformats == "HWC"
        self.images.append((tag, global_step))

    def flush(self) -> None:
        self._call("flush")


class FakeTrainer:
    logged_metrics = {"train/loss": 0.5, "val/loss": 0.7, "energy/step_J": 1.0}


def power_points(n: int = 20) -> list:
    return [(10.0 + 0.05 * i, {"device": 100.0 + i, "host": 20.0}) for i in range(n)]


def close_extras(extras) -> None:
    close = getattr(extras, "close", None)
    if close is not None:
        close(WAIT_S)


# ---------------------------------------------------------------- the output worker
def test_worker_runs_jobs_elsewhere_and_a_failing_job_is_one_counted_line():
    from lightning_energy.outputs.worker import OutputWorker

    worker = OutputWorker(warn=True)
    threads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert worker.submit(lambda: threads.append(threading.get_ident()), what="note")

        def full(path):
            raise enospc(path)

        for i in range(3):
            worker.submit(full, f"/runs/x{i}.png", what="power figure")
        assert worker.close(WAIT_S)
    assert len(threads) == 3 and threading.get_ident() not in threads
    assert len(worker.problems) == 1
    line = worker.problems[0]
    assert "power figure failed" in line and "No space left" in line and "(3 times)" in line and "\n" not in line
    assert len(ours(caught, "power figure failed")) == 1
    assert not worker.submit(lambda: None, what="late")  # closed: refused, not run, not raised


def test_worker_queue_is_bounded_drops_the_oldest_and_coalesces_by_key():
    from lightning_energy.outputs.worker import OutputWorker

    worker = OutputWorker(max_pending=2, warn=False)
    started, release, ran = threading.Event(), threading.Event(), []

    def blocker():
        started.set()
        release.wait(WAIT_S)

    worker.submit(blocker, what="blocker")
    assert started.wait(WAIT_S)
    for i in range(3):
        worker.submit(ran.append, f"figure {i}", what="power figure", key="figure")  # the newest replaces
    for i in range(3):
        worker.submit(ran.append, f"note {i}", what="note")  # two slots: the oldest waiting job goes
    release.set()
    assert worker.close(WAIT_S)
    assert ran == ["note 1", "note 2"]
    assert worker.dropped == {"power figure": 3, "note": 1}


def test_worker_close_is_bounded_when_a_job_hangs():
    from lightning_energy.outputs.worker import OutputWorker

    worker = OutputWorker(warn=False)
    release = threading.Event()
    try:
        worker.submit(release.wait, WAIT_S, what="hung flush")
        worker.submit(lambda: None, what="power figure")
        assert worker.close(timeout_s=0.05) is False
        assert len(worker.problems) == 1 and "not finished within" in worker.problems[0]
        assert "power figure" in worker.problems[0]
    finally:
        release.set()


# ---------------------------------------------------------------- TensorBoard extras
def test_after_epoch_draws_and_writes_off_the_calling_thread(monkeypatch):
    real_power_figure = tensorboard_module.power_figure
    drawn, drawing_thread = threading.Event(), []

    def recording_power_figure(points, epoch, *provenance):
        drawing_thread.append(threading.get_ident())
        figure = real_power_figure(points, epoch, *provenance)
        drawn.set()
        return figure

    monkeypatch.setattr(tensorboard_module, "power_figure", recording_power_figure)
    writer = FakeWriter()
    extras = TensorBoardExtras([writer])
    extras.after_epoch(FakeTrainer(), 0, power_points())
    assert drawn.wait(WAIT_S)
    close_extras(extras)
    caller = threading.get_ident()
    assert drawing_thread and drawing_thread[0] != caller, "the power figure was drawn on the training thread"
    assert writer.calls and all(ident != caller for _, ident in writer.calls), writer.calls
    assert {name for name, _ in writer.calls} >= {"add_custom_scalars", "flush"}
    assert writer.images == [("power/trace", 0)]


def test_power_figure_is_built_without_pyplot():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    import matplotlib.pyplot as plt

    pyplot_figures_before = plt.get_fignums()
    figure = tensorboard_module.power_figure(power_points(), 3)
    assert isinstance(figure.canvas, FigureCanvasAgg)
    assert plt.get_fignums() == pyplot_figures_before  # not registered with pyplot's global figure manager


def test_tensorboard_writer_whose_flush_raises_is_one_problem_and_other_writers_go_on():
    broken, healthy = FakeWriter(fail="flush", log_dir="/full/disk"), FakeWriter(log_dir="/ok")
    extras = TensorBoardExtras([broken, healthy])
    extras.figure_budget = None  # a figure every epoch, however fast the epochs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            extras.after_epoch(FakeTrainer(), epoch, power_points())  # never raises
            if hasattr(extras, "worker"):
                extras.worker.drain(WAIT_S)
        close_extras(extras)
    writer_problems = [p for p in extras.problems if "/full/disk" in p]
    assert len(writer_problems) == 1, extras.problems
    assert "No space left" in writer_problems[0] and "flushing failed" in writer_problems[0]
    assert "missing" in writer_problems[0]  # says what the output lacks
    assert len(ours(caught, "/full/disk")) == 1
    assert [s for _, s in healthy.images] == [0, 1, 2]
    assert sum(name == "flush" for name, _ in broken.calls) == 1  # left alone after it failed


def test_tensorboard_figure_on_a_full_disk_is_one_problem():
    writer = FakeWriter(fail="add_image", log_dir="/full/disk")
    writer.add_figure = lambda *a, **k: writer._call("add_image")  # whichever way the figure is written
    extras = TensorBoardExtras([writer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            extras.after_epoch(FakeTrainer(), epoch, power_points())
        close_extras(extras)
    assert len([p for p in extras.problems if "/full/disk" in p]) == 1
    assert len(ours(caught, "No space left")) == 1


def test_a_fit_with_tensorboard_drains_the_figures_before_the_writer_closes(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class TenMillisecondSteps(TinyRegressor):  # epochs of >= 100 ms: >= 10 samples each, enough for a figure
        def training_step(self, batch, batch_idx):
            time.sleep(0.01)
            return super().training_step(batch, batch_idx)

    callback = EnergyCallback(sensors=[SimulatedSensor("device", 100.0)], verbose=False, write_trace=False,
                              interval_s=0.005)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path, max_epochs=3))
    trainer.fit(TenMillisecondSteps(), tiny_loader(), tiny_loader(n=48))
    acc = EventAccumulator(str(trainer.log_dir), size_guidance={"images": 0})
    acc.Reload()
    assert "power/trace" in acc.Tags()["images"]
    assert "close" not in vars(logger.experiment)  # our drain hook was removed


# ---------------------------------------------------------------- the trace
def test_trace_on_a_full_disk_mid_run_is_one_problem_and_leaves_no_partial_file(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, "energy_trace", limit=4000)
    writer = TraceWriter(tmp_path, ["device", "host"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(300):
            writer(10.0 + 0.05 * i, readings(0.05 * i))  # the sampling thread's call: never raises
            writer.event("epoch_end", 10.0 + 0.05 * i, epoch=i)
        writer.close()
    assert len(writer.problems) == 1, writer.problems
    assert "No space left" in writer.problems[0] and "no trace" in writer.problems[0]
    assert len(ours(caught, "No space left")) == 1
    assert not list(tmp_path.glob("*.partial"))
    assert not writer.trace_path.exists()  # a truncated trace is not passed off as the run's trace
    assert writer.complete is False


def test_a_trace_whose_rows_ended_writes_the_events_still_pending_but_no_more_rows(tmp_path):
    """The report ends the rows (it counts them); the fit's end event, resolved later, is still written."""
    writer = TraceWriter(tmp_path, ["device", "host"])
    for i in range(3):
        writer(10.0 + 0.05 * i, readings(0.05 * i))
    assert writer.end_rows() == 3
    writer.event("fit_end", 10.2)
    for i in range(3, 6):  # the sampling thread goes on until the teardown
        writer(10.0 + 0.05 * i, readings(0.05 * i))
    writer.close()
    assert writer.complete and writer.rows == 3
    assert len(read_trace(writer.trace_path)["time_s"]) == 3
    (event,) = writer.events_path.read_text().splitlines()[1:]
    assert event.split(",")[2] == "fit_end"


def test_trace_full_disk_found_at_close_is_one_problem_and_leaves_no_partial_file(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, "energy_trace", limit=2000, fail_on="flush")
    writer = TraceWriter(tmp_path, ["device", "host"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(100):  # fewer rows than a flush: the buffered rows meet the full disk at close
            writer(10.0 + 0.05 * i, readings(0.05 * i))
        writer.close()
    assert len(writer.problems) == 1 and "No space left" in writer.problems[0]
    assert len(ours(caught, "No space left")) == 1
    assert not list(tmp_path.glob("*.partial")) and not writer.trace_path.exists()


def test_trace_that_cannot_be_created_is_one_problem(tmp_path, monkeypatch):
    def read_only(path, mode="r", *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    monkeypatch.setattr(trace_module, "open", read_only, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = TraceWriter(tmp_path / "logs", ["device"])  # in setup, on the training thread
        writer(1.0, readings(1.0))
        writer.event("fit_end", 1.0)
        writer.close()
    assert len(writer.problems) == 1 and "Read-only file system" in writer.problems[0]
    assert len(ours(caught, "Read-only")) == 1
    assert writer.complete is False


def test_trace_in_a_log_dir_made_read_only_mid_run_keeps_its_data_and_says_where(tmp_path, monkeypatch):
    writer = TraceWriter(tmp_path, ["device", "host"])
    for i in range(10):
        writer(10.0 + 0.05 * i, readings(0.05 * i))
    real_replace = os.replace

    def read_only_dir(src, dst, *args, **kwargs):
        if os.fspath(tmp_path) in os.fspath(dst):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.close()  # at teardown: never raises
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(writer.problems) == 1 and ".partial" in writer.problems[0] and "Read-only" in writer.problems[0]
    assert len(ours(caught, "Read-only")) == 1
    partial = tmp_path / "energy_trace.csv.partial"
    assert len(read_trace(partial)["time_s"]) == 10  # the data is whole, under the name the problem gives
    assert writer.complete is False


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_trace_in_a_log_dir_chmod_read_only_mid_run(tmp_path):
    folder = tmp_path / "logs"
    writer = TraceWriter(folder, ["device"])
    writer(1.0, readings(1.0))
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            writer.close()
    finally:
        folder.chmod(stat.S_IRWXU)
    assert len(writer.problems) == 1 and writer.complete is False


class WaitForTraceProblem(L.Callback):
    """Holds the first epoch's end until the EnergyCallback's trace writer reports a problem (the sampling thread
    goes on writing rows until the disk is full: an event; no deadline of its own, pytest-timeout is the net)."""

    def __init__(self, energy: EnergyCallback) -> None:
        self.energy = energy

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        while trainer.current_epoch == 0 and not self.energy._recorder.trace.problems:
            time.sleep(0.005)


def test_a_fit_whose_trace_meets_a_full_disk_finishes_with_one_warning(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, "energy_trace", limit=500)
    callback = EnergyCallback(sensors=[SimulatedSensor("device", 100.0), SimulatedSensor("host", 20.0, scope="host")],
                              verbose=False, interval_s=0.005)
    # the first epoch ends once the trace has met the full disk (an event the sampler's rows bring about, not a
    # time: a fast machine could finish the fit before 500 bytes of rows)
    trainer = L.Trainer(callbacks=[callback, WaitForTraceProblem(callback)], logger=False,
                        **trainer_kwargs(tmp_path, max_epochs=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert trainer.state.finished and trainer.global_step == 3 * ROWS // 16
    assert len(ours(caught, "No space left")) == 1, [str(w.message) for w in caught]
    assert not list(tmp_path.rglob("*.partial"))
    assert not (tmp_path / "energy_trace.csv").exists()  # no truncated trace under the final name
    assert callback.report is not None


# ---------------------------------------------------------------- the catalog
def record(model: str = "pkg.Model") -> dict:
    return {"model": model, "energy_J": 10.0, "sensors": [{"name": "device", "rank": 0, "energy_J": 10.0}]}


def test_locked_catalog_is_one_clear_catalog_error(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog_module, "BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / CATALOG_FILE
    catalog = Catalog(path)
    catalog.add(record("first"))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process in the middle of a long write
    try:
        with pytest.raises(CatalogError, match="locked") as caught:
            catalog.add(record("second"))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    err = caught.value
    assert isinstance(err, OSError) and err.errno == errno.EBUSY
    assert "\n" not in str(err) and str(path) in str(err) and "adding a fit" in str(err)
    assert [f["model"] for f in catalog.list()] == ["first"]  # nothing half-written


def test_damaged_catalog_is_one_clear_catalog_error(tmp_path):
    path = tmp_path / CATALOG_FILE
    catalog = Catalog(path)
    for i in range(30):
        catalog.add(record(f"fit{i}"))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    for offset in range(4096, len(data), 4096):  # every page after the first one overwritten
        data[offset:offset + 100] = b"\xff" * 100
    path.write_bytes(bytes(data))
    for action in (lambda: catalog.add(record("late")), catalog.list):
        with pytest.raises(CatalogError, match="damaged|not a lightning-energy run catalog") as caught:
            action()
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_catalog_on_a_full_disk_is_one_clear_catalog_error(tmp_path, monkeypatch):
    path = tmp_path / CATALOG_FILE
    catalog = Catalog(path)
    catalog.add(record("first"))
    real_connect = sqlite3.connect

    def full_disk_connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "database or disk is full"
        return conn

    monkeypatch.setattr(sqlite3, "connect", full_disk_connect)
    big = record("second")
    big["config"] = {"blob": "x" * 200_000}
    with pytest.raises(CatalogError, match="disk is full") as caught:
        catalog.add(big)
    monkeypatch.setattr(sqlite3, "connect", real_connect)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert [f["model"] for f in catalog.list()] == ["first"]


def test_read_only_catalog_is_one_clear_catalog_error(tmp_path, monkeypatch):
    path = tmp_path / CATALOG_FILE
    Catalog(path).add(record("first"))
    real_connect = sqlite3.connect

    def read_only_connect(database, *args, **kwargs):
        kwargs["uri"] = True
        return real_connect(f"file:{database}?mode=ro", *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", read_only_connect)
    with pytest.raises(CatalogError, match="read-only") as caught:
        Catalog(path).add(record("second"))
    monkeypatch.setattr(sqlite3, "connect", real_connect)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.EROFS
    assert [f["model"] for f in Catalog(path).list()] == ["first"]


def test_catalog_timeout_is_an_argument(tmp_path):
    path = tmp_path / CATALOG_FILE
    catalog = Catalog(path, timeout_s=0.1)
    catalog.add(record("first"))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(CatalogError, match=r"locked by another process \(waited 0.1 s\)"):
            catalog.add(record("second"))
    finally:
        holder.execute("ROLLBACK")
        holder.close()


# ---------------------------------------------------------------- atomic writes
def test_atomic_write_full_disk_at_fsync_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "energy_report.json"
    target.write_text('{"old": true}\n')

    def full(fd):
        raise enospc()

    monkeypatch.setattr(os, "fsync", full)  # delayed allocation / NFS: the full disk shows at fsync
    with pytest.raises(OSError) as caught:
        io_module.atomic_write_json(target, {"new": True})
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert json.loads(target.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["energy_report.json"]


def test_atomic_write_full_disk_at_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            raise enospc()

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError):
        io_module.atomic_write_text(target, "x")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_gives_the_file_the_usual_mode(tmp_path):
    old_mask = os.umask(0o022)
    try:
        fresh = io_module.atomic_write_text(tmp_path / "fresh.json", "{}")
        existing = tmp_path / "existing.json"
        existing.write_text("{}")
        existing.chmod(0o640)
        io_module.atomic_write_text(existing, "{}")
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644  # not mkstemp's 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640


def test_try_atomic_write_json_returns_one_line_instead_of_raising(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(enospc()))
    problem = io_module.try_atomic_write_json(tmp_path / "energy_report.json", {"a": 1})
    monkeypatch.undo()
    assert problem is not None and "energy_report.json" in problem and "No space left" in problem
    assert "\n" not in problem and list(tmp_path.iterdir()) == []
    assert io_module.try_atomic_write_json(tmp_path / "energy_report.json", {"a": 1}) is None
