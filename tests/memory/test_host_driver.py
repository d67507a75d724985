"""The host (memfd) driver alone, in one process: the VMM rules it enforces."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moonep_ep.errors import DriverError
from moonep_ep.memory.accounting import own_memfd_bytes, snapshot
from moonep_ep.memory.driver import HandleType
from moonep_ep.memory.host import HostDriver

GRAN = 64 << 10


@pytest.fixture
def driver():
    d = HostDriver(rank=0, granularity=GRAN)
    before = snapshot(0)
    yield d
    assert all(v == 0 for v in d.live_objects().values()), d.live_objects()
    after = snapshot(0)
    assert (after.open_memfds, after.memfd_mappings) == (before.open_memfds, before.memfd_mappings)


def test_map_write_read_and_teardown(driver):
    h = driver.create(2 * GRAN, HandleType.POSIX_FD, tag="t")
    base = driver.reserve(2 * GRAN, GRAN)
    assert base % GRAN == 0
    driver.map(base, 2 * GRAN, h, 0)
    driver.set_access(base, 2 * GRAN)
    t = driver.as_tensor(base, 2 * GRAN, owner=None)
    assert t.data_ptr() == base  # zero-copy
    t.fill_(7)
    # A second mapping of the same physical memory sees the same bytes.
    base2 = driver.reserve(GRAN, GRAN)
    driver.map(base2, GRAN, h, GRAN)
    driver.set_access(base2, GRAN)
    t2 = driver.as_tensor(base2, GRAN, owner=None)
    assert int(t2.sum()) == 7 * GRAN
    t2.fill_(3)
    assert int(t[GRAN:].sum()) == 3 * GRAN and int(t[:GRAN].sum()) == 7 * GRAN
    del t, t2
    driver.unmap(base2, GRAN)
    driver.free_reservation(base2, GRAN)
    driver.unmap(base, 2 * GRAN)
    driver.free_reservation(base, 2 * GRAN)
    driver.release(h)


def test_own_memfd_bytes_counts_this_ranks_memfds_as_the_snapshot_does(driver):
    other = HostDriver(rank=1, granularity=GRAN)
    before = own_memfd_bytes(0)
    mine = driver.create(3 * GRAN, HandleType.POSIX_FD, tag="w")
    theirs = other.create(5 * GRAN, HandleType.POSIX_FD, tag="w")  # rank 1's, open here: not rank 0's bytes
    try:
        assert own_memfd_bytes(0) == before + 3 * GRAN == snapshot(0).own_bytes
        assert own_memfd_bytes(1) == 5 * GRAN == snapshot(1).own_bytes
    finally:
        driver.release(mine)
        other.release(theirs)
    assert own_memfd_bytes(0) == before and own_memfd_bytes(1) == 0


def test_alignment_is_enforced(driver):
    with pytest.raises(DriverError, match="not a multiple of the granularity"):
        driver.create(GRAN + 4096)
    h = driver.create(GRAN)
    base = driver.reserve(2 * GRAN, GRAN)
    with pytest.raises(DriverError, match="offset=4096"):
        driver.map(base, GRAN, h, 4096)
    with pytest.raises(DriverError, match="exceeds the allocation"):
        driver.map(base, 2 * GRAN, h, 0)
    driver.free_reservation(base, 2 * GRAN)
    driver.release(h)


def test_overlap_holes_and_order_rules(driver):
    h = driver.create(GRAN)
    base = driver.reserve(2 * GRAN, GRAN)
    driver.map(base, GRAN, h, 0)
    with pytest.raises(DriverError, match="already mapped"):
        driver.map(base, GRAN, h, 0)
    with pytest.raises(DriverError, match="not mapped"):
        driver.set_access(base, 2 * GRAN)  # second page is a hole
    with pytest.raises(DriverError, match="still has mappings"):
        driver.free_reservation(base, 2 * GRAN)
    with pytest.raises(DriverError, match="not inside a reservation"):
        driver.map(base + 4 * GRAN * 1024, GRAN, h, 0)
    with pytest.raises(DriverError, match="not mapped read/write"):
        driver.as_tensor(base, GRAN, None)  # mapped but no access granted yet
    driver.unmap(base, GRAN)
    driver.free_reservation(base, 2 * GRAN)
    driver.release(h)
    with pytest.raises(DriverError, match="already released"):
        driver.release(h)


def test_mapping_outlives_handle_release(driver):
    h = driver.create(GRAN)
    base = driver.reserve(GRAN, GRAN)
    driver.map(base, GRAN, h, 0)
    driver.set_access(base, GRAN)
    driver.release(h)  # like cuMemRelease: the mapping keeps the memory
    t = driver.as_tensor(base, GRAN, None)
    t.fill_(9)
    assert int(t[-1]) == 9
    del t
    driver.unmap(base, GRAN)
    driver.free_reservation(base, GRAN)


def test_exported_fd_is_sealed_and_cloexec(driver):
    h = driver.create(GRAN)
    fd = driver.export(h, HandleType.POSIX_FD)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        with pytest.raises(PermissionError):
            os.ftruncate(fd, GRAN // 2)  # a shrink would SIGBUS every mapper
        imported = driver.import_handle(fd, HandleType.POSIX_FD)
        assert imported.inode == h.inode and driver.handle_size(imported) == GRAN
        driver.release(imported)
    finally:
        os.close(fd)
    driver.release(h)


def test_fabric_is_refused_with_the_fix(driver):
    with pytest.raises(DriverError, match="MOONEP_EP_HANDLE_TYPE=fd"):
        driver.create(GRAN, HandleType.FABRIC)


def test_multicast_rules_single_process(driver):
    mc = driver.multicast_create(GRAN, 1)
    h = driver.create(GRAN)
    with pytest.raises(DriverError, match="barrier after multicast_add_device"):
        driver.multicast_bind(mc, 0, h, 0, GRAN)
    driver.multicast_add_device(mc)
    driver.multicast_bind(mc, 0, h, 0, GRAN)
    with pytest.raises(DriverError, match="multicast_unbind must come first"):
        driver.release(h)
    with pytest.raises(DriverError, match="unbind first"):
        driver.multicast_release(mc)
    base = driver.reserve(GRAN, GRAN)
    driver.map(base, GRAN, h, 0)
    driver.set_access(base, GRAN)
    assert driver.multicast_write(mc, 128, torch.full((64,), 5, dtype=torch.uint8)) == 1
    t = driver.as_tensor(base, GRAN, None)
    assert t[128:192].eq(5).all() and t[:128].eq(0).all()
    del t
    driver.multicast_unbind(mc, 0, GRAN)
    driver.multicast_release(mc)
    driver.unmap(base, GRAN)
    driver.free_reservation(base, GRAN)
    driver.release(h)


def test_unmapped_access_faults_in_a_child_process():
    # Touching an unmapped (PROT_NONE) range kills the process: prove it in a child.
    code = textwrap.dedent(f"""
        import ctypes
        from moonep_ep.memory.host import HostDriver
        d = HostDriver(granularity={GRAN})
        h = d.create({GRAN}); base = d.reserve({GRAN}, {GRAN})
        d.map(base, {GRAN}, h, 0); d.set_access(base, {GRAN}); d.unmap(base, {GRAN})
        ctypes.memset(base, 1, 1)
        print("survived")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -11 and "survived" not in proc.stdout


