"""Which host each rank runs on, kept beside the run log, so the straggler view can name a node.

The tracker logs ``perf/slowest_rank`` (a global rank: a number, as every
record value is). On several nodes the question is *which node* is slow;
:func:`record_rank_hosts` answers it once per run: every rank contributes its
host name in one ``all_gather_object`` (at start-up, never per step) and the
writer rank saves the list, indexed by global rank, as ``LOG_DIR/hosts.json``::

    {"hosts": ["node1", "node1", "node2", "node2"]}

``twinkle-megatron summary`` reads it (:func:`read_rank_hosts`) and names the
node of the slowest rank. A restarted job writes it again (its ranks may have
landed on other nodes): the file describes the latest start.
"""

from __future__ import annotations

import json
import os
import socket
from typing import List, Optional

import torch.distributed as dist

FILE_NAME = "hosts.json"


def record_rank_hosts(log_dir: str, writer_rank: int = 0, hostname: Optional[str] = None) -> List[str]:
    """Gather every rank's host name (collective over the world) and save them on ``writer_rank``.

    ``hostname`` defaults to :func:`socket.gethostname`. Returns the list (index:
    global rank) on every rank. Without ``torch.distributed`` initialised: this
    process's host alone.
    """
    own = hostname if hostname is not None else socket.gethostname()
    if dist.is_available() and dist.is_initialized():
        hosts: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, own)
        rank = dist.get_rank()
    else:
        hosts, rank = [own], 0
    names = [str(host) for host in hosts]
    if rank == writer_rank:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, FILE_NAME)
        with open(path + ".tmp", "w", encoding="utf-8") as file:
            json.dump({"hosts": names}, file)
        os.replace(path + ".tmp", path)  # a reader never sees half a file
    return names


def read_rank_hosts(log_dir: str) -> Optional[List[str]]:
    """The host of each global rank from ``log_dir/hosts.json``; None when there is no such file.

    A file that is not what :func:`record_rank_hosts` writes is a ``ValueError`` naming it.
    """
    path = os.path.join(log_dir, FILE_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            hosts = json.load(file)["hosts"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a rank-to-host list ({error})") from None
    if not isinstance(hosts, list) or not all(isinstance(host, str) for host in hosts):
        raise ValueError(f"{path}: 'hosts' must be a list of host names")
    return hosts
