"""asyncua's standard address space, filled once per process and shared, so that a device starts in milliseconds.

Filling it costs an asyncua server a second of CPU and 38 MB. Here its nodes are pickled once (and cached on
disk); a device unpickles a node when first used. asyncua's own ``init(shelf_file=...)`` does the same from a
dbm file, but costs 80 ms per server to open and does not find dbm.dumb files, the only dbm many Pythons have.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from functools import cache
from importlib.metadata import version
from pathlib import Path

from asyncua import ua
from asyncua.server.address_space import AddressSpace, NodeData, NodeManagementService
from asyncua.server.standard_address_space import standard_address_space

_logger = logging.getLogger(__name__)
_loading = threading.Lock()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "certlm-simulator"


def standard_nodes() -> Mapping[ua.NodeId, bytes]:
    """The pickled nodes of the standard address space. Blocking (a second or two the first time)."""
    with _loading:
        return _standard_nodes(default_cache_dir())


@cache
def _standard_nodes(cache_dir: Path) -> Mapping[ua.NodeId, bytes]:
    cache_file = (
        cache_dir / f"standard-nodes-asyncua-{version('asyncua')}-py{sys.version_info[0]}.{sys.version_info[1]}"
    )
    if cache_file.exists():
        return pickle.loads(cache_file.read_bytes())
    aspace = AddressSpace()
    standard_address_space.fill_address_space(NodeManagementService(aspace))
    nodes = {node_id: pickle.dumps(aspace[node_id], pickle.HIGHEST_PROTOCOL) for node_id in list(aspace.keys())}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Written beside and renamed over, so that concurrent processes never read half a file.
        temporary = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        temporary.write_bytes(pickle.dumps(nodes, pickle.HIGHEST_PROTOCOL))
        os.replace(temporary, cache_file)
    except OSError as error:
        _logger.warning("cannot cache the standard address space in %s: %s", cache_dir, error)
    return nodes


class CopyOnReadNodes(MutableMapping[ua.NodeId, NodeData]):
    """One server's nodes: its own ones, and standard ones unpickled when first read."""

    def __init__(self, standard: Mapping[ua.NodeId, bytes]) -> None:
        self._standard = standard
        self._own: dict[ua.NodeId, NodeData] = {}
        self._deleted: set[ua.NodeId] = set()

    def __getitem__(self, node_id: ua.NodeId) -> NodeData:
        try:
            return self._own[node_id]
        except KeyError:
            if node_id in self._deleted:
                raise
        node = self._own[node_id] = pickle.loads(self._standard[node_id])
        return node

    def __setitem__(self, node_id: ua.NodeId, node: NodeData) -> None:
        self._deleted.discard(node_id)
        self._own[node_id] = node

    def __delitem__(self, node_id: ua.NodeId) -> None:
        if node_id not in self:
            raise KeyError(node_id)
        self._own.pop(node_id, None)
        self._deleted.add(node_id)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._own or (node_id in self._standard and node_id not in self._deleted)

    def __iter__(self) -> Iterator[ua.NodeId]:
        yield from self._own
        yield from (node_id for node_id in self._standard if node_id not in self._own and node_id not in self._deleted)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# The references that lead from a node to the nodes that belong to it.
_BELOW = frozenset({ua.ObjectIds.HasComponent, ua.ObjectIds.HasOrderedComponent, ua.ObjectIds.HasProperty})


def renumber(
    aspace: AddressSpace, root: ua.NodeId, new_id: Callable[[ua.NodeId], ua.NodeId]
) -> dict[ua.NodeId, ua.NodeId]:
    """Give ``root`` and the nodes that belong to it (components and properties, all the way down) the NodeIds
    ``new_id`` makes, every reference to them following: the same nodes under the same browse names, as a firmware
    that numbers its address space anew shows them. What each node does (a method's call, a value's callback) stays
    with it. The old NodeId -> the new one."""
    moved: dict[ua.NodeId, ua.NodeId] = {}
    pending = [root]
    while pending:
        node_id = pending.pop()
        if node_id in moved:
            continue
        moved[node_id] = new_id(node_id)
        pending.extend(
            reference.NodeId
            for reference in aspace[node_id].references
            if reference.IsForward and reference.ReferenceTypeId.Identifier in _BELOW
        )
    neighbours = {reference.NodeId for node_id in moved for reference in aspace[node_id].references}
    for node_id in neighbours - moved.keys():
        for reference in aspace[node_id].references:
            reference.NodeId = moved.get(reference.NodeId, reference.NodeId)
    for old, new in moved.items():
        node = aspace[old]
        del aspace[old]
        node.nodeid = new
        node.attributes[ua.AttributeIds.NodeId].value = ua.DataValue(ua.Variant(new, ua.VariantType.NodeId))
        for reference in node.references:
            reference.NodeId = moved.get(reference.NodeId, reference.NodeId)
        aspace[new] = node
    return moved
