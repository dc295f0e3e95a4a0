"""The metrics schema: what a peer writes is what every reader gets back, old and cut logs still read."""

import ast
import json
from pathlib import Path

from p2pdiloco.runtime import schema
from p2pdiloco.runtime.metrics import JsonlSink

PACKAGE = Path(__file__).resolve().parents[2] / "p2pdiloco"


def test_a_record_comes_back_as_written(tmp_path):
    sink = JsonlSink(tmp_path / "p.jsonl")
    written = [schema.Start(peer="p", val_loss=5.5, n_params=10),
               schema.Window(peer="p", step=10, tokens=1280, loss=4.0, tokens_per_s=100.0),
               schema.Round(peer="p", round=1, version=1, applied=True, members=["p", "q"], bytes_sent=7),
               schema.Summary(peer="p", rounds=1, final_val=3.0)]
    for record in written:
        sink.write(record)
    sink.close()
    assert schema.read_records(tmp_path / "p.jsonl") == written
    assert schema.of_kind(written, schema.Round)[0].island == 2


def test_old_cut_and_unknown_lines_read_without_failing(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"kind": "round", "time": 1.0, "peer": "p", "round": 3, "a_key_from_the_future": 1}),
             json.dumps({"kind": "a_kind_from_the_future", "time": 2.0}),
             json.dumps([1, 2]),
             '{"kind": "window", "time": 3.0, "lo']  # the last line of a killed peer
    path.write_text("\n".join(lines))
    records = schema.read_records(path)
    assert len(records) == 1 and isinstance(records[0], schema.Round)
    assert records[0].round == 3 and records[0].bytes_sent is None  # an old log lacks it: None, not a crash
    assert schema.read_records(tmp_path / "missing.jsonl") == []


def test_every_kind_is_registered_once_and_numbers_skip_flags_and_text():
    assert set(schema.KINDS) == {"start", "joined", "window", "contribute", "round", "resync", "checkpoint",
                                 "restore", "summary"}
    numbers = schema.Window(peer="p", step=3, loss=1.5, in_flight=True).numbers()
    assert numbers["step"] == 3 and numbers["loss"] == 1.5
    assert "in_flight" not in numbers and "peer" not in numbers and "time" not in numbers
    # step-indexed sinks plot windows at their inner step, rounds at their round, and skip the rest
    assert schema.Window(step=30).sink_step == 30 and schema.Round(round=4, version=9).sink_step == 4
    assert schema.Start().sink_step is None and schema.Checkpoint().sink_step is None


def test_the_peer_writes_metrics_only_through_the_schema():
    """A record written as `metrics.write("kind", key=...)` would bypass the typed definition."""
    trees = [ast.parse(path.read_text()) for path in [PACKAGE / "peer.py", *sorted((PACKAGE / "parts").glob("*.py"))]]
    writes = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and node.func.attr == "write"
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "metrics"]
    assert len(writes) >= 8
    for call in writes:
        assert len(call.args) == 1 and not call.keywords, ast.unparse(call)
        arg = call.args[0]
        assert isinstance(arg, ast.Name) or (isinstance(arg, ast.Call) and ast.unparse(arg.func).startswith(
            "schema.")), ast.unparse(call)


def test_a_round_record_takes_the_outcome_whole_by_the_records_own_field_names():
    """protocol.outcomes writes what a round record says of an outcome once: every name is a field of the record,
    and every outcome field that describes the round reaches it."""
    import dataclasses

    from p2pdiloco.protocol.outcomes import Committed
    from p2pdiloco.protocol.remote import Member

    member = Member(peer="p", name="a", version=3, digest="d", tokens=10, steps=2, budget=1.0)
    outcome = Committed(reason="ok", members=[member], weights=[1.0], seconds=2.5, sync_seconds=1.5, sync_ended=9.0,
                        quorum_seconds=0.5, grace_seconds=0.25, group_id="g", bytes_sent=7, bytes_received=8,
                        codec_cpu_seconds=0.1, deadline_seconds=30.0, allreduce_bytes_model=100,
                        excluded={"x": "why"}, bounded={"p": "cap"}, waited_for_island=True, merged_tokens=10)
    fields = outcome.record()
    assert set(fields) <= {f.name for f in dataclasses.fields(schema.Round)}
    record = schema.Round(peer="a", **fields)
    assert (record.outcome, record.round_seconds, record.sync_ended, record.members, record.tokens_merged) == \
        ("committed", 2.5, 9.0, ["a"], 10)
    assert (record.bytes_sent, record.bytes_received, record.excluded, record.bounded) == (7, 8, {"x": "why"},
                                                                                          {"p": "cap"})
    assert record.waited_for_island and not record.adopted and record.allreduce_bytes_model == 100
