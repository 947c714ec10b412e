"""Hostfile parsing and ``--include``/``--exclude`` resource filtering.

A hostfile is MPI style, one host per line: ``worker-0 slots=4`` (``#`` starts a comment). A resource pool
maps host -> slot count; active resources map host -> list of slot ids (GPU ids, or local process ids on CPU).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import re

logger = logging.getLogger("deepspeed.launcher")

NODE_SEP = "@"
SLOT_LIST_START = ":"
SLOT_SEP = ","
_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:%]+$")
_SPEC_FORMAT = "NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC=NAME[:SLOT[,SLOT ...]]"


class HostfileError(ValueError):
    """A hostfile line or an include/exclude spec that cannot be used."""


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict[str, int] | None:
    """Read an MPI-style hostfile into ``{host: slots}``; None (with a warning) when the file does not exist."""
    if not os.path.isfile(hostfile_path):
        logger.warning("Unable to find hostfile %s, will proceed with training with local resources only.",
                       hostfile_path)
        return None
    with open(hostfile_path, encoding="utf-8") as fd:
        return _parse_hostfile(fd.readlines(), source=hostfile_path)


def _parse_hostfile(hostfile_lines: list[str], source: str = "hostfile") -> collections.OrderedDict[str, int]:
    """Parse hostfile lines; every bad line raises HostfileError quoting it with its line number."""
    resource_pool: collections.OrderedDict[str, int] = collections.OrderedDict()
    for lineno, raw in enumerate(hostfile_lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, slots = _parse_hostfile_line(line, raw.rstrip("\n"), f"{source}:{lineno}")
        if host in resource_pool:
            raise HostfileError(f"{source}:{lineno}: host {host!r} is listed twice (line {raw.rstrip()!r}); "
                                "each host may appear once, unable to proceed with launching")
        resource_pool[host] = slots
    if not resource_pool:
        raise HostfileError(f"{source}: hostfile is empty (no 'HOSTNAME slots=N' line), "
                            "unable to proceed with launching")
    return resource_pool


def _parse_hostfile_line(line: str, raw: str, where: str) -> tuple[str, int]:
    expected = "expected 'HOSTNAME slots=N [max_slots=M]' with N a positive integer"
    tokens = line.split()
    if len(tokens) < 2 or not _HOST_RE.match(tokens[0]):
        raise HostfileError(f"{where}: bad hostfile line {raw!r}: {expected}")
    fields: dict[str, int] = {}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        if not sep or key not in ("slots", "max_slots") or key in fields:
            raise HostfileError(f"{where}: bad hostfile line {raw!r}: unexpected {token!r}; {expected}")
        if not value.isdigit() or int(value) <= 0:
            raise HostfileError(f"{where}: bad hostfile line {raw!r}: {key}={value!r} is not a positive integer")
        fields[key] = int(value)
    if "slots" not in fields:
        raise HostfileError(f"{where}: bad hostfile line {raw!r}: missing slots=N; {expected}")
    return tokens[0], fields["slots"]


def _stable_remove_duplicates(data: list[int]) -> list[int]:
    seen: set[int] = set()
    return [x for x in data if not (x in seen or seen.add(x))]


def _parse_node_spec(node_config: str, spec: str) -> tuple[str, list[int] | None]:
    """Split ``NAME[:SLOT[,SLOT...]]`` into (name, slots or None)."""
    hostname, sep, slot_text = node_config.partition(SLOT_LIST_START)
    if not hostname or (sep and not slot_text) or SLOT_LIST_START in slot_text:
        raise HostfileError(f"bad node spec {node_config!r} in {spec!r}: expected {_SPEC_FORMAT}")
    if not sep:
        return hostname, None
    slots = []
    for item in slot_text.split(SLOT_SEP):
        if not item.strip().isdigit():
            raise HostfileError(f"bad slot {item!r} in node spec {node_config!r} of {spec!r}: "
                                "slots are non-negative integers separated by ','")
        slots.append(int(item))
    return hostname, slots


def parse_resource_filter(host_info: dict[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> collections.OrderedDict[str, list[int]]:
    """Filter ``{host: [slot, ...]}`` by an include or an exclude string (mutually exclusive).

    The string is ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC=NAME[:SLOT[,SLOT ...]]``; a NAME alone selects
    every slot of that host. Example: ``"worker-0@worker-1:0,2"``. Host order of ``host_info`` is kept so that
    ranks map to nodes in hostfile order; hosts left with no slot are dropped. Included slots come back sorted
    and without duplicates, as DeepSpeed's (``"w:2,0,2"`` -> ``[0, 2]``); exclusion keeps ``host_info``'s order.
    A host named both alone and with slots keeps all its slots (DeepSpeed would silently use only the slots).
    """
    if include_str and exclude_str:
        raise HostfileError(f"--include {include_str!r} and --exclude {exclude_str!r} are mutually exclusive")
    if not include_str and not exclude_str:
        return collections.OrderedDict(host_info)
    parse_str = include_str or exclude_str
    filtered: dict[str, list[int]] = {} if include_str else {h: list(s) for h, s in host_info.items()}
    for node_config in parse_str.split(NODE_SEP):
        hostname, slots = _parse_node_spec(node_config, parse_str)
        if hostname not in host_info:
            raise HostfileError(f"hostname {hostname!r} in {parse_str!r} not found in hostfile "
                                f"(known hosts: {', '.join(host_info)})")
        for slot in slots or ():
            if slot not in host_info[hostname]:
                raise HostfileError(f"no slot {slot} on host {hostname!r} (spec {parse_str!r}); "
                                    f"available slots: {host_info[hostname]}")
        if include_str:
            filtered[hostname] = filtered.get(hostname, []) + list(host_info[hostname] if slots is None else slots)
        elif slots is None:
            filtered[hostname] = []
        else:
            filtered[hostname] = [s for s in filtered[hostname] if s not in slots]
    ordered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
    for host in host_info:
        slots_left = _stable_remove_duplicates(filtered.get(host, []))
        if include_str:
            slots_left.sort()
        if slots_left:
            ordered[host] = slots_left
    return ordered


def parse_inclusion_exclusion(resource_pool: dict[str, int], inclusion: str,
                              exclusion: str) -> collections.OrderedDict[str, list[int]]:
    """Expand ``{host: slots}`` to ``{host: [0..slots)}`` and apply the include/exclude filter."""
    active_resources = collections.OrderedDict((host, list(range(n))) for host, n in resource_pool.items())
    return parse_resource_filter(active_resources, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info: dict[str, list[int]]) -> str:
    """Encode ``{host: [slot, ...]}`` as URL-safe base64 JSON so it survives shells and pdsh."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def decode_world_info(world_info_base64: str) -> collections.OrderedDict[str, list[int]]:
    """Inverse of :func:`encode_world_info` (host order kept)."""
    try:
        text = base64.urlsafe_b64decode(world_info_base64.encode("utf-8")).decode("utf-8")
        info = json.loads(text, object_pairs_hook=collections.OrderedDict)
    except (ValueError, UnicodeDecodeError) as err:
        raise HostfileError(f"--world_info {world_info_base64!r} is not base64 JSON: {err}") from err
    if not isinstance(info, dict) or not all(isinstance(v, list) for v in info.values()):
        raise HostfileError(f"--world_info decodes to {info!r}; expected {{host: [slot, ...]}}")
    return info
