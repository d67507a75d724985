"""The NVLink clique a GPU reports and whether multicast is used, decided in this process.

* ``cuda_probe.fabric_clique``: the unicast and multicast pointer cliques of a
  GPU, trusted only with a non-zero fabric cluster UUID and a COMPLETED fabric
  state (as NCCL, NVSHMEM, FlashInfer and vLLM require), else unknown with the
  reason; over the CUDA emulator, with a driver call answering what an older
  binding, a driver error or a registering fabric answers.
* ``SymmetricMemory``'s multicast set-up: its size, the bind retried in
  lockstep, going on without multicast (``MOONEP_EP_MULTICAST=auto``) or
  failing with the fix (``on``), and where a multicast write lands. A one-rank
  gloo group in this process runs the same collective steps as a group of
  ranks (``tests/memory/test_cuda_emulator_realism.py`` runs two ranks in
  spawned processes); a host driver whose bind fails the first ``n`` times
  stands for a Fabric Manager that is not ready yet.
* ``multimem``: the multicast store's launch shape, its module's loading and
  unloading, and its refusal of what would fault inside the kernel.

Every expected text is typed out from the wording the code means to print.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
import uuid

import pytest
import torch
import torch.distributed as dist

from moonep_ep.errors import CollectiveError, ConfigError, DriverError, PeerLostError
from moonep_ep.memory import cuda_probe, multimem
from moonep_ep.memory import symmetric as sym
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.memory.exchange import ExchangeDecision
from moonep_ep.memory.group import Lockstep
from moonep_ep.memory.host import HostDriver
from moonep_ep.memory.symmetric import SymmetricMemory, _driver_failure
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi, NodeSpec

MiB = 1 << 20
FABRIC = HandleType.FABRIC
EMULATED = pytest.mark.cuda_emulated   # the tests over the CUDA driver emulator (``make test-emulated`` runs them)
NVL72 = "GB200x72,hosts=18,cliques=2,mc_cliques=6,imex=domain,cuda=13.4"


def _cuda(node: str, host: int | None = None) -> CudaDriver:
    return CudaDriver(device=0, rank=0, api=EmulatedCudaApi(node, visible="0", host=host, record=True))


def _fail(api, code: str, *outputs):
    """A bindings-style return of ``code`` (what ``_api`` methods return for a failure)."""
    return lambda *args: (getattr(api._real.CUresult, code), *outputs)


# -- the clique --------------------------------------------------------------------------------------------------

def _clique(drv: CudaDriver) -> tuple[str, str, str]:
    drv.capabilities()                                  # the probe sets the device the clique calls take
    return cuda_probe.fabric_clique(drv)


@EMULATED
def test_a_gpu_in_a_registered_fabric_reports_its_cluster_and_both_pointer_cliques():
    spec = NodeSpec.parse(NVL72)
    cluster = str(uuid.UUID(bytes=spec.cluster_uuid()))
    drv = _cuda(NVL72, host=9)                          # GPU 36: unicast clique of hosts 9-17, multicast of 9-11
    assert _clique(drv) == (f"{cluster}/{spec.clique_of_gpu(36):#x}",
                            f"{cluster}/{spec.multicast_clique_of_gpu(36):#x}", "")
    assert spec.clique_of_gpu(36) != spec.multicast_clique_of_gpu(36)   # the setup tells the two apart
    caps = drv.capabilities()
    assert (caps.clique, caps.multicast_clique) == _clique(drv)[:2] and "clique" not in caps.reasons
    drv.close()


@EMULATED
def test_the_first_clique_of_each_kind_among_those_reported_is_taken():
    drv = _cuda(NVL72, host=0)
    api = drv.api
    kind = api.CUcliqueType
    uni, multi = int(kind.CU_CLIQUE_TYPE_UNICAST_POINTER), int(kind.CU_CLIQUE_TYPE_MULTICAST_POINTER)
    info = lambda t, i: types.SimpleNamespace(type=t, id=i)                    # noqa: E731
    counts = []
    cluster = str(uuid.UUID(bytes=NodeSpec.parse(NVL72).cluster_uuid()))
    api.cuDeviceGetCliqueCount = lambda dev: (api._real.CUresult.CUDA_SUCCESS, 3)

    def infos(*entries, got=None):
        def call(count, dev):
            counts.append(count)
            return api._real.CUresult.CUDA_SUCCESS, list(entries), len(entries) if got is None else got
        return call

    api.cuDeviceGetCliqueInfo = infos(info(multi, 0x9), info(uni, 0x5), info(uni, 0x6), info(multi, 0xA))
    assert _clique(drv) == (f"{cluster}/0x5", f"{cluster}/0x9", "") and counts[-1] == 3
    api.cuDeviceGetCliqueInfo = infos(info(uni, 0x5), info(multi, 0x9), got=1)   # only the first one counts
    assert _clique(drv) == (f"{cluster}/0x5", "", "")
    api.cuDeviceGetCliqueInfo = infos(info(multi, 0x9))
    assert _clique(drv) == ("", "", "cuDeviceGetCliqueInfo reported no unicast pointer clique")
    drv.close()


@EMULATED
def test_an_unregistered_fabric_or_an_unfinished_registration_leaves_the_clique_unknown(monkeypatch):
    for state in ("registering", "outside"):           # a zero cluster UUID
        drv = _cuda(f"H100x8,cuda=13.4,fabric_state={state}")
        assert _clique(drv) == ("", "", "the fabric cluster UUID is all zeros (fabric registration in progress, "
                                        "or no fabric)")
        drv.close()
    drv = _cuda(NVL72, host=0)                          # a UUID already, but NVML says the registration goes on
    monkeypatch.setattr(drv.api, "gpu_fabric_state", lambda dev: "IN_PROGRESS")
    assert _clique(drv) == ("", "", "the GPU's fabric state is IN_PROGRESS, not COMPLETED (NVML)")
    drv.close()


@EMULATED
def test_a_driver_or_bindings_without_the_clique_calls_leave_it_unknown_naming_the_call():
    not_supported = ("the driver cannot report its NVLink clique: [rank 0] cuda driver: {} -> "
                     "CUDA_ERROR_NOT_FOUND: failed")
    for call, outputs in (("cuDeviceGetFabricClusterUuid", (None,)), ("cuDeviceGetCliqueCount", (0,)),
                          ("cuDeviceGetCliqueInfo", ([], 0))):
        drv = _cuda(NVL72, host=0)
        setattr(drv.api, call, _fail(drv.api, "CUDA_ERROR_NOT_FOUND", *outputs))
        assert _clique(drv) == ("", "", not_supported.format(call))
        drv.close()
    single = _cuda("H100x8,cuda=13.4")                  # off a fabric: the driver's NOT_SUPPORTED
    assert _clique(single) == ("", "", "the driver cannot report its NVLink clique: [rank 0] cuda driver: "
                                       "cuDeviceGetFabricClusterUuid -> CUDA_ERROR_NOT_SUPPORTED: this device/driver "
                                       "does not support the requested handle type, VMM or multicast; see "
                                       "capabilities()")
    single.close()
    old = _cuda(NVL72, host=0)                          # bindings older than 13.4: no such function

    def missing(*args):
        raise AttributeError("module 'cuda.bindings.driver' has no attribute 'cuDeviceGetCliqueInfo'")

    old.api.cuDeviceGetCliqueInfo = missing
    assert _clique(old) == ("", "", "these cuda-bindings have no cuDeviceGetCliqueInfo (new in 13.4)")
    old.close()


# -- whether multicast is used -----------------------------------------------------------------------------------

@pytest.fixture
def one_rank(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("MOONEP_EP_HANDLE_TYPE", "fd")
    monkeypatch.delenv("MOONEP_EP_MULTICAST", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _FlakyBind(HostDriver):
    """A host driver whose multicast bind fails ``failures`` times with ``code`` first (a Fabric Manager that is
    not ready, or out of resources); every bind is counted."""

    def __init__(self, failures: int, code: str):
        super().__init__(rank=0)
        self.failures, self.code, self.binds = failures, code, 0

    def multicast_bind(self, *args):
        self.binds += 1
        if self.binds <= self.failures:
            raise self.error("multicast_bind", f"bind {self.binds} refused", self.code)
        return super().multicast_bind(*args)


def test_driver_failures_are_those_where_every_failing_rank_failed_in_a_driver_call():
    assert _driver_failure(CollectiveError("s", {0: "DriverError: a", 3: "DriverError: b"})) is True
    assert _driver_failure(CollectiveError("s", {0: "DriverError: a", 1: "ConfigError: b"})) is False
    assert _driver_failure(CollectiveError("s", {})) is False
    assert _driver_failure(PeerLostError("s", 0, "DriverError: gone", 30.0)) is False


def test_multicast_over_chunk_0_is_bound_and_a_write_lands_in_every_member(one_rank):
    with HostDriver(rank=0) as drv:                     # granularity 2 MiB
        symm = SymmetricMemory.allocate([4 * MiB, 2 * MiB], driver=drv, multicast=True)
        view = symm.map_chunks(0)
        mc = symm._multicast
        assert symm.has_multicast and symm.decision.multicast and (mc.size, mc.va, mc.bound) == (4 * MiB, None, True)
        symm.multicast_write(0, torch.full((4,), 9, dtype=torch.uint8))                   # the first byte on
        symm.multicast_write(16, torch.arange(32, dtype=torch.uint8))
        symm.multicast_write(4 * MiB - 4, torch.tensor([0x01020304], dtype=torch.int32))   # the last 4 bytes
        symm.multicast_write(64, torch.arange(16, dtype=torch.uint8)[::2])                  # strided: 8 bytes
        got = view.bytes()
        assert got[16:48].tolist() == list(range(32)) and got[-4:].tolist() == [4, 3, 2, 1]
        assert got[64:72].tolist() == [0, 2, 4, 6, 8, 10, 12, 14] and int(got[72]) == 0
        assert got[:5].tolist() == [9, 9, 9, 9, 0]
        too_far = "[rank 0] multicast write [{}, +4) exceeds the 4194304-byte multicast object"
        for offset in (4 * MiB - 3, -1):
            with pytest.raises(ConfigError) as e:
                symm.multicast_write(offset, torch.zeros(4, dtype=torch.uint8))
            assert str(e.value) == too_far.format(offset)
        del got
        view.close()
        symm.close()
        small = SymmetricMemory.allocate([4 * MiB], driver=drv, multicast=True, multicast_bytes=1)
        assert small._multicast.size == 2 * MiB          # 1 byte rounded up to the multicast granularity
        small.close()
        exact = SymmetricMemory.allocate([4 * MiB], driver=drv, multicast=True, multicast_bytes=4 * MiB)
        assert exact._multicast.size == 4 * MiB and exact.has_multicast
        exact.close()
        assert not any(drv.live_objects().values())


def test_without_multicast_asked_there_is_none_and_a_write_names_the_decision(one_rank):
    with HostDriver(rank=0) as drv:
        symm = SymmetricMemory.allocate([2 * MiB], driver=drv)
        assert not symm.has_multicast and symm._multicast is None
        with pytest.raises(RuntimeError) as e:
            symm.multicast_write(0, torch.zeros(16, dtype=torch.uint8))
        # (MOONEP_EP_HANDLE_TYPE=fd, set here for the emulator: the vote's reason is "forced")
        assert str(e.value) == "[rank 0] no multicast object (decision: forced; multicast off)"
        symm.close()


def test_a_multicast_size_that_is_not_positive_or_does_not_fit_chunk_0_is_refused_not_gone_without(one_rank):
    text = ("ConfigError: [rank 0] multicast size {} (rounded up to the multicast granularity 2097152: {}) must be "
            "positive and fit every rank's chunk 0 (smallest 4194304). Fix: enlarge chunk 0 or pass a smaller "
            "multicast_bytes")
    with HostDriver(rank=0) as drv:
        for wanted, size in ((0, 0), (-5, 0), (4 * MiB + 1, 6 * MiB)):
            with pytest.raises(CollectiveError) as e:
                SymmetricMemory.allocate([4 * MiB], driver=drv, multicast=True, multicast_bytes=wanted)
            assert (e.value.step, e.value.failures) == ("multicast size", {0: text.format(wanted, size)})
        assert not any(drv.live_objects().values())


def test_a_bind_that_is_not_ready_is_retried_in_lockstep_with_growing_pauses(one_rank, monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(sym.time, "sleep", pauses.append)
    monkeypatch.setenv("MOONEP_EP_MC_BIND_RETRIES", "2")
    with _FlakyBind(2, "CUDA_ERROR_SYSTEM_NOT_READY") as drv:
        symm = SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
        assert symm.has_multicast and drv.binds == 3 and pauses == [0.05, 0.1]
        assert symm.decision.multicast and symm.decision.reason == "forced"
        symm.close()
    assert not any(drv.live_objects().values())


def test_binds_that_stay_refused_turn_multicast_off_on_every_rank_with_the_reason(one_rank, monkeypatch, caplog):
    pauses: list[float] = []
    monkeypatch.setattr(sym.time, "sleep", pauses.append)
    monkeypatch.setenv("MOONEP_EP_MC_BIND_RETRIES", "2")
    caplog.set_level(logging.WARNING, logger="moonep_ep.memory")
    why = ("rank 0 failed at 'multicast bind (attempt {n})': DriverError: [rank 0] host driver: multicast_bind -> "
           "{code}: bind {n} refused")
    for failures, code, binds, n, waited in ((3, "CUDA_ERROR_SYSTEM_NOT_READY", 3, 3, [0.05, 0.1]),
                                             (1, "CUDA_ERROR_ILLEGAL_STATE", 1, 1, [])):
        pauses.clear()
        caplog.clear()
        with _FlakyBind(failures, code) as drv:
            symm = SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
            expected = why.format(n=n, code=code)
            assert (drv.binds, pauses, symm.has_multicast, symm.decision.multicast) == (binds, waited, False, False)
            assert symm.decision.reason == f"forced; multicast: off ({expected})"
            assert [r.getMessage() for r in caplog.records] == [
                f"[rank 0] multicast: off on every rank (MOONEP_EP_MULTICAST=auto): {expected}"]
            assert drv.live_objects()["multicast_objects"] == 0    # what multicast acquired is released
            symm.close()
        assert not any(drv.live_objects().values())
    monkeypatch.setenv("MOONEP_EP_MC_BIND_RETRIES", "0")                 # no retry at all
    pauses.clear()
    with _FlakyBind(1, "CUDA_ERROR_SYSTEM_NOT_READY") as drv:
        symm = SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
        assert (drv.binds, pauses, symm.has_multicast) == (1, [], False)
        assert "'multicast bind (attempt 1)'" in symm.decision.reason
        symm.close()


MULTICAST_FIX = ("Fix: MOONEP_EP_MULTICAST=auto goes on without multicast when any rank's multicast setup fails "
                 "(or off skips it); to keep multicast, free other multicast objects (MULTICAST_RESOURCE_FULL) or "
                 "restart the Fabric Manager (ILLEGAL_STATE, SYSTEM_NOT_READY)")


def test_multicast_on_turns_a_setup_failure_into_an_error_with_the_fix_and_leaves_nothing(one_rank, monkeypatch):
    monkeypatch.setenv("MOONEP_EP_MULTICAST", "on")
    monkeypatch.setenv("MOONEP_EP_MC_BIND_RETRIES", "0")
    with _FlakyBind(1, "CUDA_ERROR_ILLEGAL_STATE") as drv:
        with pytest.raises(CollectiveError) as e:
            SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
        failure = "DriverError: [rank 0] host driver: multicast_bind -> CUDA_ERROR_ILLEGAL_STATE: bind 1 refused"
        assert (e.value.step, e.value.failures, e.value.rank) == ("multicast bind (attempt 1)", {0: failure}, 0)
        assert str(e.value) == ("[rank 0] collective step 'multicast bind (attempt 1)' failed on rank(s) [0]:\n"
                                f"  rank 0: {failure}\n  (MOONEP_EP_MULTICAST=on) {MULTICAST_FIX}")
        assert isinstance(e.value.__cause__, CollectiveError) and e.value.__cause__ is not e.value
        assert not any(drv.live_objects().values())
    with _FlakyBind(0, "") as drv:                                       # the control: nothing fails, multicast on
        symm = SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
        assert symm.has_multicast and symm.decision.multicast_forced
        symm.close()


def test_the_reason_names_the_lowest_failing_rank_its_first_line_and_every_failing_rank(one_rank, caplog):
    """Two ranks' failures (as a group's lockstep reports them), the first message of several lines and over
    300 characters: the reason keeps rank 0's first line, cut at 300 characters, and lists both ranks."""
    with HostDriver(rank=0) as drv:
        symm = SymmetricMemory.allocate([2 * MiB], driver=drv)
        symm.decision = dataclasses.replace(symm.decision, multicast=True)
        long_line = "DriverError: " + "x" * 400
        failures = {1: "DriverError: rank one\nsecond line", 0: long_line + "\nnot this line"}

        def fail(undo, multicast_bytes):
            raise CollectiveError("multicast create", failures, rank=0)

        symm._setup_multicast = fail
        caplog.set_level(logging.WARNING, logger="moonep_ep.memory")
        symm._setup_multicast_or_go_without(None, None)
        why = f"rank 0 failed at 'multicast create': {long_line[:300]} (rank(s) [0, 1] failed)"
        assert symm.decision.reason == f"forced; multicast off; multicast: off ({why})"
        assert not symm.decision.multicast
        assert caplog.records[-1].getMessage().endswith(why)
        # a failure that is not the driver's (bad input, a lost peer) is raised as it is
        def bad(undo, multicast_bytes):
            raise CollectiveError("multicast size", {0: "ConfigError: no"}, rank=0)

        symm._setup_multicast = bad
        with pytest.raises(CollectiveError, match="multicast size"):
            symm._setup_multicast_or_go_without(None, None)
        symm.close()


