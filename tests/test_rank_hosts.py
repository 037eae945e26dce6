"""Rank-to-host map (``logging/rank_hosts.py``) and the summary line that names the node of the slowest rank."""

from __future__ import annotations

import json

import pytest

from twinkle_megatron.cli import format_summary
from twinkle_megatron.logging.rank_hosts import FILE_NAME, read_rank_hosts, record_rank_hosts
from twinkle_megatron.logging.runlog import RunLogError, load_run
from twinkle_megatron.testing.distributed import run_distributed

HOSTS = ["node1", "node1", "node2", "node2"]


def _record_as_node(log_dir: str) -> list[str]:
    import torch.distributed as dist

    return record_rank_hosts(log_dir, hostname=HOSTS[dist.get_rank()])  # two ranks per "node"


def test_every_rank_gets_the_map_and_only_the_writer_rank_writes_it(tmp_path):
    results = run_distributed(_record_as_node, 4, args=(str(tmp_path),))
    assert results == [HOSTS] * 4
    assert json.loads((tmp_path / FILE_NAME).read_text()) == {"hosts": HOSTS}
    assert read_rank_hosts(str(tmp_path)) == HOSTS
    assert [path.name for path in tmp_path.iterdir()] == [FILE_NAME]  # no temporary file left


def test_without_torch_distributed_this_host_alone(tmp_path):
    assert record_rank_hosts(str(tmp_path), hostname="solo") == ["solo"]
    assert read_rank_hosts(str(tmp_path)) == ["solo"]
    assert read_rank_hosts(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("content", ["not json", '{"ranks": []}', '{"hosts": [1, 2]}', '{"hosts": "node1"}'])
def test_a_bad_file_is_an_error_naming_it(tmp_path, content):
    (tmp_path / FILE_NAME).write_text(content)
    with pytest.raises(ValueError, match=FILE_NAME):
        read_rank_hosts(str(tmp_path))


def _log(tmp_path, slowest: list[int]) -> str:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "perf/slowest_rank": rank, "loss": 1.0}) + "\n"
                            for step, rank in enumerate(slowest, start=1)))
    return str(path)


def test_summary_names_the_node_of_the_slowest_rank(tmp_path):
    log = _log(tmp_path, [3, 2, 0, 3])
    (tmp_path / FILE_NAME).write_text(json.dumps({"hosts": HOSTS}))
    assert format_summary(load_run(log)).splitlines()[-1] == (
        "slowest node: node2 held the slowest rank in 3 of 4 records (ranks 2, 3), node1 in 1 (ranks 0); "
        "last: rank 3 on node2")


def test_summary_without_a_map_is_unchanged(tmp_path):
    summary = format_summary(load_run(_log(tmp_path, [1, 0])))
    assert "slowest node" not in summary and summary.splitlines()[-1].startswith("perf/slowest_rank")


def test_a_slowest_rank_outside_the_map_is_refused(tmp_path):
    (tmp_path / FILE_NAME).write_text(json.dumps({"hosts": HOSTS[:2]}))
    with pytest.raises(RunLogError, match=r"slowest ranks \[3\]"):
        format_summary(load_run(_log(tmp_path, [0, 3])))
