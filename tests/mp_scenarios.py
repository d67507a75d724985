"""Rank bodies for the multi-process tests (run in spawned ranks via moonep_ep.launch).

Each returns plain data; the test process asserts on it, so a failed check
reports which rank saw what.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from moonep_ep.errors import CollectiveError, DriverError
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver
from moonep_ep.memory.symmetric import Segment, SymmetricMemory

GRAN = 64 << 10


def _fill(owner: int, chunk: int, writer: int, n: int) -> torch.Tensor:
    idx = torch.arange(n, dtype=torch.int64)
    return ((idx * 7 + owner * 31 + chunk * 11 + writer * 3 + 1) % 253).to(torch.uint8)


def leaks(driver: HostDriver, before) -> dict[str, int]:
    gc.collect()
    after = snapshot(driver.rank)
    out = {k: v for k, v in driver.live_objects().items() if v}
    if after.open_memfds != before.open_memfds:
        out["open_memfds"] = after.open_memfds - before.open_memfds
    if after.memfd_mappings != before.memfd_mappings:
        out["memfd_mappings"] = after.memfd_mappings - before.memfd_mappings
    return out


def visibility(ctx: Any) -> dict[str, Any]:
    """Unequal sizes and chunk counts; rank-order and local-first views; writes both ways;
    a range that maps one physical chunk twice."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    # rank r: chunk0 of (r+1) pages; even ranks also have a 1-page chunk1.
    sizes = [(rank + 1) * GRAN] + ([GRAN] if rank % 2 == 0 else [])
    symm = SymmetricMemory.allocate(sizes, driver=driver, tags=["a", "b"][: len(sizes)])
    out: dict[str, Any] = {"chunk_sizes": symm.chunk_sizes, "errors": []}
    by_rank = symm.map_chunks(0, "rank")
    local_first = symm.map_chunks(0, "local_first")
    # chunk0 of the next rank twice in one range: two virtual pages, one physical page.
    nxt = (rank + 1) % world
    twice = symm.map_range([Segment(nxt, 0, 0, GRAN), Segment(nxt, 0, 0, GRAN)], "twice")
    ones = [symm.map_range([Segment(r, 1, 0, GRAN)]) for r in range(world) if len(symm.chunk_sizes[r]) > 1]
    symm.release_imports()
    c0 = [s[0] for s in symm.chunk_sizes]
    off = [sum(c0[:r]) for r in range(world)]
    v = by_rank.bytes()
    # Each rank writes its own chunk0 page 0, and page 1.. of the previous rank's chunk0 (if any).
    v[off[rank]:off[rank] + GRAN].copy_(_fill(rank, 0, rank, GRAN))
    prev = (rank - 1) % world
    if c0[prev] > GRAN:
        v[off[prev] + GRAN:off[prev] + 2 * GRAN].copy_(_fill(prev, 0, rank, GRAN))
    for t in ones:
        pass
    if len(sizes) > 1:
        ones_own = [o for o in ones if o.segments[0].owner == rank][0]
        ones_own.bytes().copy_(_fill(rank, 1, rank, GRAN))
    symm.comm.barrier()
    lf = local_first.bytes()
    lf_off, cur = {}, 0
    for o in symm.owner_order("local_first"):
        lf_off[o] = cur
        cur += c0[o]
    out["local_first_order"] = symm.owner_order("local_first")
    for o in range(world):
        if not torch.equal(v[off[o]:off[o] + GRAN], _fill(o, 0, o, GRAN)):
            out["errors"].append(f"chunk0 page0 of rank {o} wrong")
        writer = (o + 1) % world
        if c0[o] > GRAN and not torch.equal(v[off[o] + GRAN:off[o] + 2 * GRAN], _fill(o, 0, writer, GRAN)):
            out["errors"].append(f"chunk0 page1 of rank {o} (written by rank {writer}) wrong")
        if not torch.equal(lf[lf_off[o]:lf_off[o] + c0[o]], v[off[o]:off[o] + c0[o]]):
            out["errors"].append(f"local-first view of rank {o} differs")
    for t in ones:
        o = t.segments[0].owner
        if not torch.equal(t.bytes(), _fill(o, 1, o, GRAN)):
            out["errors"].append(f"chunk1 of rank {o} wrong")
    tw = twice.bytes()
    if not torch.equal(tw[:GRAN], tw[GRAN:]):
        out["errors"].append("two virtual pages of one physical page differ")
    symm.comm.barrier()
    # Alias: write through one view, read through the other.
    if rank == 0:
        lf[lf_off[world - 1]:lf_off[world - 1] + 16].fill_(0xAB)
    symm.comm.barrier()
    out["alias_seen"] = bool(v[off[world - 1]:off[world - 1] + 16].eq(0xAB).all())
    out["visible_bytes"] = by_rank.size
    out["physical_bytes"] = snapshot(rank).own_bytes
    del v, lf, tw
    for r_ in [by_rank, local_first, twice, *ones]:
        r_.close()
    symm.close()
    out["leaks"] = leaks(driver, before)
    return out


