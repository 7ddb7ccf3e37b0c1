"""The suite's DDP ranks, forked from one process that has imported Lightning once (issue 32 item 6: a third of
the suite's time was DDP subprocesses, and most of each was two interpreters importing Lightning, one after the
other, while the first waited for the second at the rendezvous).

The zygote is a child process of the test worker that imports Lightning, the package and the suite's helpers,
then waits on its stdin for requests (one JSON line each): a script, its arguments and one environment per rank.
For each request it forks one process per rank; each sets its environment, points its stdout and stderr at its
own files, runs the script as ``__main__`` (``runpy``) and exits with the script's exit code. The zygote writes
the ranks' process ids, then their exit codes (one JSON line each). The zygote itself starts no thread and
opens no process group, so each fork starts as a fresh interpreter would after those imports.

Each rank is told who it is the way an external launcher (``torchrun``, SLURM) tells it: ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK`` and ``RANK``; ``LOCAL_RANK``'s presence is what
makes Lightning's and Fabric's ``LightningEnvironment`` create no process of its own. Lightning's own launcher
(``strategy="ddp"`` re-running the script for rank 1) stays covered by ``test_ddp.py``'s first test, which starts
``ddp_fit.py`` as a user would.

Used through :func:`run_ranks` (the ``rank_zygote`` session fixture of ``conftest.py`` holds one zygote per
test worker).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a forked rank finds imported already. The scripts import these first; the rest is cheap.
PRELOAD = ("lightning", "lightning.fabric", "lightning.pytorch", "lightning.pytorch.loggers",
           "lightning.pytorch.callbacks", "torch.distributed", "lightning_energy", "conftest",
           "lightning_energy.callbacks.carbon", "lightning_energy.callbacks.catalog",
           "lightning_energy.callbacks.forecast", "lightning_energy.callbacks.power_limit",
           "lightning_energy.callbacks.precision", "lightning_energy.callbacks.prometheus",
           "lightning_energy.simulate.gpu_sim", "baler_lit.data", "baler_lit.module", "precision_helpers",
           "power_limit_helpers")
# Variables by which Lightning would detect a launcher of its own (or the test worker's) around the ranks.
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "LSB_", "LSF_", "KUBERNETES_", "PL_")
PEER_GRACE_S = 30.0  # after one rank fails, how long its peers may take to notice before they are killed
LAUNCHER_VARS = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE", "JSM_NAMESPACE_RANK"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(base: dict, port: int, nodes: int, devices: int, node: int, local: int) -> dict:
    """``base`` without any launcher's variables, plus what an external launcher tells rank (node, local)."""
    env = {k: v for k, v in base.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * devices),
                "NODE_RANK": str(node), "GROUP_RANK": str(node), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(devices), "RANK": str(node * devices + local)})
    return env


# ---------------------------------------------------------------------------------------------- the zygote side

def _run_rank(script: str, argv: list[str], env: dict, stdout: str, stderr: str, cwd: str | None) -> None:
    """In a forked child: become the rank (in ``cwd``, as ``python -c`` there, when given) and run ``script``;
    never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: the test kills the rank and whatever it started in one call
        if cwd is not None:
            os.chdir(cwd)
            sys.path.insert(0, "")  # what ``python -c`` puts first: the working directory
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, stdout), (2, stderr)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = sys.__stdout__  # the zygote pointed sys.stdout at stderr; fd 1 is now this rank's stdout
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *argv]
        import runpy
        import traceback

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - the rank's traceback goes to its stderr, as an interpreter's would
            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()  # what the script registered (an interpreter runs them at exit)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve() -> None:
    """The zygote's loop: a request per stdin line, replies on stdout, until stdin closes."""
    import importlib

    sys.path.insert(0, str(HERE))
    for name in PRELOAD:
        importlib.import_module(name)
    import threading

    if threading.active_count() != 1:  # a fork keeps only the forking thread: the ranks would miss the others
        raise RuntimeError(f"an import started threads in the zygote: {threading.enumerate()}")
    replies = sys.stdout
    sys.stdout = sys.stderr  # anything an import prints stays off the reply channel
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for rank in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                _run_rank(request["script"], request["argv"], rank["env"], rank["stdout"], rank["stderr"],
                          request.get("cwd"))
            pids.append(pid)
        print(json.dumps({"pids": pids}), file=replies, flush=True)
        codes = _wait_for_ranks(pids)
        print(json.dumps({"codes": [codes[pid] for pid in pids]}), file=replies, flush=True)


