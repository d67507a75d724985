"""Whether ranks on several hosts form one NVLink domain: checked before any handle moves.

FABRIC handles import only between GPUs of one NVLink clique (one fabric
cluster, one clique id). Ranks that span two cliques get an opaque
``CUDA_ERROR_INVALID_HANDLE`` at import (pytorch/pytorch#178989), so PyTorch's
SymmetricMemory all-gathers hostname and clique id at rendezvous and refuses
early. Here every rank contributes its host and ``<cluster UUID>/<clique id>``
to the vote (``exchange.local_vote``), and :func:`check_domain` -- pure, on the
same gathered list on every rank -- refuses a group that spans hosts and
cliques, naming ranks, hosts and cliques, on every rank at once.

A driver older than CUDA 13.4 cannot report its clique (the calls are new
there): then the group is proven instead by the fabric trial (``fabric.py``:
every rank imports its next rank's handle, and a ring over ranks in two
cliques has at least one pair that crosses), and a refusal names the
trial's failures.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError

FIX = ("Fix: run the EP group inside one NVLink clique (`nvidia-smi -q`: the same Fabric ClusterUUID and "
       "CliqueId on every GPU; on GB200/GB300 NVL72, hosts of one rack partition), or keep the group on one host")


def _spans(ranks: list[int]) -> str:
    """``0-3,8`` for [0, 1, 2, 3, 8]."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def placement(peers: Sequence[dict]) -> str:
    """Ranks grouped by (host, clique): ``ranks 0-3 on host a (clique X); ranks 4-7 on host b (clique Y)``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, p in enumerate(peers):
        groups.setdefault((p["host"], p.get("clique") or "unknown"), []).append(r)
    parts = [f"rank(s) {_spans(rs)} on host {host} (clique {clique})" for (host, clique), rs in groups.items()]
    return "; ".join(parts[:12]) + (f"; ... {len(parts) - 12} more group(s)" if len(parts) > 12 else "")


def check_domain(peers: Sequence[dict], rank: int) -> bool:
    """Raise :class:`ConfigError` if the ranks span hosts and report different NVLink cliques.

    Returns True when the group spans hosts and some rank's driver cannot report
    its clique: the caller then proves the domain with the fabric trial before
    any handle moves (:func:`refusal` words its failure)."""
    if len({p["host"] for p in peers}) <= 1:
        return False
    known = {p.get("clique") for p in peers if p.get("clique")}
    if len(known) > 1:
        raise ConfigError(f"[rank {rank}] ranks on several hosts are not all in one NVLink clique, so fabric "
                          f"handles cannot cross between them: {placement(peers)}. {FIX}")
    return any(not p.get("clique") for p in peers)


def refusal(peers: Sequence[dict], failures: dict[int, str], rank: int) -> ConfigError:
    """The error for a multi-host group whose fabric trial failed (cliques not reported)."""
    first = min(failures)
    return ConfigError(f"[rank {rank}] ranks on several hosts could not share fabric memory (their drivers do not "
                       f"report NVLink cliques, so a trial import decided): {placement(peers)}; the trial failed on "
                       f"rank(s) {sorted(failures)}, e.g. rank {first}: {failures[first].splitlines()[0][:300]}. "
                       f"{FIX}; and an IMEX domain that spans the hosts")