@EMULATED
def test_hardware_multicast_is_mapped_and_written_with_multimem_from_any_alignment(one_rank):
    """On CUDA (the emulator) the multicast object is mapped at a reserved address and a write is a multimem
    store there: a source view 1 byte into its buffer is copied to an aligned buffer first (a v4 load of it
    would fault inside the kernel); a failure at the map step turns multicast off like any other."""
    drv = _cuda("H100x2")
    symm = SymmetricMemory.allocate([2 * MiB], driver=drv, multicast=True)
    mc = symm._multicast
    assert mc.va is not None and mc.va[1] == 2 * MiB and mc.mapped and symm.has_multicast
    view = symm.map_chunks(0)
    stored = []
    real_store = drv.multimem_store
    drv.multimem_store = lambda addr, data: (stored.append((addr, data.data_ptr())), real_store(addr, data))
    buffer = torch.arange(48, dtype=torch.uint8)
    symm.multicast_write(32, buffer[1:33])                              # 32 bytes from an odd address
    aligned = torch.arange(100, 116, dtype=torch.uint8)
    symm.multicast_write(0, aligned)                                    # aligned already: stored from itself
    drv.synchronize()
    assert view.bytes()[32:64].tolist() == list(range(1, 33)) and drv.api.errors == []
    assert view.bytes()[:16].tolist() == list(range(100, 116))
    assert [addr - mc.va[0] for addr, _ in stored] == [32, 0]
    assert stored[0][1] % 16 == 0 and stored[0][1] != buffer[1:].data_ptr() and stored[1][1] == aligned.data_ptr()
    del drv.multimem_store
    view.close()
    symm.close()
    drv.close()
    broken = _cuda("H100x2,mc_fail=map:MULTICAST_RESOURCE_FULL")
    symm = SymmetricMemory.allocate([2 * MiB], driver=broken, multicast=True)
    assert not symm.has_multicast and "failed at 'multicast map'" in symm.decision.reason
    assert broken.live_objects()["multicast"] == 0 and broken.live_objects()["reservations"] == 0
    symm.close()
    broken.close()