def outlive(ctx: Any) -> dict[str, Any]:
    """A tensor keeps its mapping alive after the allocation is closed."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    symm = SymmetricMemory.allocate([GRAN], driver=driver)
    view = symm.map_chunks()
    t = view.tensor(torch.int32, (world, GRAN // 4))
    t[rank].fill_(rank + 100)
    symm.comm.barrier()
    symm.close()           # collective: releases handles, drops the range
    del view
    gc.collect()
    mid = snapshot(rank)
    values = [int(t[r, 0]) for r in range(world)]
    mappings_while_alive = mid.memfd_mappings - before.memfd_mappings
    fds_while_alive = mid.open_memfds - before.open_memfds
    part = t[1:]           # a view of the tensor also keeps it alive
    del t
    gc.collect()
    still = snapshot(rank).memfd_mappings - before.memfd_mappings
    del part
    gc.collect()
    return {"values": values, "mappings_while_alive": mappings_while_alive,
            "fds_while_alive": fds_while_alive, "mappings_with_view_only": still,
            "leaks": leaks(driver, before)}


def multicast(ctx: Any) -> dict[str, Any]:
    """Each rank in turn writes through the multicast object; every chunk sees each write."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    symm = SymmetricMemory.allocate([2 * GRAN + rank * GRAN], driver=driver, multicast=True)
    view = symm.map_chunks()
    sizes = [s[0] for s in symm.chunk_sizes]
    off = [sum(sizes[:r]) for r in range(world)]
    seen = []
    for writer in range(world):
        if rank == writer:
            symm.multicast_write(writer * 256, torch.full((256,), writer + 1, dtype=torch.uint8))
        symm.comm.barrier()
        b = view.bytes()
        seen.append([bool(b[off[o] + writer * 256:off[o] + (writer + 1) * 256].eq(writer + 1).all())
                     for o in range(world)])
        del b
    out = {"has_multicast": symm.has_multicast, "seen": seen,
           "mc_size": symm._multicast.size if symm._multicast else 0}
    view.close()
    symm.close()
    out["leaks"] = leaks(driver, before)
    return out


class FaultyDriver:
    """Delegates to a HostDriver; the ``nth`` call of ``method`` raises (or returns
    a CUDA-like error code) on this rank."""

    def __init__(self, inner: HostDriver, method: str, nth: int = 1, code: str = "INJECTED",
                 times: int = 1):
        self._inner, self._method, self._nth, self._code, self._times = inner, method, nth, code, times
        self._calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def wrapped(*args, **kwargs):
            self._calls += 1
            if self._nth <= self._calls < self._nth + self._times:
                raise self._inner.error(name, f"injected failure (call {self._calls})", self._code)
            return attr(*args, **kwargs)
        return wrapped


FAULT_POINTS = ["create", "export", "import_handle", "multicast_create", "multicast_import",
                "multicast_add_device", "multicast_bind", "reserve", "map", "set_access", "exchange"]
#: Steps that only rank 0 performs (it creates the multicast object).
ROOT_ONLY = {"multicast_create"}


def faults(ctx: Any, failing_rank: int) -> dict[str, Any]:
    """Inject a failure at each step on ``failing_rank``: every rank must raise, none
    may hang, and nothing may leak on any rank."""
    from moonep_ep.memory import exchange

    rank = ctx.rank
    results: dict[str, Any] = {}
    for point in FAULT_POINTS:
        if point in ROOT_ONLY and failing_rank != 0:
            continue
        inner = HostDriver(rank=rank, granularity=GRAN)
        before = snapshot(rank)
        driver: Any = inner
        restore = None
        if rank == failing_rank:
            if point == "exchange":
                original = exchange._send_fds
                def broken(*a, **k):
                    raise ConnectionResetError("injected: peer connection dropped")
                exchange._send_fds = broken
                restore = lambda: setattr(exchange, "_send_fds", original)  # noqa: E731
            else:
                driver = FaultyDriver(inner, point, nth=2 if point in ("create", "export", "map") else 1)
        outcome: dict[str, Any] = {}
        try:
            symm = SymmetricMemory.allocate([GRAN, GRAN], driver=driver, multicast=True)
            try:
                with symm.comm.step("map views"):
                    a = symm.map_chunks(0)
                    b = symm.map_chunks(1, "local_first")
                a.close()
                b.close()
            finally:
                symm.close()
            outcome["raised"] = None
        except CollectiveError as exc:
            outcome["raised"] = "CollectiveError"
            outcome["failures"] = sorted(exc.failures)
            outcome["step"] = exc.step
            outcome["message"] = str(exc)[:400]
        except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
            outcome["raised"] = f"{type(exc).__name__}: {exc}"
        finally:
            if restore:
                restore()
        outcome["leaks"] = leaks(inner, before)
        results[point] = outcome
    return results


