"""Multi-host NVLink domains: the emulator's rules (each broken on purpose) and the library's
clique check before any handle moves.

Sources: the CUDA driver API (Fabric Clique Information: ``cuDeviceGetCliqueInfo``,
``cuDeviceGetFabricClusterUuid``, new in CUDA 13.4); pytorch/pytorch#171495 (POSIX fds cannot
cross hosts), pytorch/pytorch#178989 (an import across NVLink cliques fails "invalid resource
handle"; PyTorch's SymmetricMemory rendezvous all-gathers hostname and clique id to refuse early);
NCCL's MNNVL detection (cluster UUID and clique id from NVML).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from moonep_ep.errors import ConfigError, DriverError
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.memory.exchange import vote
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi, NodeSpec, NodeSpecError, visible_gpus
from moonep_ep.launch import run_ranks

MiB = 1 << 20
FD, FABRIC = HandleType.POSIX_FD, HandleType.FABRIC
NVL72 = "GB200x72,hosts=18,imex=domain,cuda=13.4"
NVL72_SPLIT = "GB200x72,hosts=18,cliques=2,imex=domain,cuda=13.4"

pytestmark = pytest.mark.cuda_emulated


def _driver(node: str, host: int, rank: int = 0, local: int = 0) -> CudaDriver:
    return CudaDriver(device=0, rank=rank, api=EmulatedCudaApi(node, visible=str(local), host=host, record=True))


def test_a_domain_spec_has_hosts_cliques_and_names_and_refuses_what_cannot_exist():
    spec = NodeSpec.parse(NVL72_SPLIT)
    assert (spec.gpus, spec.hosts, spec.gpus_per_host) == (72, 18, 4)
    assert spec.host_of_gpu(35) == 8 and spec.host_of_gpu(36) == 9
    assert spec.clique_of_gpu(35) != spec.clique_of_gpu(36)          # hosts 0-8 | 9-17
    assert spec.clique_of_gpu(0) == spec.clique_of_gpu(35)
    assert visible_gpus(spec, None, host=9) == [36, 37, 38, 39]
    assert visible_gpus(spec, "3,1", host=1) == [7, 5]
    named = NodeSpec.parse("H100x4,hosts=2,hostnames=alpha+beta")
    assert named.resolve_host("beta") == 1 and named.host_name(0) == "alpha"
    for bad, why in [("GB200x72,hosts=5", "does not divide"), ("H100x72,hosts=2", "GPUs per host"),
                     ("H100x80,hosts=8", "1..72"), ("GB200x72,hosts=18,cliques=4", "cliques=4"),
                     ("H100x4,hosts=2,hostnames=a", "one name per host"), ("H100x4,hosts=2,hostnames=a+a", "distinct")]:
        with pytest.raises(NodeSpecError, match=why):
            NodeSpec.parse(bad)
    with pytest.raises(NodeSpecError, match="not in this domain"):
        EmulatedCudaApi("H100x4,hosts=2", host="gamma")


def test_the_host_of_a_process_comes_from_the_variable_then_the_hostname(monkeypatch):
    import socket

    spec = NodeSpec.parse(f"H100x4,hosts=2,hostnames=elsewhere+{socket.gethostname()}")
    monkeypatch.delenv("MOONEP_EP_CUDA_EMULATOR_HOST", raising=False)
    assert EmulatedCudaApi(spec).host == 1          # named like this process's hostname
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_HOST", "elsewhere")
    assert EmulatedCudaApi(spec).host == 0
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_HOST", "1")
    api = EmulatedCudaApi(spec)
    assert api.host == 1 and api.hostname == socket.gethostname()


def test_posix_fds_import_only_on_their_own_host():
    """pytorch/pytorch#171495: an fd cannot cross hosts. Broken on purpose: a host-1 process
    imports a host-0 export (the emulator shares one real machine, so only the rule stops it)."""
    node = "H100x4,hosts=2,imex=domain"
    a, same, other = _driver(node, 0), _driver(node, 0, local=1), _driver(node, 1)
    h = a.create(2 * MiB, FD)
    fd = a.export(h, FD)
    same.release(same.import_handle(fd, FD, size=2 * MiB))
    with pytest.raises(DriverError) as info:
        other.import_handle(fd, FD, size=2 * MiB)
    assert info.value.code == "CUDA_ERROR_INVALID_HANDLE" and "never crosses hosts" in other.api.last_error
    os.close(fd)
    a.release(h)
    for d in (a, same, other):
        d.close()
        assert not any(d.api.live().values()), d.api.live()


def test_fabric_handles_import_inside_one_clique_across_hosts_and_never_across_cliques():
    """pytorch/pytorch#178989: different NVLink cliques -> invalid resource handle at import."""
    exporter = _driver(NVL72_SPLIT, 0)
    same_clique, other_clique = _driver(NVL72_SPLIT, 8), _driver(NVL72_SPLIT, 9)
    h = exporter.create(2 * MiB, FABRIC)
    shared = exporter.export(h, FABRIC)
    same_clique.release(same_clique.import_handle(shared, FABRIC, size=2 * MiB))
    with pytest.raises(DriverError) as info:
        other_clique.import_handle(shared, FABRIC, size=2 * MiB)
    assert info.value.code == "CUDA_ERROR_INVALID_HANDLE" and "cliques" in other_clique.api.last_error
    exporter.release(h)
    for d in (exporter, same_clique, other_clique):
        d.close()