# -- rank 1 of two: the multicast object is imported -------------------------------------------------------------

class _RankOneOfTwo:
    """The lockstep of rank 1 in a group of two, rank 0 played here: when a step (or a gather) ends, rank 0's
    action for it runs (create and export the multicast object, add its GPU) and its result is rank 0's part of
    what the step gathers; every step's name is kept. A failure inside rank 1's step body is raised as the
    group's CollectiveError would be."""

    rank, world_size = 1, 2

    def __init__(self, actions: dict):
        self.actions, self.steps = actions, []
        self.rounds = {"metadata": 0, "handle_exchange": 0}

    def _rank0(self, name: str):
        self.steps.append(name)
        action = self.actions.get(name)
        return action() if action else None

    @contextlib.contextmanager
    def step(self, name: str):
        state = Lockstep(name)
        try:
            yield state
        except Exception as exc:                        # noqa: BLE001 - what GroupComm._settle reports
            self.steps.append(name)
            raise CollectiveError(name, {1: f"{type(exc).__name__}: {exc}"}, rank=1) from exc
        state.gathered = [self._rank0(name), state.payload]

    def all_gather_object(self, obj, step: str):
        return [self._rank0(step), obj]


def _rank_one(node: str = "H100x2,imex=domain", exchange=None):
    """Rank 0's and rank 1's drivers (GPUs 0 and 1 of one emulated node) and rank 1's SymmetricMemory as
    ``allocate`` leaves it before the multicast set-up: FABRIC handles, chunk 0 of 2 MiB on both ranks."""
    drv0 = CudaDriver(device=0, rank=0, api=EmulatedCudaApi(node, visible="0", record=True))
    drv1 = CudaDriver(device=0, rank=1, api=EmulatedCudaApi(node, visible="1", record=True))
    rank0: dict = {}

    def create():
        rank0["mc"] = drv0.multicast_create(2 * MiB, 2, FABRIC)

    comm = _RankOneOfTwo({"multicast create": create,
                          "fabric handle exchange": exchange or (lambda: [bytes(drv0.multicast_export(rank0["mc"],
                                                                                                      FABRIC))]),
                          "multicast add device": lambda: drv0.multicast_add_device(rank0["mc"])})
    symm = SymmetricMemory()
    symm.comm, symm.driver = comm, drv1
    symm.decision = ExchangeDecision(FABRIC, True, "fabric")
    symm.chunk_sizes = [[2 * MiB], [2 * MiB]]
    symm._own = [drv1.create(2 * MiB, FABRIC)]
    return drv0, drv1, rank0, comm, symm