def bind_retry(ctx: Any, times: int) -> dict[str, Any]:
    """SYSTEM_NOT_READY on one rank's multicast bind: retried by all ranks in lockstep."""
    rank = ctx.rank
    inner = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    driver: Any = FaultyDriver(inner, "multicast_bind", 1, "SYSTEM_NOT_READY", times) if rank == 1 else inner
    try:
        symm = SymmetricMemory.allocate([GRAN], driver=driver, multicast=True)
        ok = symm.has_multicast
        symm.close()
        out = {"ok": ok}
    except CollectiveError as exc:
        out = {"ok": False, "error": str(exc)[:300], "failures": sorted(exc.failures)}
    out["leaks"] = leaks(inner, before)
    return out


def disagree_granularity(ctx: Any) -> dict[str, Any]:
    rank = ctx.rank
    driver = HostDriver(rank=rank, granularity=GRAN * (2 if rank == 1 else 1))
    before = snapshot(rank)
    try:
        SymmetricMemory.allocate([4 * GRAN], driver=driver)
        out = {"raised": None}
    except CollectiveError as exc:
        out = {"raised": str(exc)}
    out["leaks"] = leaks(driver, before)
    return out


def env_probe(ctx: Any) -> str:
    return os.environ.get("MOONEP_EP_PROBE", "")


def cuda_fake_sequence(ctx: Any, same_gpu: bool = False) -> dict[str, Any]:
    """SymmetricMemory over the CUDA driver, with the recording fake in place of
    cuda.bindings.driver: the real call sequence, no GPU."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.memory.cuda_fake import RecordingCudaApi

    # One GPU per rank (device = rank), as on an NVSwitch node: the vote keeps multicast on.
    api = RecordingCudaApi(granularity=GRAN, multicast=True, device_count=ctx.world_size)
    driver = CudaDriver(device=0 if same_gpu else ctx.rank, rank=ctx.rank, api=api)
    symm = SymmetricMemory.allocate([GRAN, 2 * GRAN], driver=driver, multicast=True)
    view = symm.map_chunks(1, "local_first")
    symm.release_imports()
    view.close()
    symm.close()
    driver.close()
    return {"multicast": symm.decision.multicast, "reason": symm.decision.reason,
            "calls": [(name, [repr(a) for a in args]) for name, args in api.calls],
            "live": api.live(), "driver_live": driver.live_objects()}


def _allocate_map_close(driver: Any, multicast: bool) -> dict[str, Any]:
    """One GRAN chunk per rank: allocate, map all, release imports, tear down, close the
    driver; report the decision, or the collective error."""
    out: dict[str, Any] = {}
    try:
        symm = SymmetricMemory.allocate([GRAN], driver=driver, multicast=multicast)
        out.update(handle_type=symm.decision.handle_type.value, reason=symm.decision.reason,
                   multicast=symm.has_multicast)
        view = symm.map_chunks()
        symm.release_imports()
        view.close()
        symm.close()
    except CollectiveError as exc:
        out["error"] = str(exc)
    driver.close()
    return out


def cuda_fabric_fallback(ctx: Any, fail_rank: int, fail_call: str, times: int) -> dict[str, Any]:
    """Fabric refused (NOT_PERMITTED) on one rank: every rank falls back to POSIX fds."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.memory.cuda_fake import RecordingCudaApi

    api = RecordingCudaApi(granularity=GRAN, multicast=False, fabric=True, device_count=ctx.world_size)
    if ctx.rank == fail_rank:
        api.fail(fail_call, "CUDA_ERROR_NOT_PERMITTED", times)
    driver = CudaDriver(device=ctx.rank, rank=ctx.rank, api=api)
    out = _allocate_map_close(driver, multicast=False)
    out["creates"] = [repr(a[1].requestedHandleTypes) for n, a in api.calls if n == "cuMemCreate"]
    out["live"] = api.live()
    out["calls"] = [n for n, _ in api.calls]
    return out