def test_a_multicast_team_stays_inside_one_clique():
    """A multicast object spans the GPUs of one NVLink clique: numDevices beyond it is invalid,
    and a GPU of another clique cannot join."""
    root, member, outsider = _driver(NVL72_SPLIT, 0), _driver(NVL72_SPLIT, 1), _driver(NVL72_SPLIT, 9)
    with pytest.raises(DriverError) as info:
        root.multicast_create(2 * MiB, 37, FABRIC)                     # 36 GPUs per clique
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    mc = root.multicast_create(2 * MiB, 3, FABRIC)
    shared = root.multicast_export(mc, FABRIC)
    root.multicast_add_device(mc)
    joined = member.multicast_import(shared, FABRIC, size=2 * MiB)
    member.multicast_add_device(joined)
    with pytest.raises(DriverError) as info:                           # the import itself crosses cliques
        outsider.multicast_import(shared, FABRIC, size=2 * MiB)
    assert info.value.code == "CUDA_ERROR_INVALID_HANDLE"
    member.multicast_release(joined)
    root.multicast_release(mc)
    for d in (root, member, outsider):
        d.close()


def test_a_gpu_of_another_clique_cannot_join_a_team():
    """The same rule at cuMulticastAddDevice (a handle obtained without the import's check)."""
    api = EmulatedCudaApi(NVL72_SPLIT, visible="0", host=0)
    api.cuInit(0)
    _, ctx = api.cuDevicePrimaryCtxRetain(0)
    api.cuCtxSetCurrent(ctx)
    prop = api.CUmulticastObjectProp()
    prop.numDevices, prop.size, prop.handleTypes, prop.flags = 2, 2 * MiB, int(
        api.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC), 0
    _, mc = api.cuMulticastCreate(prop)
    assert int(api.cuMulticastAddDevice(mc, 0)[0]) == 0
    far = EmulatedCudaApi(NVL72_SPLIT, visible="0", host=9)
    far.cuInit(0)
    _, fctx = far.cuDevicePrimaryCtxRetain(0)
    far.cuCtxSetCurrent(fctx)
    far._mcs[api._obj(mc).inode] = api._obj(mc)          # the same object, as if imported
    handle = far._new_handle(api._obj(mc))
    result = far.cuMulticastAddDevice(handle, 0)
    assert result[0].name == "CUDA_ERROR_INVALID_DEVICE" and "clique" in far.last_error


def test_clique_calls_report_the_domain_from_cuda_13_4_and_not_supported_off_a_fabric():
    drv = _driver(NVL72_SPLIT, 9)
    caps = drv.capabilities()
    assert caps.host == "node0-host9" and caps.clique.endswith(f"/{NodeSpec.parse(NVL72_SPLIT).clique_of_gpu(36):#x}")
    assert caps.clique != _driver(NVL72_SPLIT, 0).capabilities().clique
    old = _driver("GB200x72,hosts=18,imex=domain,cuda=13.0", 0).capabilities()
    assert old.clique == "" and "not found" in old.reasons["clique"]          # the symbol is missing before 13.4
    single = _driver("H100x8,cuda=13.4", 0).capabilities()
    assert single.clique == "" and "NOT_SUPPORTED" in single.reasons["clique"]