def test_bad_granularity_is_a_clear_error():
    with pytest.raises(DriverError, match="MOONEP_EP_HOST_GRANULARITY"):
        HostDriver(granularity=1000)


def test_leak_counters_report_a_leak_injected_on_purpose():
    """Positive control of the OS-level leak check every multi-process test relies on
    (tests.support.memory.leaks): a handle never released, an fd never closed and a
    mapping never unmapped each show up, and disappear once undone."""
    from tests.support.memory import leaks

    drv = HostDriver(rank=0, granularity=GRAN)
    before = snapshot(0)
    assert leaks(drv, before) == {}
    handle = drv.create(GRAN, HandleType.POSIX_FD, tag="leak")
    fd = drv.export(handle, HandleType.POSIX_FD)
    base = drv.reserve(GRAN, GRAN)
    drv.map(base, GRAN, handle, 0)
    found = leaks(drv, before)
    assert found["created_handles"] == 1 and found["mappings"] == 1 and found["reservations"] == 1
    assert found["open_memfds"] == 2          # the driver's own fd and the exported one
    assert found["memfd_mappings"] == 1       # read from /proc/self/maps, not the driver's books
    os.close(fd)
    drv.release(handle)
    assert leaks(drv, before)["memfd_mappings"] == 1  # the mapping keeps the memory, as on CUDA
    drv.unmap(base, GRAN)
    drv.free_reservation(base, GRAN)
    assert leaks(drv, before) == {}