def _release(drv0, drv1, rank0, symm) -> None:
    drv1.release(symm._own[0])
    if "mc" in rank0:
        drv0.multicast_release(rank0["mc"])
    for drv in (drv0, drv1):
        assert not any(drv.live_objects().values()), drv.live_objects()
        drv.close()


STEPS = ["multicast size", "multicast create", "fabric handle exchange", "multicast import", "multicast add device",
         "multicast bind (attempt 1): share outcomes"]


@EMULATED
def test_rank_1_imports_rank_0s_multicast_object_adds_its_gpu_binds_and_maps_it():
    drv0, drv1, rank0, comm, symm = _rank_one()
    undo = contextlib.ExitStack()
    symm._setup_multicast_or_go_without(undo, None)
    mc = symm._multicast
    assert comm.steps == [*STEPS, "multicast map"]
    assert symm.has_multicast and (mc.size, mc.bound, mc.mapped, mc.va[1]) == (2 * MiB, True, True, 2 * MiB)
    assert drv1.handle_size(mc.handle) == 2 * MiB                      # imported with its size
    assert drv1.live_objects()["multicast"] == 1 and drv0.live_objects()["multicast"] == 1
    undo.close()                                                        # a later step failed: everything undone
    assert symm._multicast is None and drv1.live_objects()["multicast"] == 0
    assert drv1.live_objects()["binds"] == 0 and drv1.live_objects()["reservations"] == 0
    _release(drv0, drv1, rank0, symm)