def _peer(host: str, clique: str) -> dict[str, Any]:
    return {"host": host, "clique": clique, "fd": True, "fabric": True, "multicast": True,
            "device": f"GPU-{host}", "driver": "cuda", "prefs": (None, None)}


def test_the_vote_refuses_ranks_on_hosts_in_two_cliques_on_every_rank_naming_ranks_hosts_cliques_and_the_fix():
    peers = [_peer(f"h{r // 4}", "c/0x7ffe" if r < 4 else "c/0x7fff") for r in range(8)]
    messages = []
    for rank in range(8):
        with pytest.raises(ConfigError) as info:
            vote(peers, rank)
        messages.append(str(info.value).split("] ", 1)[1])
        assert f"[rank {rank}]" in str(info.value)
    assert len(set(messages)) == 1
    assert "rank(s) 0-3 on host h0 (clique c/0x7ffe)" in messages[0]
    assert "rank(s) 4-7 on host h1 (clique c/0x7fff)" in messages[0] and "Fix:" in messages[0]
    # Controls: one clique over two hosts is fabric without a trial; one host needs no clique at all.
    same = vote([_peer(f"h{r // 4}", "c/0x7ffe") for r in range(8)], 0)
    assert same.handle_type == FABRIC and not same.verify_domain
    assert not vote([_peer("h0", f"c/{r}") for r in range(4)], 0).verify_domain
    unknown = vote([_peer(f"h{r // 2}", "") for r in range(4)], 0)
    assert unknown.handle_type == FABRIC and unknown.verify_domain    # proven by the fabric trial


def domain_allocate(ctx: Any, node: str, hosts: list[int]) -> dict[str, Any]:
    """Rank ``r`` on emulated host ``hosts[r]`` allocates symmetric memory over the process-wide emulator."""
    os.environ["MOONEP_EP_CUDA_EMULATOR_HOST"] = str(hosts[ctx.rank])
    from moonep_ep.memory import make_driver
    from moonep_ep.memory.symmetric import SymmetricMemory

    out: dict[str, Any] = {}
    with make_driver("cuda", rank=ctx.rank) as driver:
        try:
            symm = SymmetricMemory.allocate([2 * MiB], driver=driver)
            try:
                view = symm.map_chunks(0)
                out["handle_type"] = symm.decision.handle_type.value
                out["mapped"] = view.size
                view.close()
            finally:
                symm.close()
        except ConfigError as exc:
            out["error"] = str(exc)
        out["live"] = {k: v for k, v in driver.live_objects().items() if v}
        out["driver_errors"] = sorted({call for call, _code, _why in driver.api.errors})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cuda", ["13.4", "13.0"])
def test_an_nvl72_domain_split_across_two_cliques_is_refused_before_any_handle_moves(cuda):
    """Hosts 8 and 9 of an NVL72 split into two cliques: every rank refuses with ranks, hosts and cliques
    (CUDA 13.4: from the clique calls, in the vote; 13.0: the fabric trial proves it). Control: hosts
    0 and 8 (one clique) allocate over fabric."""
    node = f"GB200x72,hosts=18,cliques=2,imex=domain,cuda={cuda}"
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": node, "CUDA_VISIBLE_DEVICES": "0"}
    refused = run_ranks(domain_allocate, 2, args=(node, [8, 9]), env=env, timeout_s=120)
    for rank, out in enumerate(refused):
        assert "error" in out, out
        assert f"[rank {rank}]" in out["error"] and "node0-host8" in out["error"] and "node0-host9" in out["error"]
        assert "Fix:" in out["error"] and out["live"] == {}
        if cuda == "13.4":
            assert "0x7ffe" in out["error"] and "0x7fff" in out["error"] and "not all in one NVLink clique" in out["error"]
            assert out["driver_errors"] == []          # refused in the vote: no import was even tried
        else:
            assert "clique unknown" in out["error"] and "trial failed" in out["error"]
            assert out["driver_errors"] == (["cuMemImportFromShareableHandle"] if rank in (0, 1) else [])
    if cuda == "13.4":
        allowed = run_ranks(domain_allocate, 2, args=(node, [0, 8]), env=env, timeout_s=120)
        assert [o.get("handle_type") for o in allowed] == ["fabric", "fabric"], allowed
        assert all(o["live"] == {} and o["mapped"] == 4 * MiB for o in allowed)