KILL_POINTS = ["before_exchange", "mid_exchange", "after_mapping", "during_prefetch"]


def killed_peer(ctx: Any, point: str, victim: int) -> dict[str, Any]:
    """``victim`` SIGKILLs itself at ``point``; survivors report their error, how long
    they took to raise it, and what they leaked after cleaning up."""
    import signal
    import time

    from moonep_ep.errors import MoonEPError
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
    from moonep_ep.memory import exchange
    from moonep_ep.ops.prefetch import pull_slots

    rank = ctx.rank
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    me_dies = rank == victim

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if me_dies and point == "mid_exchange":
        original = exchange._send_fds
        sent = []

        def send_then_die(*args, **kwargs):
            if sent:
                die()  # one peer has our fds, the others wait for us
            original(*args, **kwargs)
            sent.append(1)
        exchange._send_fds = send_then_die
    out: dict[str, Any] = {"rank": rank}
    store = full = None
    t0 = time.monotonic()
    try:
        if me_dies and point == "before_exchange":
            die()
        store = ShardedExpertStore(num_layers=2, num_experts=3 * ctx.world_size,
                                   projections=ffn_projections(256, 128), num_slots=3, driver=driver)
        store.load(lambda layer, proj, e: torch.full(
            next(p.shape for p in store.projections if p.name == proj), float(e), dtype=torch.bfloat16))
        if me_dies and point == "after_mapping":
            die()
        t0 = time.monotonic()
        for step in range(50):  # pull prefetch: slots <- rows of every owner, then a barrier
            if me_dies and point == "during_prefetch" and step == 3:
                die()
            full = {p.name: store.gen_a(step % 2, p.name) for p in store.projections}
            pull_slots(full, [(victim * 3 + b) % store.num_experts for b in range(3)], store.num_experts)
            store.finish_loading()
        out["error"] = None
    except MoonEPError as exc:
        out["error"] = str(exc)
        out["error_type"] = type(exc).__name__
    out["seconds_to_error"] = round(time.monotonic() - t0, 2)
    full = None  # our own view: it would (rightly) keep its mapping alive
    if store is not None:
        try:
            store.close()
        except MoonEPError as exc:
            out["close_error"] = type(exc).__name__
    gc.collect()
    out["leaks"] = leaks(driver, before)
    return out


_FOREIGN_SENDER = r"""
import array, os, socket, struct, sys
path = sys.argv[1]
fd = os.memfd_create("foreign")
os.ftruncate(fd, 4096)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.connect(path)
    # Claims to be rank 0 and offers an fd of its own.
    try:
        s.sendmsg([struct.pack("<iii", 0, 1, 1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        print("sent")
    except (BrokenPipeError, ConnectionResetError):
        print("cut off")  # the member already checked our credentials and hung up
"""