@EMULATED
def test_rank_1s_refused_bind_turns_multicast_off_after_releasing_its_import():
    drv0, drv1, rank0, comm, symm = _rank_one("H100x2,imex=domain,mc_fail=bind:ILLEGAL_STATE")
    symm._setup_multicast_or_go_without(contextlib.ExitStack(), None)
    assert comm.steps == [*STEPS, "multicast off: release what multicast acquired"]
    assert not symm.has_multicast and not symm.decision.multicast and symm._multicast is None
    assert symm.decision.reason.startswith(
        "fabric; multicast: off (rank 1 failed at 'multicast bind (attempt 1)': DriverError: [rank 1] cuda driver: "
        "cuMulticastBindMem -> CUDA_ERROR_ILLEGAL_STATE: ")
    assert drv1.live_objects()["multicast"] == 0
    _release(drv0, drv1, rank0, symm)


@EMULATED
def test_a_peer_lost_during_the_handle_exchange_is_raised_as_it_is():
    def lost():
        raise PeerLostError("fabric handle exchange", 1, "rank 0 went away", 30.0)

    drv0, drv1, rank0, comm, symm = _rank_one(exchange=lost)
    undo = contextlib.ExitStack()
    with pytest.raises(PeerLostError, match="rank 0 went away"):
        symm._setup_multicast_or_go_without(undo, None)
    undo.close()
    assert symm.decision.multicast and comm.steps == STEPS[:3]          # not turned off: the group is broken
    _release(drv0, drv1, rank0, symm)


