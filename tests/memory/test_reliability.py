"""Reliability of the symmetric-memory path: collective fall-backs, peer loss, leaks,
fd-exchange security (issue: reliability and security).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver
from moonep_ep.memory.symmetric import SymmetricMemory
from moonep_ep.launch import RankFailure, run_ranks
from tests.support.cli import moonep_ep_json
from tests.support.memory import GRAN, emulated_cuda_driver, holdings, leaks


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
    from moonep_ep.testing.cuda_emulator import EmulatedCudaApi

    # A node where fabric works (IMEX domain), so only the injected refusal stops it.
    api = EmulatedCudaApi(f"H100x{ctx.world_size},imex=domain,multicast=0", visible=None, record=True)
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
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots

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
            full = {p.name: store.pull_view(step % 2, p.name) for p in store.projections}
            wait_for_slots(pull_slots(full, [(victim * 3 + b) % store.num_experts for b in range(3)],
                                      store.num_experts)[2])
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
    inodes = comm.all_gather_object(os.fstat(fd).st_ino, "test: inodes")
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
    comm.barrier("test: fds closed")
    out["dir_removed"] = not os.path.exists(ex.last_directory)
    if rank == 0:
        out["stale_swept"] = not os.path.exists(stale)
        out["live_kept"] = os.path.exists(live)
        out["fresh_dir"] = out.get("dir") not in (stale, live)
        os.rmdir(live)
    return out


def cuda_bind_retry(ctx: Any, times: int, mode: str = "auto") -> dict[str, Any]:
    """SYSTEM_NOT_READY (802) from cuMulticastBindMem on rank 1 (CUDA driver emulator),
    under ``MOONEP_EP_MULTICAST=mode``."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.testing.cuda_emulator import EmulatedCudaApi

    os.environ["MOONEP_EP_MULTICAST"] = mode
    api = EmulatedCudaApi(f"H100x{ctx.world_size},fabric=0", visible=None, record=True)
    if ctx.rank == 1:
        api.fail("cuMulticastBindMem", "CUDA_ERROR_SYSTEM_NOT_READY", times)
    driver = CudaDriver(device=ctx.rank, rank=ctx.rank, api=api)
    out = _allocate_map_close(driver, multicast=True)
    out["binds"] = sum(1 for n, _ in api.calls if n == "cuMulticastBindMem")
    out["calls"] = [n for n, _ in api.calls]
    out["live"] = api.live()
    return out


