"""Which MoonEP API generation a ``Buffer`` class speaks, read from its signatures, and the choice per run.

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
* anything else is refused, naming what was found and the fix. A class with
  *both* keyword sets is refused too, except the project's
  :class:`~moonep_ep.ops.moonep.pull.ReferenceBuffer`: it plays either generation
  (``B`` optional, both ``prefetch_weight`` keyword sets), so the probe
  answers ``"either"`` and the caller chooses; ``auto`` then keeps pull,
  the API vLLM 0.33.0 calls.

:func:`choose_moonep_api` resolves ``MOONEP_EP_MOONEP_API`` (``auto`` |
``pull`` | ``push``) against the probe in one lockstep step: an explicit
value that contradicts the installed library, or ranks that would choose
differently, raise the same error on every rank, before any engine starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Optional

from ... import envs
from ...errors import ConfigError, config_error
from ...memory.group import GroupComm

PULL, PUSH, EITHER = "pull", "push", "either"
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
    """What a ``Buffer`` class speaks: ``api`` is ``"pull"``, ``"push"``, or ``"either"`` (only the
    project's reference buffer, which plays both); ``evidence`` names the parameters that decided."""

    api: str
    evidence: tuple[str, ...]
    buffer: str  # module.qualname of the probed class


@dataclasses.dataclass(frozen=True)
class ApiChoice:
    """The API a run uses: ``api`` is ``"pull"`` or ``"push"``; ``requested`` the value asked for."""

    api: str
    requested: str
    probe: ApiProbe

    @property
    def reason(self) -> str:
        how = "detected" if self.requested == "auto" else "requested and matching"
        if self.probe.api == EITHER:
            how = ("the reference buffer plays either generation; auto keeps pull, what vLLM 0.33.0 calls"
                   if self.requested == "auto" else "requested; the reference buffer plays either generation")
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


#: The project's reference buffer, named rather than imported: ``ops.buffer`` may come to import this module.
REFERENCE_BUFFER = ("moonep_ep.ops.moonep.pull", "ReferenceBuffer")


#: The reference buffer that plays each generation alone (the push one has the release's contract).
REFERENCE_BUFFER_FOR = {PULL: REFERENCE_BUFFER, PUSH: ("moonep_ep.ops.moonep.push", "PushReferenceBuffer")}


def reference_buffer_class(api: str) -> type:
    """The project's reference ``Buffer`` class for ``api`` (``"pull"`` or ``"push"``), imported on demand."""
    module, name = REFERENCE_BUFFER_FOR[api]
    return getattr(importlib.import_module(module), name)


def _is_reference(cls: Any) -> bool:
    """``cls`` is the reference buffer or a subclass of it."""
    return isinstance(cls, type) and any((c.__module__, c.__qualname__) == REFERENCE_BUFFER for c in cls.__mro__)


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
    if pull_full and push_full and has_b and _is_reference(buffer_cls):
        return ApiProbe(EITHER, (f"__init__ has {PULL_INIT} (optional)",
                                 f"prefetch_weight has {', '.join(PULL_PREFETCH)} (pull)",
                                 f"prefetch_weight has {', '.join(PUSH_PREFETCH)} (push)"), name)
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
    if probe.api == EITHER:
        return ApiChoice(PULL if requested == "auto" else requested, requested, probe)
    if requested in ("auto", probe.api):
        return ApiChoice(probe.api, requested, probe)
    raise config_error(
        rank, f"{ENV}={requested} contradicts the installed MoonEP: {probe.buffer} speaks the {probe.api} API "
              f"({'; '.join(probe.evidence)})", requested,
        f"install {INSTALL_HINT[requested]} for the {requested} API, or set {ENV}={probe.api} (or auto)")


def choose_moonep_api(buffer_cls: Any, requested: Optional[str] = None,
                      comm: Optional[GroupComm] = None) -> ApiChoice:
    """The MoonEP API this run uses, the same on every rank of ``comm``.

    ``requested`` (default: ``MOONEP_EP_MOONEP_API``) is ``auto`` (the probe
    decides), ``pull`` or ``push``. Collective over ``comm`` (``None``: this
    process alone): a bad value, an unreadable ``buffer_cls``, or a request
    the installed API contradicts on any rank raises
    :class:`~moonep_ep.errors.CollectiveError` on every rank, naming each
    failing rank's error; ranks that would choose different APIs raise the
    same :class:`ConfigError` on every rank.
    """
    if comm is None:
        return resolve_api(probe_moonep_api(buffer_cls), requested_api(requested))
    with comm.step("choose the MoonEP API") as st:
        choice = resolve_api(probe_moonep_api(buffer_cls, rank=comm.rank), requested_api(requested, rank=comm.rank),
                             rank=comm.rank)
        st.share((choice.api, choice.requested, choice.probe.api))
    everyone = st.gathered
    if any(c[0] != everyone[0][0] for c in everyone):  # every rank sees the same list: every rank raises alike
        seen = {r: f"{api} ({ENV}={req}, installed {found})" for r, (api, req, found) in enumerate(everyone)}
        raise ConfigError(f"[rank {comm.rank}] ranks would use different MoonEP APIs: {seen}. Fix: install the "
                          f"same MoonEP on every node and set the same {ENV} everywhere")
    return choice