# -- the multimem store -----------------------------------------------------------------------------------------

def test_the_launch_shape_covers_every_16_byte_vector_with_at_most_1024_blocks():
    assert multimem.launch_shape(0) == (1, 256, 0)
    assert multimem.launch_shape(16) == (1, 256, 1)
    assert multimem.launch_shape(20) == (1, 256, 1)                    # a tail under 16 bytes is no vector
    assert multimem.launch_shape(256 * 16) == (1, 256, 256)
    assert multimem.launch_shape(257 * 16) == (2, 256, 257)            # 257 vectors: two blocks of 256 threads
    assert multimem.launch_shape(1024 * 256 * 16) == (1024, 256, 262144)
    assert multimem.launch_shape(2048 * 256 * 16) == (1024, 256, 524288)   # the grid-stride loop takes the rest
    assert all(type(v) is int for v in multimem.launch_shape(257 * 16 + 5))


class _Calls:
    """A driver's ``_cu`` recorded; ``cuLaunchKernel`` only recorded (no multicast range is mapped here)."""

    def __init__(self, drv: CudaDriver):
        self.drv, self.real, self.calls = drv, drv._cu, []

    def __call__(self, call, *args, **kwargs):
        self.calls.append((call, args, kwargs))
        return None if call == "cuLaunchKernel" else self.real(call, *args, **kwargs)

    def modules(self) -> list:
        """The module calls (the first call of a thread also makes its context current through ``_cu``)."""
        return [c for c in self.calls if c[0].startswith("cuModule")]


