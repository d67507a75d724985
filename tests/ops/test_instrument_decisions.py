"""The collective recorder's decisions in this process (``ops/moonep/instrument.py``): what it wraps and restores, which
arguments it scans before and after a call, how many weight bytes a tensor holds, what one call records.

A one-rank gloo group (``HashStore``, no other process) runs the real
``torch.distributed`` collectives here, so mutation testing sees every function;
``tests/ops/test_instrument.py`` runs the two-rank cases (a broadcast received,
a send and a recv) in spawned ranks. One registered expert row is 64 bf16 values,
128 bytes; every expected count below is a number of such rows worked out from
what the call sends and what its buffers hold afterwards.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from moonep_ep.ops.moonep.instrument import (WRAPPED_OPS, CollectiveCall, CollectiveRecorder, _signature, _split_arguments,
                                      _tensors_in)

ROW = 128  # bytes of one registered row (64 bf16)


def _weights() -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def test_one_call_of_each_kind_records_its_op_bytes_weight_bytes_shapes_and_label(one_rank):
    w = _weights()
    rec = CollectiveRecorder([w])
    zeros = lambda n=1: torch.zeros(n * 64, dtype=torch.bfloat16)  # noqa: E731
    with rec:
        with rec.phase("load"):
            dist.all_reduce(w[1].clone())                 # sends a row, holds it after: 1 row
            dist.broadcast(w[2], src=0)                   # aliases the registered memory: 1 row
            c10d.all_reduce(zeros())                      # through c10d's name: recorded too, nothing carried
        with rec.phase("forward"):
            dist.all_to_all_single(w[3].clone(), zeros())  # a stale row in the receive buffer: overwritten, 0
            dist.all_to_all_single(zeros(), w[0].clone())  # a row sent and received: 1 row
            getattr(dist, GATHER)(zeros(), w[0].clone())   # the same for an all-gather
        gathered = [None]
        dist.all_gather_object(gathered, w[1].clone())     # an object op (its inner all_gather is not recorded)
    assert [(c.op, c.nbytes, c.weight_bytes, c.label) for c in rec.calls] == [
        ("all_reduce", ROW, ROW, "load"), ("broadcast", ROW, ROW, "load"), ("all_reduce", ROW, 0, "load"),
        ("all_to_all_single", 2 * ROW, 0, "forward"), ("all_to_all_single", 2 * ROW, ROW, "forward"),
        (GATHER, 2 * ROW, ROW, "forward"),
        ("all_gather_object", len(pickle.dumps([[w[1].clone()]])), ROW, "")]
    assert rec.calls[0].shapes == [((64,), "bfloat16")] and rec.calls[3].shapes == [((64,), "bfloat16")] * 2
    assert rec.calls[-1].shapes == [((64,), "bfloat16")]                 # the gathered copy, after the call
    assert isinstance(rec.calls[0], CollectiveCall)
    assert rec.weight_bytes == 5 * ROW
    assert rec.total_bytes == 9 * ROW + len(pickle.dumps([[w[1].clone()]]))
    assert rec.by_op("load") == {"all_reduce": {"calls": 2, "bytes": 2 * ROW, "weight_bytes": ROW},
                                 "broadcast": {"calls": 1, "bytes": ROW, "weight_bytes": ROW}}
    assert rec.by_op("forward") == {"all_to_all_single": {"calls": 2, "bytes": 4 * ROW, "weight_bytes": ROW},
                                    GATHER: {"calls": 1, "bytes": 2 * ROW, "weight_bytes": ROW}}
    assert set(rec.by_op()) == {"all_reduce", "broadcast", "all_to_all_single", GATHER, "all_gather_object"}
    assert rec.by_op()["all_reduce"]["calls"] == 2 and rec.by_op("nothing") == {}


def test_entering_wraps_every_op_in_both_modules_and_leaving_restores_them(one_rank):
    present = [(m, n) for n in WRAPPED_OPS for m in (dist, c10d) if getattr(m, n, None) is not None]
    before = {(m.__name__, n): getattr(m, n) for m, n in present}
    rec = CollectiveRecorder()
    with rec as entered:
        assert entered is rec and len(rec._saved) == len(present)
        for m, n in present:
            wrapper = getattr(m, n)
            assert wrapper is not before[(m.__name__, n)]
            # both names call torch.distributed's function (the one c10d's object collectives reach too)
            assert wrapper.__wrapped__ is before[("torch.distributed", n)] if ("torch.distributed", n) in before \
                else wrapper.__wrapped__ is before[(m.__name__, n)]
    assert {(m.__name__, n): getattr(m, n) for m, n in present} == before and rec._saved == []
    dist.all_reduce(torch.zeros(2))
    assert rec.calls == []                                               # not recording any more


def test_phases_nest_and_restore_the_label(one_rank):
    rec = CollectiveRecorder()
    with rec:
        with rec.phase("outer"):
            with rec.phase("inner"):
                dist.barrier()
            dist.barrier()
        dist.barrier()
    assert [(c.op, c.label, c.nbytes, c.weight_bytes, c.shapes) for c in rec.calls] == [
        ("barrier", "inner", 0, 0, []), ("barrier", "outer", 0, 0, []), ("barrier", "", 0, 0, [])]
    assert rec.label == ""


def test_an_unpicklable_object_argument_counts_its_tensors():
    rec = CollectiveRecorder([_weights()])
    w = _weights()

    def all_gather_object(object_list, obj, group=None):   # a stand-in collective with the real signature
        object_list[0] = obj

    wrapped = rec._wrap("all_gather_object", all_gather_object)
    out = [None]
    wrapped(out, [lambda: 0, w[2].clone()])                 # a lambda does not pickle
    (call,) = rec.calls
    # both list arguments hold the row after the call (the gathered list holds the sent one): 2 rows of
    # tensor bytes; the row is sent (before) and held (after): 1 row of weights
    assert (call.op, call.nbytes, call.weight_bytes, call.shapes) == ("all_gather_object", 2 * ROW, ROW,
                                                                     [((64,), "bfloat16")] * 2)
    assert out[0][1].equal(w[2])


# -- which arguments are scanned before and after --------------------------------------------------------------

def test_sent_and_received_arguments_of_each_kind_of_op(one_rank):
    t, u = torch.zeros(2), torch.ones(2)
    split = lambda name, *a, **k: _split_arguments(name, _signature(getattr(dist, name)), a, k)  # noqa: E731
    sent, received = split("all_reduce", t)
    assert sent == [t] and received is sent                           # in place: both are every argument
    assert split("all_to_all_single", t, u) == ([u], [t])             # output received, input sent
    assert split("all_to_all_single", output=t, input=u, group=None) == ([u, None], [t])
    # a broadcast: the tensor is received on every rank but src (here rank 0)
    sent, received = split("broadcast", t, src=0)
    assert sent == [t, 0] and received is sent
    assert split("broadcast", t, src=1) == ([1], [t])
    assert split("broadcast", t, group_src=1) == ([1], [t])          # group_src against the group's rank 0
    sent, received = split("broadcast", t, group_src=0)
    assert sent == [t, 0] and received is sent
    assert split("broadcast_object_list", [u], src=1) == ([1], [[u]])
    # batch_isend_irecv: isend ops are sent, irecv ops received
    send_op = types.SimpleNamespace(op=dist.isend, tensor=t)
    recv_op = types.SimpleNamespace(op=dist.irecv, tensor=u)
    assert split("batch_isend_irecv", [send_op, recv_op]) == ([[send_op]], [[recv_op]])
    # an op without an op, or one whose op has no name (a functools.partial): not a receive
    bare, partial = types.SimpleNamespace(tensor=t), types.SimpleNamespace(op=functools.partial(dist.irecv), tensor=u)
    assert split("batch_isend_irecv", [bare, partial]) == ([[bare, partial]], [[]])
    # group_src is a rank in the group passed: this process is not in NON_GROUP_MEMBER (its rank there is -1),
    # so group_src 0 names another process, and the tensor is received
    assert split("broadcast", t, group=dist.GroupMember.NON_GROUP_MEMBER, group_src=0) == (
        [dist.GroupMember.NON_GROUP_MEMBER, 0], [t])
    # no signature (a builtin) or arguments that do not bind: everything, both ways
    assert _split_arguments("all_reduce", None, (t,), {"x": u}) == ([t, u], [t, u])
    assert split("all_reduce", t, no_such_argument=u) == ([t, u], [t, u])


def test_without_a_process_group_a_broadcast_is_not_known_to_be_received():
    assert not dist.is_initialized()
    t = torch.zeros(2)
    sent, received = _split_arguments("broadcast", inspect.signature(dist.broadcast), (t,), {"src": 1})
    assert sent == [t, 1] and received is sent


def test_signatures_of_builtins_and_non_callables_are_none():
    assert _signature(getattr) is None and _signature(42) is None            # ValueError, TypeError
    assert list(_signature(dist.all_to_all_single).parameters)[:2] == ["output", "input"]


def test_tensors_are_found_in_lists_dicts_and_p2p_ops_down_to_four_levels():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    op = types.SimpleNamespace(tensor=c)
    found = list(_tensors_in([a, (b, {"k": op}), {"x": [[d]]}, types.SimpleNamespace(tensor="not a tensor")]))
    assert [float(t) for t in found] == [0.0, 1.0, 2.0, 3.0]              # d at depth 4
    assert list(_tensors_in([[[[[a]]]]])) == []                           # a at depth 5: past the limit
    assert [float(t) for t in _tensors_in([[[[a]]]])] == [0.0]
    assert list(_tensors_in({"1": {"2": {"3": {"4": {"5": a}}}}})) == []   # the same limit through dicts
    assert [float(t) for t in _tensors_in({"1": {"2": {"3": {"4": a}}}})] == [0.0]
    assert list(_tensors_in(None)) == [] and list(_tensors_in("text")) == []


# -- how many weight bytes a tensor holds ------------------------------------------------------------------------

def test_weight_bytes_by_alias_and_by_content_whatever_the_shape():
    base = torch.zeros(8, 64, dtype=torch.bfloat16)
    base[:4] = _weights()
    w = base[:4]
    rec = CollectiveRecorder([w])
    assert rec.weight_bytes_in(base[3]) == ROW                           # inside the registered bytes
    assert rec.weight_bytes_in(base[2:6]) == 4 * ROW                     # overlapping them: all its bytes
    assert rec.weight_bytes_in(base[4]) == 0                             # starts where they end
    assert rec.weight_bytes_in(torch.empty(0)) == 0
    assert rec.weight_bytes_in(base[3, 5:6]) == 2                       # one value of a row: its 2 bytes
    copy = torch.stack([w[0], torch.zeros(64, dtype=torch.bfloat16), w[2]])
    assert rec.weight_bytes_in(copy) == 2 * ROW                          # two registered rows among three
    assert rec.weight_bytes_in(copy.reshape(-1)) == 2 * ROW              # the same bytes, flat
    assert rec.weight_bytes_in(copy.reshape(-1)[:65]) == 0               # not whole rows
    assert rec.weight_bytes_in(w[0].float()) == 0                        # another dtype: not detected
    ahead = torch.zeros(8, 64, dtype=torch.bfloat16)
    ahead[4:] = _weights()
    rec2 = CollectiveRecorder([ahead[4:]])
    assert rec2.weight_bytes_in(ahead[3]) == 0                           # ends where the registered bytes start
    assert rec2.weight_bytes_in(ahead[3:5]) == 2 * ROW


def test_rows_per_tensor_limits_the_digested_rows_and_rows_of_two_sizes_are_both_found():
    w = _weights()
    two = CollectiveRecorder([w], rows_per_tensor=2)
    assert two.weight_bytes_in(w[1].clone()) == ROW and two.weight_bytes_in(w[3].clone()) == 0
    assert CollectiveRecorder([w], rows_per_tensor=10).weight_bytes_in(w[3].clone()) == ROW
    one = CollectiveRecorder([w[2:3]])                                  # a tensor of one row
    assert one.weight_bytes_in(w[2].clone()) == ROW and set(one._digests) == {ROW}
    small = torch.randn(2, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)  # 64-byte rows
    rec = CollectiveRecorder()
    rec.register(w)
    rec.register(small)
    assert rec.weight_bytes_in(small[1].clone()) == 64                   # 64 bytes: not a 128-byte row
    assert rec.weight_bytes_in(small.clone().reshape(-1)) == 128         # two 64-byte rows
    # 192 bytes: not whole 128-byte rows; of its three 64-byte chunks only small[0] is a registered row
    assert rec.weight_bytes_in(torch.cat([w[0], small[0]])) == 64
    flat = torch.randn(64).to(torch.bfloat16)
    rec.register(flat)                                                   # 1-D: its bytes, no rows
    assert rec.weight_bytes_in(flat) == ROW and rec.weight_bytes_in(flat.clone()) == 0
    rec.register(torch.zeros(0, 64, dtype=torch.bfloat16))                # no rows at all
    assert set(rec._digests) == {ROW, 64}
