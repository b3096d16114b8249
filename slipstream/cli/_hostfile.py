"""Where the ranks run: hostfile parsing and the ``--include/--exclude/--num_*`` filters.

The result is a *resource map*: an ordered ``{host: [slot, ...]}`` dict. A slot is a device
index on that host (a GPU index, or just a process index on CPU machines). The syntax follows
the DeepSpeed launcher so existing hostfiles and command lines keep working:

- hostfile: one ``hostname slots=N`` per line, ``#`` comments and blank lines allowed;
- ``--include/--exclude``: ``host1@host2:0,2`` (``@`` separates hosts, ``:`` lists slots).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

__all__ = [
    "LaunchError",
    "ResourceMap",
    "filter_resources",
    "is_local_host",
    "parse_hostfile",
    "parse_hostfile_text",
    "select_resources",
]

ResourceMap = dict[str, list[int]]

_HOST_LINE = re.compile(r"^(?P<host>[^\s=#]+)\s+slots\s*=\s*(?P<slots>\d+)$")


class LaunchError(Exception):
    """A user error in the launch request; the CLI prints it as one line and exits with 2."""


def parse_hostfile_text(text: str, source: str) -> ResourceMap:
    """Parse hostfile ``text`` (``source`` names it in errors) into ``{host: [0..slots-1]}``.

    Raises:
        LaunchError: on a malformed line, ``slots=0``, a duplicate host or an empty file; the
            message names ``source``, the 1-based line number and the offending line.
    """
    resources: ResourceMap = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {source}, line {lineno}: {raw.strip()!r}"
        match = _HOST_LINE.match(line)
        if match is None:
            raise LaunchError(f"{where}: expected 'hostname slots=N' (e.g. 'worker-0 slots=8')")
        host, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise LaunchError(f"{where}: slots must be at least 1")
        if host in resources:
            raise LaunchError(f"{where}: host {host!r} is listed twice; keep one line per host")
        resources[host] = list(range(slots))
    if not resources:
        raise LaunchError(f"hostfile {source} lists no hosts; add lines like 'worker-0 slots=8'")
    return resources


def parse_hostfile(path: str | Path) -> ResourceMap:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile_text`)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise LaunchError(f"cannot read hostfile {path}: {err.strerror}") from None
    return parse_hostfile_text(text, str(path))


def _parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse ``host1@host2:0,2`` into ``{host1: None, host2: [0, 2]}`` (None = all slots)."""
    parsed: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.strip().partition(":")
        if not host:
            raise LaunchError(f"{flag} {spec!r}: empty host name; expected 'host1@host2:0,2'")
        slots: list[int] | None = None
        if sep:
            try:
                slots = [int(s) for s in slot_text.split(",")]
            except ValueError:
                raise LaunchError(
                    f"{flag} {spec!r}: slots of {host!r} must be comma-separated integers, "
                    f"got {slot_text!r}"
                ) from None
        if host in parsed:
            raise LaunchError(f"{flag} {spec!r}: host {host!r} appears twice")
        parsed[host] = slots
    return parsed


def filter_resources(
    resources: ResourceMap, include: str | None = None, exclude: str | None = None
) -> ResourceMap:
    """Apply ``--include`` or ``--exclude`` to ``resources`` (host order is kept).

    Raises:
        LaunchError: both filters given, a host or slot not in ``resources``, or nothing left.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; use only one")
    if not include and not exclude:
        return {host: list(slots) for host, slots in resources.items()}
    flag = "--include" if include else "--exclude"
    spec = include or exclude or ""
    wanted = _parse_filter(spec, flag)
    for host, slots in wanted.items():
        if host not in resources:
            known = ", ".join(resources)
            raise LaunchError(f"{flag}: unknown host {host!r}; known hosts: {known}")
        for slot in slots or []:
            if slot not in resources[host]:
                raise LaunchError(
                    f"{flag}: host {host!r} has no slot {slot} (its slots: {resources[host]})"
                )
    result: ResourceMap = {}
    for host, slots in resources.items():
        if include:
            if host in wanted:
                picked = wanted[host]
                result[host] = [s for s in slots if picked is None or s in picked]
        else:
            dropped = wanted.get(host, [])
            if dropped is None:
                continue
            kept = [s for s in slots if s not in dropped]
            if kept:
                result[host] = kept
    if not result:
        raise LaunchError(f"{flag} {spec!r} leaves no slots to run on")
    return result


def select_resources(
    resources: ResourceMap,
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    nproc: int | None = None,
) -> ResourceMap:
    """Filter ``resources`` like the DeepSpeed launcher: include/exclude, then the first
    ``num_nodes`` hosts, then the first ``nproc`` slots on each host.

    Raises:
        LaunchError: bad filter, or ``num_nodes``/``nproc`` below 1 or above what is available.
    """
    active = filter_resources(resources, include, exclude)
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(active):
            raise LaunchError(
                f"--num_nodes {num_nodes}: must be between 1 and the {len(active)} available "
                f"host(s) ({', '.join(active)})"
            )
        active = dict(list(active.items())[:num_nodes])
    if nproc is not None:
        if nproc < 1:
            raise LaunchError(f"--nproc/--num_gpus {nproc}: must be at least 1")
        for host, slots in active.items():
            if nproc > len(slots):
                raise LaunchError(
                    f"--nproc/--num_gpus {nproc}: host {host!r} has only {len(slots)} slot(s) "
                    f"{slots}; lower it or select more slots"
                )
            active[host] = slots[:nproc]
    return active


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (no DNS lookup, so it never blocks)."""
    name = socket.gethostname()
    return host in {"localhost", "127.0.0.1", "::1", name, name.split(".")[0]}