def bad_input(ctx: Any, case: str, driver_kind: str = "host") -> dict[str, Any]:
    """One bad input (often on one rank only): every rank must raise, naming the rank,
    the value and the fix, and nothing may leak. ``driver_kind``: ``host``, or ``cuda`` (the
    CUDA driver over the emulator; granularity 2 MiB, or 4 MiB on rank 1 where it must differ)."""
    from moonep_ep.errors import MoonEPError
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections

    rank = ctx.rank
    odd_granularity = case == "alloc_disagree_granularity" and rank == 1
    if driver_kind == "host":
        driver: Any = HostDriver(rank=rank, granularity=GRAN * (2 if odd_granularity else 1))
    else:
        driver = emulated_cuda_driver(rank, "H100x2" + (",fd_rec=4MiB" if odd_granularity else ""))
    before = holdings(driver)
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
            SymmetricMemory.allocate([4 * GRAN], driver=driver).close()
        elif case == "tensor_too_big":
            symm = SymmetricMemory.allocate([GRAN], driver=driver)
            try:
                view = symm.map_chunks()
                try:
                    with symm.comm.step("view"):
                        view.tensor(torch.bfloat16, (view.size // 2 + 1,))  # one element past the end
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
                    store.pull_view(5 if rank == 0 else 0, "gate")
        result["raised"] = None
    except MoonEPError as exc:
        result["raised"] = type(exc).__name__
        result["message"] = str(exc)
    finally:
        os.environ.pop("MOONEP_EP_HANDLE_TYPE", None)
        if store is not None:
            store.close()
    result["leaks"] = leaks(driver, before)
    driver.close()
    return result


def bad_inputs_all(ctx: Any, driver_kind: str) -> dict[str, Any]:
    """Every bad-input case in turn on the same ranks (one process start for all)."""
    return {case: bad_input(ctx, case, driver_kind) for case in sorted(BAD_INPUTS)}


pytestmark = pytest.mark.slow


@pytest.mark.cuda_emulated
def test_fabric_refused_on_one_rank_falls_back_to_posix_fds_on_every_rank():
    results = run_ranks(cuda_fabric_fallback, 2, args=(1, "cuMemCreate", 1))
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["handle_type"] == "fd" and "fell back to POSIX fds" in res["reason"]
        assert "[1]" in res["reason"]                          # names the refusing rank
        # First attempt asked for fabric on every rank; the retry for POSIX fds only.
        assert "FABRIC" in res["creates"][0] and "POSIX" in res["creates"][-1]
        assert all(v == 0 for v in res["live"].values()), res["live"]


@pytest.mark.cuda_emulated
def test_fabric_refused_for_good_fails_every_rank_without_leaks():
    # NOT_PERMITTED on the fd export too: nothing left to fall back to.
    results = run_ranks(cuda_fabric_fallback, 2, args=(0, "cuMemExportToShareableHandle", 5))
    for res in results:
        assert "error" in res and "NOT_PERMITTED" in res["error"] and "rank 0" in res["error"]
        assert all(v == 0 for v in res["live"].values()), res["live"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkilled_rank_makes_every_survivor_raise_in_bounded_time_without_leaks(point):
    timeout = 10.0
    with pytest.raises(RankFailure) as info:
        run_ranks(killed_peer, 3, args=(point, 1), env={"MOONEP_EP_TIMEOUT_S": str(timeout)},
                  group_timeout_s=timeout, timeout_s=120)
    failure = info.value
    assert set(failure.errors) == {1} and "-9" in failure.errors[1]  # the victim, SIGKILLed
    for rank in (0, 2):
        res = failure.results[rank]
        assert res["error"], (point, rank, res)
        assert "lost contact with a peer" in res["error"] or "rank 1" in res["error"], res["error"]
        assert f"[rank {rank}]" in res["error"]
        assert res["seconds_to_error"] <= 2 * timeout + 5, res
        assert res["leaks"] == {}, (point, rank, res["leaks"])


def test_fd_exchange_rejects_foreign_sender_sweeps_stale_dirs_and_hands_out_sealed_cloexec_fds():
    r0, r1 = run_ranks(exchange_security, 2)
    assert r0["dir_mode"] == "0o700" and r0["fresh_dir"]
    assert r0["foreign"] in ("sent", "cut off")          # it connected (and sent, unless cut off)
    assert len(r1["rejected"]) == 1 and "not a member" in r1["rejected"][0]
    for res in (r0, r1):
        assert res["peer_inode_ok"]                      # the member's fd, not the foreign one
        assert res["cloexec"] and res["sealed"] and res["dir_removed"]
    assert r0["stale_swept"] and r0["live_kept"]         # dead run's directory gone, live run's kept


@pytest.mark.cuda_emulated
def test_cuda_multicast_bind_not_ready_is_retried_then_fails_collectively():
    """Retried in lockstep; when the retries run out, MOONEP_EP_MULTICAST=on fails on every rank, and
    auto (below) goes on without multicast on every rank (meta-pytorch/torchcomms#3130)."""
    ok = run_ranks(cuda_bind_retry, 2, args=(2,))
    for res in ok:
        assert "error" not in res and res["multicast"]
        assert all(v == 0 for v in res["live"].values())
    assert ok[1]["binds"] == 3 and ok[0]["binds"] == 1   # rank 1 retried twice, rank 0 bound once
    degraded = run_ranks(cuda_bind_retry, 2, args=(100, "auto"))
    for res in degraded:
        assert "error" not in res and res["multicast"] is False and all(v == 0 for v in res["live"].values())
        names = res["calls"]  # rank 0 bound: it unbinds while its memory is still held
        if "cuMulticastUnbind" in names:
            assert names.index("cuMulticastUnbind") < len(names) - names[::-1].index("cuMemRelease") - 1
    assert "cuMulticastUnbind" in degraded[0]["calls"]
    failed = run_ranks(cuda_bind_retry, 2, args=(100, "on"))
    for res in failed:
        assert "SYSTEM_NOT_READY" in res["error"] and "rank 1" in res["error"]
        assert all(v == 0 for v in res["live"].values()), res["live"]
        names = res["calls"]
        # A member that did bind unbinds before its memory is released.
        if "cuMulticastUnbind" in names:
            assert names.index("cuMulticastUnbind") < len(names) - names[::-1].index("cuMemRelease") - 1


BAD_INPUTS = {
    "alloc_negative_size": ("rank 1", "chunk sizes must be >= 0"),
    "alloc_disagree_handle_type": ("disagree on MOONEP_EP_HANDLE_TYPE", "Fix"),
    "alloc_disagree_granularity": ("different granularities", "MOONEP_EP_HOST_GRANULARITY"),
    "tensor_too_big": ("does not fit", "Fix"),
    "load_wrong_dtype": ("rank 1", "wrong dtype"),
    "load_wrong_shape": ("rank 0", "wrong shape"),
    "load_layer_wrong_shape": ("rank 1", "wrong shape"),
    "view_unknown_layer": ("rank 0", "layers are 0..1"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_on_every_rank_with_rank_value_and_fix(case):
    needles = BAD_INPUTS[case]
    for rank, res in enumerate(run_ranks(bad_input, 2, args=(case,), timeout_s=120)):
        assert res["raised"] in ("CollectiveError", "ConfigError"), (case, rank, res)
        for needle in needles:
            assert needle in res["message"], (case, rank, res["message"])
        assert "Fix" in res["message"] and f"[rank {rank}]" in res["message"]
        assert res["leaks"] == {}, (case, rank, res["leaks"])


@pytest.mark.cuda_emulated
def test_bad_input_over_the_cuda_emulator_raises_on_every_rank_and_leaks_nothing():
    """The same bad inputs through CudaDriver over the emulator: the CUDA path raises on every rank
    with rank, value and fix, and leaves nothing in the emulated driver."""
    for rank, per_case in enumerate(run_ranks(bad_inputs_all, 2, args=("cuda",), timeout_s=240)):
        assert set(per_case) == set(BAD_INPUTS)
        for case, res in per_case.items():
            assert res["raised"] in ("CollectiveError", "ConfigError"), (case, rank, res)
            for needle in BAD_INPUTS[case]:
                assert needle in res["message"], (case, rank, res["message"])
            assert "Fix" in res["message"] and f"[rank {rank}]" in res["message"]
            assert res["leaks"] == {}, (case, rank, res["leaks"])


@pytest.mark.timeout(1500)
def test_selftest_soak_200_cycles_leaks_nothing():

    out = moonep_ep_json("selftest", "--ranks", "4", "--driver", "host", "--cycles", "200", timeout=1200)
    assert out["ok"] and out["cycles"] == 200
    assert out["leaked_fds"] == 0 and out["leaked_mappings"] == 0 and out["leaked_shm_bytes"] == 0
    assert out["rss_growth_bytes"] < 1 << 20



@pytest.mark.parametrize("n", [0, 1, 250, 251, 252, 3 * 251 + 7, (1 << 20) + 3])
def test_selftest_pattern_is_the_closed_form_for_every_byte(n):
    """The selftest's pattern is tiled from one 251-byte period: byte i must still be (131 i + c) mod 251,
    computed here over every byte, and differ between the writers of one chunk."""
    from moonep_ep.tools.commands.selftest import _pattern

    i = torch.arange(n, dtype=torch.int64)
    for owner, writer in [(0, 0), (3, 2), (127, 126)]:
        expected = ((i * 131 + owner * 17 + writer * 29 + 7) % 251).to(torch.uint8)
        assert torch.equal(_pattern(owner, writer, n, "cpu"), expected)
    if n > 1:
        assert not torch.equal(_pattern(1, 1, n, "cpu"), _pattern(1, 0, n, "cpu"))
