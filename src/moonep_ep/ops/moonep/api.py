"""Which MoonEP API a ``Buffer`` class speaks, read from its signatures, and the one choice per run: pull or push.

MoonEP has shipped two incompatible ``Buffer`` APIs (docs/design/moonep.md,
"Which API generation"). The facts the probe relies on:

* **pull** ("Gen A", ``[E+B]``): the API vLLM 0.33.0 calls, pinned by vLLM
  PR #54147 to MoonEP commit ``7745ffa0``. Constructor
  ``Buffer(S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, B=None,
  group=None, comm_stream_priority=-1, enable_pdl=True, explicitly_destroy=False)``
  (vLLM 0.33.0's ``MoonEPAll2AllManager._make_buffer_kwargs`` passes ``B=``);
  ``prefetch_weight(plan=None, async_finish=False, *, full_gate_weight,
  full_up_weight, full_down_weight, full_gate_scale=None, ...)`` (vLLM 0.33.0's
  ``MoonEPPrepareAndFinalize.prepare`` passes the three ``full_*_weight``).
* **push** ("Gen B", ``[2*epn]``): MoonEP's public release 26/09 (commit
  ``33327eb``). The same constructor without ``B`` (slots = ``epn``);
  ``prefetch_weight(plan=None, async_finish=False, *, local_gate_weight,
  local_up_weight, local_down_weight, gate_prefetch_buffer, up_prefetch_buffer,
  down_prefetch_buffer, local_gate_scale=None, ..., gate_scale_prefetch_buffer=None, ...)``;
  every call takes ``async_finish`` and ``dispatch``/``combine`` take ``zero_copy``.

The probe never reads a version string (forks and editable installs carry
none that can be trusted): it reads parameter names with :mod:`inspect`.

* pull  = ``__init__`` has ``B`` and ``prefetch_weight`` has the three ``full_*_weight``
  and none of the push keywords;
* push  = ``__init__`` has no ``B``, ``prefetch_weight`` has the three ``local_*_weight``
  and the three ``*_prefetch_buffer`` and none of the pull keywords, and the calls the push
  path makes exist: ``async_finish`` on ``dispatch``/``combine``/``prefetch_weight``,
  ``zero_copy`` on ``dispatch``/``combine``;
* anything else is refused, naming what was found and the fix; a class with
  *both* keyword sets too (a real MoonEP speaks one). The project's reference
  buffers are probed like any other: :class:`~.pull.ReferenceBuffer` speaks
  pull, :class:`~.push.PushReferenceBuffer` push.

:func:`choose_moonep_api` resolves ``MOONEP_EP_MOONEP_API`` (``auto`` |
``pull`` | ``push``) against the probe for one rank; :class:`ApiChoice`
carries what follows from it (slots, the Buffer's arguments). Every rank's
choice is compared in the vLLM manager's backend-selection step
(``vllm/buffers.py``, ``agree_decisions``), so ranks that would choose
differently raise the same error on every rank, before any Buffer is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Optional

from ... import envs
from ...errors import ConfigError, config_error

PULL, PUSH = "pull", "push"
ENV = "MOONEP_EP_MOONEP_API"
API_CHOICES = envs.VARIABLES[ENV].choices  # ("auto", "pull", "push")

#: Where each API comes from, for the fix in a refusal.
INSTALL_HINT = {
    PULL: "MoonEP at commit 7745ffa0 (the commit vLLM PR #54147 pins in tools/ep_kernels/"
          "install_python_libraries.sh)",
    PUSH: "MoonEP's public release 26/09 (commit 33327eb) or newer",
}

#: Constructor parameters both generations have.
SHARED_INIT = ("S", "H", "K", "E", "num_ep_ranks")
PULL_INIT = "B"
PULL_PREFETCH = ("full_gate_weight", "full_up_weight", "full_down_weight")
PUSH_PREFETCH = ("local_gate_weight", "local_up_weight", "local_down_weight",
                 "gate_prefetch_buffer", "up_prefetch_buffer", "down_prefetch_buffer")
#: Keywords the push path calls besides the prefetch weights (the release's async and zero-copy calls).
PUSH_CALLS = {"dispatch": ("async_finish", "zero_copy"), "combine": ("async_finish", "zero_copy"),
              "prefetch_weight": ("async_finish",)}
METHODS = ("__init__", "dispatch", "combine", "prefetch_weight")


@dataclasses.dataclass(frozen=True)
class ApiProbe:
    """What a ``Buffer`` class speaks: ``api`` is ``"pull"`` or ``"push"``; ``evidence`` names the parameters
    that decided."""

    api: str
    evidence: tuple[str, ...]
    buffer: str  # module.qualname of the probed class


@dataclasses.dataclass(frozen=True)
class ApiChoice:
    """The API a run uses: ``api`` is ``"pull"`` or ``"push"``; ``requested`` the value asked for. What
    follows from the choice is asked of it, so callers call rather than branch."""

    api: str
    requested: str
    probe: ApiProbe

    @property
    def is_push(self) -> bool:
        return self.api == PUSH

    def num_slots(self, experts_per_rank: int, pull_slots: int) -> int:
        """Prefetch slots per rank: the push API has exactly ``E/R``; the pull API the caller's ``B``."""
        return experts_per_rank if self.is_push else pull_slots

    def buffer_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The ``Buffer`` constructor's arguments for this API: the push ``Buffer`` takes no ``B``."""
        return {k: v for k, v in kwargs.items() if not (self.is_push and k == PULL_INIT)}

    @property
    def reason(self) -> str:
        how = "detected" if self.requested == "auto" else "requested and matching"
        return (f"MoonEP API = {self.api} ({ENV}={self.requested}: {how}; {self.probe.buffer}: "
                f"{'; '.join(self.probe.evidence)})")


