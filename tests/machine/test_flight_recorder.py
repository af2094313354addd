"""NCCL's flight-recorder dumps read as collective records: the hang diagnosis names the op and the rank on
GPUs too. The dumps here are written by hand in the documented shape (a pickled dict of `entries`)."""

from __future__ import annotations

import pickle

import pytest

from labkit.machine import flight_recorder, launcher
from labkit.machine.emulate import diagnose_hang


def _entry(seq: int, state: str, name: str = "nccl:all_reduce", size=(1024,)) -> dict:
    return {
        "record_id": seq,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": name,
        "state": state,
        "input_sizes": [list(size)],
        "output_sizes": [list(size)],
        "input_dtypes": ["Float"],
        "process_group": ("0", "default_pg"),
    }


def _dump(tmp_path, rank: int, entries: list[dict]) -> None:
    with open(tmp_path / f"{flight_recorder.DUMP_PREFIX}{rank}", "wb") as f:
        pickle.dump({"version": "2.10", "pg_config": {}, "entries": entries}, f)


def test_a_skipped_all_reduce_is_named_with_the_rank_that_skipped_it(tmp_path):
    _dump(tmp_path, 0, [_entry(1, "completed"), _entry(2, "started")])  # rank 0 waits in all_reduce #2
    _dump(tmp_path, 1, [_entry(1, "completed")])  # rank 1 never called it
    records = flight_recorder.read_collective_records(tmp_path)  # rank 2 left no dump
    assert set(records) == {0, 1} and records[0]["pending"][0]["op"] == "all_reduce"
    text, culprit = diagnose_hang(records, 3)
    assert "all_reduce #2 (float[1024]) on rank 0 never completed" in text
    assert "rank 1 was running elsewhere after 1 collective(s)" in text and "rank 1 is missing" in text
    assert culprit == 1 and "rank 2 left no record" in text


def test_a_mismatched_shape_is_a_mismatch(tmp_path):
    _dump(tmp_path, 0, [_entry(1, "started", size=(1024,))])
    _dump(tmp_path, 1, [_entry(1, "started", size=(2048,))])
    text, culprit = diagnose_hang(flight_recorder.read_collective_records(tmp_path), 2)
    assert "mismatched collective" in text and culprit == 1


def test_the_ranks_are_told_where_to_dump(tmp_path):
    env = flight_recorder.env_for(tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    # the newer name wins when both are set (FlightRecorder.cpp): both point at the launch's folder
    assert (
        env["TORCH_FR_DUMP_TEMP_FILE"]
        == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
        == str(tmp_path / "nccl_trace_rank_")
    )
    assert (
        flight_recorder.dump_prefix(
            {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/a_", "TORCH_FR_DUMP_TEMP_FILE": "/b_"}
        )
        == "/b_"
    )
    assert flight_recorder.dump_prefix({}) is None
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"torn")  # a dump cut short is skipped, not an error
    assert flight_recorder.read_collective_records(tmp_path) == {}


def test_without_any_dump_a_failure_is_reported_at_once(tmp_path, monkeypatch):
    # a rank that raised on NCCL leaves no dump: the launcher must not wait for dumps that will never come
    def no_sleep(seconds):
        raise AssertionError("waited for a dump although no rank dumped")

    monkeypatch.setattr(launcher.time, "sleep", no_sleep)
    assert launcher._records(tmp_path, 2, nccl=True) == {}
    _dump(tmp_path, 0, [_entry(1, "started")])  # one rank dumped: the other gets its moment
    assert flight_recorder.dumped_ranks(tmp_path) == [0]
    with pytest.raises(AssertionError, match="waited"):
        launcher._records(tmp_path, 2, nccl=True)


def test_after_a_torchrun_job_hung_the_dumps_are_read_from_the_command_line(tmp_path, capsys):
    _dump(tmp_path, 0, [_entry(1, "completed"), _entry(2, "started")])
    _dump(tmp_path, 1, [_entry(1, "completed")])
    assert flight_recorder.main([str(tmp_path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "dumps of ranks [0, 1] of 2" in out and "all_reduce #2 (float[1024]) on rank 0 never completed" in out
    )
    assert flight_recorder.main([str(tmp_path / "none"), "--world-size", "2"]) == 1
    assert "no readable dump" in capsys.readouterr().out


def _op_entry(record_id, seq, state, name, group=("0", "default_pg"), p2p=0, size=(1024,)) -> dict:
    entry = _entry(seq, state, name, size) | {"record_id": record_id, "process_group": group}
    return entry | ({"collective_seq_id": 0, "p2p_seq_id": p2p} if p2p else {})


def test_each_group_and_point_to_point_count_on_their_own(tmp_path):
    # Lab 01's layouts: a tensor-parallel subgroup's all-reduces and the default group's count separately;
    # a pipeline's sends and receives carry p2p_seq_id with collective_seq_id 0. Rank 0 hangs in its
    # subgroup's all_reduce #3 (the default group is at #1); rank 1, in the same subgroup, called only two.
    tp = ("3", "tp_group")
    _dump(
        tmp_path,
        0,
        [
            _op_entry(1, 1, "completed", "nccl:all_reduce"),
            _op_entry(2, 1, "completed", "nccl:all_reduce", tp),
            _op_entry(3, 2, "completed", "nccl:all_reduce", tp),
            _op_entry(4, 3, "started", "nccl:all_reduce", tp),
        ],
    )
    _dump(
        tmp_path,
        1,
        [_op_entry(1, 1, "completed", "nccl:all_reduce")]
        + [_op_entry(1 + i, i, "completed", "nccl:all_reduce", tp) for i in (1, 2)],
    )
    records = flight_recorder.read_collective_records(tmp_path)
    assert records[0]["pending"][0] | {"shapes": None} == {
        "seq": 3,
        "op": "all_reduce",
        "shapes": None,
        "dtype": "float",
        "peer": None,
        "group": "tp_group",
    }
    assert records[1]["count"] == 2 and records[1]["last"]["group"] == "tp_group"
    text, culprit = diagnose_hang(records, 2)
    assert "all_reduce #3 (float[1024]) in tp_group on rank 0 never completed" in text
    assert "rank 1 is missing" in text and culprit == 1


def test_a_pipeline_send_without_its_receive_is_named_with_its_peer(tmp_path):
    _dump(
        tmp_path,
        0,
        [
            _op_entry(1, 0, "completed", "nccl:send 0->1", p2p=1),
            _op_entry(2, 0, "started", "nccl:send 0->1", p2p=2),
        ],
    )
    _dump(tmp_path, 1, [_op_entry(1, 0, "completed", "nccl:recv 0->1", p2p=1)])
    records = flight_recorder.read_collective_records(tmp_path)
    assert records[0]["pending"][0]["op"] == "send" and records[0]["pending"][0]["peer"] == 1
    text, culprit = diagnose_hang(records, 2)
    assert "send #2 to rank 1 (float[1024]) on rank 0 never completed" in text
    assert "last: recv #1 from rank 0" in text and culprit == 1