@EMULATED
def test_the_kernel_loads_its_nul_terminated_ptx_and_unloads_it_when_the_entry_is_missing(monkeypatch):
    drv = _cuda("H100x2")
    calls = _Calls(drv)
    monkeypatch.setattr(drv, "_cu", calls)
    kernel = multimem.MultimemKernel.load(drv)
    (load, load_args, load_kw), (get, get_args, _) = calls.modules()
    assert (load, load_args, load_kw) == ("cuModuleLoadData", (multimem.PTX.encode() + b"\0",),
                                          {"detail": "multimem PTX"})
    assert (get, get_args) == ("cuModuleGetFunction", (kernel.module, multimem.ENTRY.encode()))
    kernel.unload(drv)
    assert calls.modules()[-1] == ("cuModuleUnload", (kernel.module,), {"detail": "multimem module"})
    # the entry is missing: the module is unloaded again before the error goes up
    calls.calls.clear()
    monkeypatch.setattr(drv.api, "cuModuleGetFunction", _fail(drv.api, "CUDA_ERROR_NOT_FOUND", None))
    with pytest.raises(DriverError) as e:
        multimem.MultimemKernel.load(drv)
    assert str(e.value) == "[rank 0] cuda driver: cuModuleGetFunction -> CUDA_ERROR_NOT_FOUND: failed"
    module_calls = calls.modules()
    assert [c[0] for c in module_calls] == ["cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload"]
    assert module_calls[2][1] == (module_calls[1][1][0],) and drv.api._modules == {}
    drv.close()