def exchange_security(ctx: Any) -> dict[str, Any]:
    """A foreign process offers fds to rank 1; a crashed run's directory is swept;
    received fds are close-on-exec and the memory sealed."""
    import fcntl
    import stat
    import subprocess
    import sys
    import tempfile

    from moonep_ep.memory import exchange
    from moonep_ep.memory.driver import HandleType
    from moonep_ep.memory.group import GroupComm

    rank = ctx.rank
    comm = GroupComm()
    driver = HostDriver(rank=rank, granularity=GRAN)
    out: dict[str, Any] = {}
    stale = live = None
    if rank == 0:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        stale = tempfile.mkdtemp(prefix=f"moonep-ep-fds-{dead.pid}-")  # left by a "crashed" run
        open(os.path.join(stale, "rank1.sock"), "w").close()
        live = tempfile.mkdtemp(prefix=f"moonep-ep-fds-{os.getppid()}-")  # a live run's: kept
        original = exchange._send_fds

        def foreign_first(path, *args, **kwargs):
            d = os.path.dirname(path)
            out["dir_mode"] = oct(stat.S_IMODE(os.stat(d).st_mode))
            out["dir"] = d
            proc = subprocess.run([sys.executable, "-c", _FOREIGN_SENDER, path], capture_output=True,
                                  text=True, timeout=30)
            out["foreign"] = proc.stdout.strip() or proc.stderr[-300:]
            return original(path, *args, **kwargs)
        exchange._send_fds = foreign_first
    h = driver.create(GRAN)
    fd = driver.export(h, HandleType.POSIX_FD)
    inodes = comm.all_gather_object(os.fstat(fd).st_ino)
    ex = exchange.HandleExchanger(comm)
    got = ex.exchange([fd], HandleType.POSIX_FD)
    os.close(fd)
    peer = 1 - rank
    rfd = got[peer][0]
    out["rejected"] = ex.rejected
    out["peer_inode_ok"] = os.fstat(rfd).st_ino == inodes[peer]
    out["cloexec"] = bool(fcntl.fcntl(rfd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
    try:
        os.ftruncate(rfd, GRAN // 2)
        out["sealed"] = False
    except PermissionError:
        out["sealed"] = True
    for lst in got:
        for f in lst:
            os.close(f)
    driver.release(h)
    comm.barrier()
    out["dir_removed"] = not os.path.exists(ex.last_directory)
    if rank == 0:
        out["stale_swept"] = not os.path.exists(stale)
        out["live_kept"] = os.path.exists(live)
        out["fresh_dir"] = out.get("dir") not in (stale, live)
        os.rmdir(live)
    return out


def cuda_bind_retry(ctx: Any, times: int) -> dict[str, Any]:
    """SYSTEM_NOT_READY (802) from cuMulticastBindMem on rank 1 (recording fake)."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.memory.cuda_fake import RecordingCudaApi

    api = RecordingCudaApi(granularity=GRAN, multicast=True, fabric=False, device_count=ctx.world_size)
    if ctx.rank == 1:
        api.fail("cuMulticastBindMem", "CUDA_ERROR_SYSTEM_NOT_READY", times)
    driver = CudaDriver(device=ctx.rank, rank=ctx.rank, api=api)
    out = _allocate_map_close(driver, multicast=True)
    out["binds"] = sum(1 for n, _ in api.calls if n == "cuMulticastBindMem")
    out["calls"] = [n for n, _ in api.calls]
    out["live"] = api.live()
    return out


def bad_input(ctx: Any, case: str) -> dict[str, Any]:
    """One bad input (often on one rank only): every rank must raise, naming the rank,
    the value and the fix, and nothing may leak."""
    from moonep_ep.errors import MoonEPError
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections

    rank = ctx.rank
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    result: dict[str, Any] = {}
    projs = ffn_projections(256, 128)
    store = None
    try:
        if case == "alloc_negative_size":
            SymmetricMemory.allocate([-5 if rank == 1 else GRAN], driver=driver).close()
        elif case == "alloc_disagree_handle_type":
            os.environ["MOONEP_EP_HANDLE_TYPE"] = "fd" if rank == 0 else "auto"
            SymmetricMemory.allocate([GRAN], driver=driver).close()
        elif case == "alloc_disagree_granularity":
            d2 = HostDriver(rank=rank, granularity=GRAN * (2 if rank == 1 else 1))
            SymmetricMemory.allocate([4 * GRAN], driver=d2).close()
        elif case == "tensor_too_big":
            symm = SymmetricMemory.allocate([GRAN], driver=driver)
            try:
                view = symm.map_chunks()
                try:
                    with symm.comm.step("view"):
                        view.tensor(torch.bfloat16, (ctx.world_size * GRAN,))
                finally:
                    view.close()
            finally:
                symm.close()
        else:
            store = ShardedExpertStore(num_layers=2, num_experts=8, projections=projs, num_slots=4,
                                       driver=driver)
            shape = {p.name: p.shape for p in projs}
            if case == "load_wrong_dtype":
                store.load(lambda layer, proj, e: torch.zeros(
                    shape[proj], dtype=torch.float32 if rank == 1 else torch.bfloat16))
            elif case == "load_wrong_shape":
                store.load(lambda layer, proj, e: torch.zeros(
                    (shape[proj][0] + (8 if rank == 0 else 0), shape[proj][1]), dtype=torch.bfloat16))
            elif case == "load_layer_wrong_shape":
                epn = 8 // ctx.world_size
                tensors = {p.name: torch.zeros((epn + (1 if rank == 1 else 0), *p.shape), dtype=torch.bfloat16)
                           for p in projs}
                store.load_layer(0, tensors)
            elif case == "view_unknown_layer":
                with store.symm.comm.step("views"):
                    store.gen_a(5 if rank == 0 else 0, "gate")
        result["raised"] = None
    except MoonEPError as exc:
        result["raised"] = type(exc).__name__
        result["message"] = str(exc)
    finally:
        os.environ.pop("MOONEP_EP_HANDLE_TYPE", None)
        if store is not None:
            store.close()
    result["leaks"] = leaks(driver, before)
    return result