def _parameters(cls: Any, method: str) -> tuple[Optional[set[str]], str]:
    """``(names, "")`` of ``cls.method``'s named parameters, or ``(None, why they cannot be read)``."""
    fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        return None, "missing"
    try:
        params = inspect.signature(cls if method == "__init__" else fn).parameters.values()
    except (TypeError, ValueError):
        return None, "signature unreadable"
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not names - {"self"} and any(p.kind is p.VAR_KEYWORD for p in params):
        return None, "only **kwargs"
    return names, ""


def _found(params: dict[str, Optional[set[str]]], why: dict[str, str]) -> str:
    """What the class has, limited to the names that matter, for a refusal."""
    known = {PULL_INIT, *SHARED_INIT, *PULL_PREFETCH, *PUSH_PREFETCH, "async_finish", "zero_copy"}
    parts = []
    for m in METHODS:
        names = params[m]
        parts.append(f"{m}: {why[m]}" if names is None else
                     f"{m}({', '.join(sorted(names & known, key=str.lower)) or 'none of the MoonEP names'})")
    return "; ".join(parts)


#: The project's reference buffer of each API, named rather than imported (they need not be loaded to probe).
REFERENCE_BUFFER_FOR = {PULL: ("moonep_ep.ops.moonep.pull", "ReferenceBuffer"),
                        PUSH: ("moonep_ep.ops.moonep.push", "PushReferenceBuffer")}


def reference_buffer_class(api: str) -> type:
    """The project's reference ``Buffer`` class for ``api`` (``"pull"`` or ``"push"``), imported on demand."""
    module, name = REFERENCE_BUFFER_FOR[api]
    return getattr(importlib.import_module(module), name)