def _wait_for_ranks(pids: list[int]) -> dict[int, int]:
    """Each rank's exit code. Once one has failed, its peers (waiting for it at a collective, which gloo gives
    up on only after half an hour) get :data:`PEER_GRACE_S` to fail or finish, then their groups are killed."""
    codes: dict[int, int] = {}
    failed_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
            _kill_groups(p for p in pids if p not in codes)
        time.sleep(0.05)
    return codes


def _kill_groups(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------------------------------------------ the test side

@dataclass
class RanksRun:
    """What :func:`run_ranks` saw: like ``subprocess.CompletedProcess``, the ranks' outputs in rank order."""

    returncode: int  # 0 when every rank exited 0, else the first nonzero code (negative: a signal)
    codes: list[int]
    stdout: str
    stderr: str
    port: int


class RankZygote:
    """One zygote process (started on first use) and the requests sent to it, one at a time."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()  # the zygote's reply lines, decoded, None at its end

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve"], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        # A thread reads the replies, so that a wait with a timeout never misses a line already buffered
        threading.Thread(target=self._read_replies, args=(process.stdout,), name="zygote-replies", daemon=True).start()
        if (self._next_reply(timeout_s=300) or {}).get("ready") is not True:
            process.kill()
            process.wait()
            raise RuntimeError("the rank zygote did not start (run `python tests/rank_zygote.py serve` to see why)")
        self._process = process
        return process

    def _read_replies(self, stream) -> None:
        for line in stream:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def _next_reply(self, timeout_s: float | None = None) -> dict | None:
        """The zygote's next reply; ``queue.Empty`` past ``timeout_s``; None once it has ended."""
        return self._replies.get(timeout=timeout_s)

    def run(self, script: str | Path, argv: list[str], logs: Path, *, nodes: int = 1, devices: int = 2,
            env: dict | None = None, timeout_s: float = 240.0) -> RanksRun:
        """Run ``script argv`` as ``nodes`` x ``devices`` ranks; their outputs go to ``logs/rank<N>.{out,err}``."""
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        base = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
        ranks = []
        for node in range(nodes):
            for local in range(devices):
                rank = node * devices + local
                ranks.append({"env": rank_environment(base, port, nodes, devices, node, local),
                              "stdout": str(logs / f"rank{rank}.out"), "stderr": str(logs / f"rank{rank}.err")})
        request = {"script": str(Path(script).resolve()), "argv": [str(a) for a in argv], "ranks": ranks}
        return self._send(request, timeout_s, port)

    def run_python(self, code: str, cwd: Path, env: dict, *, timeout_s: float = 300.0) -> RanksRun:
        """``python -c code`` in ``cwd`` with ``env`` (one process, no launcher's variables), forked warm."""
        with tempfile.TemporaryDirectory(prefix="zygote-") as scratch:
            script = Path(scratch) / "code.py"
            script.write_text(code)
            rank = {"env": dict(env), "stdout": str(Path(scratch) / "out"), "stderr": str(Path(scratch) / "err")}
            request = {"script": str(script), "argv": [], "ranks": [rank], "cwd": str(cwd)}
            return self._send(request, timeout_s, port=0)

    def _send(self, request: dict, timeout_s: float, port: int) -> RanksRun:
        """Send ``request`` to the zygote (started on first use) and wait for its ranks."""
        if self._process is not None and self._process.poll() is not None:
            raise RuntimeError(f"the rank zygote exited with code {self._process.returncode}")
        process = self._process or self._start()
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        pids = self._reply(process, "pids")
        try:
            codes = self._reply(process, "codes", timeout_s)
        except queue.Empty:  # past the timeout: every rank is killed, and the zygote then reports their codes
            _kill_groups(pids)
            codes = self._reply(process, "codes")
        ranks = request["ranks"]
        read = [(Path(r["stdout"]).read_text(errors="replace"), Path(r["stderr"]).read_text(errors="replace"))
                for r in ranks]
        returncode = next((c for c in codes if c != 0), 0)
        return RanksRun(returncode, codes, "".join(o for o, _ in read), "".join(e for _, e in read), port)

    def _reply(self, process: subprocess.Popen, key: str, timeout_s: float | None = None):
        reply = self._next_reply(timeout_s)
        if reply is None:
            raise RuntimeError(f"the rank zygote exited with code {process.wait()}")
        return reply[key]

    def close(self) -> None:
        """End the zygote (its stdin closes: it returns from its loop) and close its pipes."""
        process, self._process = self._process, None
        if process is None:
            return
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