@EMULATED
def test_a_failed_load_or_unload_names_the_multimem_module():
    drv = _cuda("H100x2")
    drv.api.cuModuleLoadData = _fail(drv.api, "CUDA_ERROR_NOT_FOUND", None)
    with pytest.raises(DriverError) as e:
        multimem.MultimemKernel.load(drv)
    assert str(e.value) == "[rank 0] cuda driver: cuModuleLoadData -> CUDA_ERROR_NOT_FOUND: multimem PTX"
    del drv.api.cuModuleLoadData
    kernel = multimem.MultimemKernel.load(drv)
    real_unload = drv.api.cuModuleUnload
    drv.api.cuModuleUnload = _fail(drv.api, "CUDA_ERROR_NOT_FOUND")
    with pytest.raises(DriverError) as e:
        kernel.unload(drv)
    assert str(e.value) == "[rank 0] cuda driver: cuModuleUnload -> CUDA_ERROR_NOT_FOUND: multimem module"
    drv.api.cuModuleUnload = real_unload
    kernel.unload(drv)
    drv.close()


@EMULATED
def test_a_store_launches_one_grid_of_256_thread_blocks_on_the_given_stream(monkeypatch):
    drv = _cuda("H100x2")
    kernel = multimem.MultimemKernel.load(drv)
    calls = _Calls(drv)
    monkeypatch.setattr(drv, "_cu", calls)
    src = torch.zeros(257 * 16, dtype=torch.uint8)
    kernel.store(drv, 0x7F0000001000, src, 77)
    (call, args, kwargs), = calls.calls
    assert call == "cuLaunchKernel" and args[:9] == (kernel.function, 2, 1, 1, 256, 1, 1, 0, 77)
    assert args[9] == ((0x7F0000001000, src.data_ptr(), 257),
                       (multimem.ctypes.c_void_p, multimem.ctypes.c_void_p, multimem.ctypes.c_uint64))
    assert args[10] == 0 and len(args) == 11
    assert kwargs == {"detail": f"moonep_ep_multimem_st_v4 to 0x7f0000001000, {257 * 16} bytes"}
    monkeypatch.undo()
    kernel.unload(drv)
    drv.close()


@EMULATED
def test_a_store_refuses_every_operand_a_v4_access_would_fault_on_before_launching(monkeypatch):
    drv = _cuda("H100x2")
    kernel = multimem.MultimemKernel.load(drv)
    calls = _Calls(drv)
    monkeypatch.setattr(drv, "_cu", calls)
    good = torch.zeros(64, dtype=torch.uint8)
    base = torch.zeros(96, dtype=torch.uint8)
    cases = {
        "another dtype": (0x1000, torch.zeros(64, dtype=torch.int8)),
        "not contiguous": (0x1000, torch.zeros(128, dtype=torch.uint8)[::2]),
        "another device": (0x1000, torch.empty(64, dtype=torch.uint8, device="meta")),
        "a partial vector": (0x1000, good[:20]),
        "a misaligned destination": (0x1008, good),
        "a misaligned source": (0x1000, base[1:65]),
    }
    for name, (dst, src) in cases.items():
        with pytest.raises(DriverError) as e:
            kernel.store(drv, dst, src, 0)
        assert str(e.value) == (
            f"[rank 0] cuda driver: multimem_store: needs a contiguous uint8 tensor on cpu of a multiple of 16 bytes, "
            f"16-byte aligned, to a 16-byte aligned address; got {src.dtype} {tuple(src.shape)} on {src.device} at "
            f"{src.data_ptr():#x} to {dst:#x}. Fix: pad the write to 16 bytes, copy a misaligned view first"), name
    assert calls.calls == []
    kernel.store(drv, 0x1000, good, 0)                                  # the control: launched
    assert [c[0] for c in calls.calls] == ["cuLaunchKernel"]
    monkeypatch.undo()
    kernel.unload(drv)
    drv.close()