def probe_moonep_api(buffer_cls: Any, *, rank: Optional[int] = None) -> ApiProbe:
    """Which API ``buffer_cls`` speaks (see the module docstring); :class:`ConfigError` when neither or both."""
    name = f"{getattr(buffer_cls, '__module__', '?')}.{getattr(buffer_cls, '__qualname__', repr(buffer_cls))}"
    params, why = {}, {}
    for m in METHODS:
        params[m], why[m] = _parameters(buffer_cls, m)
    init, prefetch = params["__init__"], params["prefetch_weight"]
    fix = (f"install {INSTALL_HINT[PULL]} (pull) or {INSTALL_HINT[PUSH]} (push), or set MOONEP_EP_BUFFER=reference")
    if init is None or prefetch is None or not set(SHARED_INIT) <= init:
        raise config_error(rank, f"{name} is not a MoonEP Buffer this project can read (needs __init__"
                                 f"({', '.join(SHARED_INIT)}, ...) and prefetch_weight)", _found(params, why), fix)
    has_b = PULL_INIT in init
    pull_kw = [k for k in PULL_PREFETCH if k in prefetch]
    push_kw = [k for k in PUSH_PREFETCH if k in prefetch]
    pull_full, push_full = len(pull_kw) == len(PULL_PREFETCH), len(push_kw) == len(PUSH_PREFETCH)
    if pull_full and has_b and not push_kw:
        return ApiProbe(PULL, (f"__init__ has {PULL_INIT}", f"prefetch_weight has {', '.join(PULL_PREFETCH)}"), name)
    if push_full and not has_b and not pull_kw:
        missing = [f"{m}.{k}" for m, keys in PUSH_CALLS.items() for k in keys
                   if params[m] is None or k not in params[m]]
        if not missing:
            calls = "async_finish on dispatch, combine, prefetch_weight; zero_copy on dispatch, combine"
            return ApiProbe(PUSH, (f"__init__ has no {PULL_INIT}", f"prefetch_weight has {', '.join(PUSH_PREFETCH)}",
                                   calls), name)
        raise config_error(rank, f"{name} has the push prefetch but lacks keywords the push path calls "
                                 f"({', '.join(missing)})", _found(params, why), f"install {INSTALL_HINT[PUSH]}")
    if (pull_kw or has_b) and push_kw:
        what = f"{name} matches both MoonEP API generations (a real MoonEP Buffer speaks one)"
    else:
        what = f"{name} matches neither MoonEP API generation"
    raise config_error(rank, what, _found(params, why), fix)


def requested_api(requested: Optional[str] = None, *, rank: Optional[int] = None) -> str:
    """``requested`` checked against ``auto | pull | push``; ``None`` reads ``MOONEP_EP_MOONEP_API``."""
    who = f"[rank {rank}] " if rank is not None else ""
    if requested is None:
        try:
            return envs.get(ENV)
        except ConfigError as exc:
            raise ConfigError(f"{who}{exc}") from None
    value = str(requested).strip().lower()
    if value not in API_CHOICES:
        raise ConfigError(f"{who}requested MoonEP API {requested!r} is not valid: use {' | '.join(API_CHOICES)}. "
                          f"Fix: pass one of them (or set {ENV})")
    return value


def resolve_api(probe: ApiProbe, requested: str, *, rank: Optional[int] = None) -> ApiChoice:
    """The API one rank would use: ``requested`` (auto | pull | push) against what ``probe`` found."""
    if requested in ("auto", probe.api):
        return ApiChoice(probe.api, requested, probe)
    raise config_error(
        rank, f"{ENV}={requested} contradicts the installed MoonEP: {probe.buffer} speaks the {probe.api} API "
              f"({'; '.join(probe.evidence)})", requested,
        f"install {INSTALL_HINT[requested]} for the {requested} API, or set {ENV}={probe.api} (or auto)")


def choose_moonep_api(buffer_cls: Any, requested: Optional[str] = None, *, rank: Optional[int] = None) -> ApiChoice:
    """The MoonEP API this rank would use with ``buffer_cls``: ``requested`` (default:
    ``MOONEP_EP_MOONEP_API``) is ``auto`` (the probe decides), ``pull`` or ``push``; a bad value, an
    unreadable ``buffer_cls`` or a request the class contradicts raises :class:`ConfigError` naming ``rank``.
    Local: the vLLM manager shares every rank's choice in its backend-selection step and refuses ranks that
    differ (``vllm/buffers.py``, ``agree_decisions``)."""
    return resolve_api(probe_moonep_api(buffer_cls, rank=rank), requested_api(requested, rank=rank), rank=rank)
