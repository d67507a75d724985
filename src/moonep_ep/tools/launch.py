"""Run a function on N local ranks, each a real process with its own process group.

Used by the CLI (``selftest``, ``demo``, ``footprint --measure``) and by the
multi-process tests. Ranks are *spawned* (never forked: fork is unsafe after
CUDA init and would hide the handle exchange), join a gloo (CPU) or NCCL (GPU)
group through a fresh ``file://`` rendezvous in a private temporary directory,
and report ``(rank, result)`` or their traceback to the parent. The parent
ends every rank it started, by pid, on every path.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from .. import envs

DEFAULT_RANK_TIMEOUT_S = 600.0
#: Resident memory of one rank that imported torch and joined a gloo group, measured on
#: this project's CPU machines (VmRSS 230-300 MiB; the larger figure is used).
RANK_RSS_ESTIMATE_BYTES = 300 << 20
#: How often ``run_ranks`` reports how many ranks are up while they start.
PROGRESS_INTERVAL_S = 3.0


def check_rank_count(ranks: int, what: str) -> list[str]:
    """Refuse rank counts MoonEP cannot run; return warnings for counts this machine will struggle with.

    MoonEP's kernels support at most ``MAX_R`` (128) EP ranks. More ranks than
    cores run, but slowly (each imports torch); more than the memory available
    for them may not start at all."""
    from ..errors import ConfigError
    from ..ops.limits import MAX_R

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


def admit_ranks(ranks: int, what: str) -> bool:
    """For a command about to start ``ranks`` ranks: False (after a one-line error on stderr)
    when MoonEP cannot run that many; warnings on stderr when this machine will struggle."""
    from ..errors import ConfigError

    try:
        warnings = check_rank_count(ranks, what)
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


def _rank_main(fn_ref: str, rank: int, world: int, backend: str, use_cuda: bool,
               init_file: str, timeout_s: float, results: Any, args: tuple, env: dict[str, str]) -> None:
    # ``fn`` travels by name and is imported here, after "started" is reported: importing
    # its module (torch) is the slow part of a start, and the parent reports progress on it.
    results.put((rank, "started", None))
    os.environ.update(env)
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
    different GPU -- identified by UUID, not by ordinal.
    """
    import torch

    emulated = bool(envs.MOONEP_EP_CUDA_EMULATOR)
    if driver == "auto":
        driver = "cuda" if emulated or torch.cuda.is_available() else "host"
    if driver != "cuda":
        return LaunchPlan(driver, "gloo", False, False)
    if emulated:
        from ..testing.cuda_emulator import NodeSpec, visible_gpus

        visible = visible_gpus(NodeSpec.parse(envs.MOONEP_EP_CUDA_EMULATOR_NODE),
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not visible:
            return LaunchPlan(driver, "gloo", False, True)
        envs_per_rank = tuple({"CUDA_VISIBLE_DEVICES": str(visible[r % len(visible)])} for r in range(ranks))
        return LaunchPlan(driver, "gloo", False, True, envs_per_rank)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return LaunchPlan(driver, "nccl" if gpus >= ranks else "gloo", True, False)


def run_ranks(fn: Callable[..., Any], world_size: int, *, args: tuple = (), backend: str = "gloo",
              use_cuda: bool | None = None,
              timeout_s: float = DEFAULT_RANK_TIMEOUT_S, group_timeout_s: float | None = None,
              env: dict[str, str] | None = None,
              rank_envs: Sequence[dict[str, str]] | None = None,
              progress: Callable[[str], None] | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` spawned ranks; return results in rank order.

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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    workdir = tempfile.mkdtemp(prefix="moonep-ep-run-")
    init_file = os.path.join(workdir, "pg_init")
    group_timeout = group_timeout_s or min(timeout_s, envs.MOONEP_EP_TIMEOUT_S)
    procs = []
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            rank_env = dict(env or {}, **(rank_envs[rank] if rank_envs else {}))
            proc = ctx.Process(target=_rank_main, name=f"moonep-ep-rank{rank}",
                               args=(fn_ref, rank, world_size, backend, use_cuda, init_file, group_timeout, results,
                                     args, rank_env))
            proc.start()
            procs.append(proc)
        t_start = time.monotonic()
        if progress:
            progress(f"started {world_size} ranks (pids {[p.pid for p in procs]}), backend {backend}")
        deadline = t_start + timeout_s
        started: set[int] = set()
        up: set[int] = set()
        next_report = t_start + PROGRESS_INTERVAL_S
        while len(out) + len(errors) < world_size:
            if progress and len(up) < world_size and time.monotonic() >= next_report:
                progress(f"ranks up: {len(up)}/{world_size} ready ({len(started)}/{world_size} processes running, "
                         f"importing torch) after {time.monotonic() - t_start:.0f}s")
                next_report += PROGRESS_INTERVAL_S
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in out and rank not in errors and proc.exitcode not in (None, 0):
                        # Give a dying rank a moment to flush its traceback into the queue.
                        try:
                            r, status, payload = results.get(timeout=1.0)
                            while status in ("started", "up"):
                                (started if status == "started" else up).add(r)
                                r, status, payload = results.get(timeout=1.0)
                            (out if status == "ok" else errors)[r] = payload
                        except queue.Empty:
                            errors[rank] = f"process exited with code {proc.exitcode} without a result"
                if time.monotonic() > deadline:
                    for rank in range(world_size):
                        if rank not in out and rank not in errors:
                            errors[rank] = f"no result within {timeout_s:.0f}s"
                continue
            if status == "started":
                started.add(rank)
                continue
            if status == "up":
                up.add(rank)
                if progress and len(up) == world_size and world_size > 1:
                    progress(f"all {world_size} ranks up after {time.monotonic() - t_start:.1f}s")
                continue
            if status == "ok":
                out[rank] = payload
                if progress:
                    progress(f"rank {rank} done ({len(out)}/{world_size})")
            else:
                errors[rank] = payload
        for proc in procs:
            proc.join(timeout=10)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        raise RankFailure(errors, out)
    return [out[r] for r in range(world_size)]
