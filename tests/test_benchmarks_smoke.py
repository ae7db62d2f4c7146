"""Smoke test of the benchmark workloads (benchmarks/workloads.py): building, saving, checking."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import workloads

needs_data = pytest.mark.skipif(not (workloads.DEFAULT_DATA / "bfcl").is_dir(),
                                reason="no ../shared/data here")


def test_chat_and_shared_prefix_need_no_data(tmp_path):
    chat = workloads.build("chat", 40, data=tmp_path)
    assert len(chat) == 40 and all(it.body["messages"][0]["role"] == "user" for it in chat)
    prefix = workloads.build("shared-prefix", 5, data=tmp_path)
    systems = {it.body["messages"][0]["content"] for it in prefix}
    users = {it.body["messages"][1]["content"] for it in prefix}
    assert len(systems) == 1 and len(users) == 5
    assert 3000 < len(systems.pop()) < 6000  # ~1k tokens


@needs_data
@pytest.mark.parametrize("kind", ["json", "tools", "mixed"])
def test_build_save_load(kind, tmp_path):
    items = workloads.build(kind, 6, seed=1)
    assert len(items) == 6
    assert [it.id for it in items] == [it.id for it in workloads.build(kind, 6, seed=1)]
    path = tmp_path / "w.jsonl"
    workloads.save(items, path)
    assert workloads.build(str(path), 0) == items
    assert len(workloads.build(str(path), 9)) == 9  # cycled


def test_checks():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    item = workloads.WorkItem("j", "json", {"messages": [], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert workloads.check(item, '{"n": 3}', []) is None
    assert workloads.check(item, '{"n": "3"}', []) is not None
    assert workloads.check(item, '{"n": 3', []).startswith("not JSON")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    item = workloads.WorkItem("t", "tools", {"messages": [], "tools": [tool]})
    assert workloads.check(item, "", [("f", json.dumps({"n": 1}))]) is None
    assert workloads.check(item, "", []) == "no tool call"
    assert "unknown tool" in workloads.check(item, "", [("g", "{}")])
    assert workloads.check(item, "", [("f", "{}")]) is not None


def test_markdown():
    table = workloads.markdown([{"a": 1.234, "b": None}], [("a", "A", "{:.1f}"), ("b", "B", "{}")])
    assert table.splitlines() == ["| A | B |", "|---|---|", "| 1.2 | - |"]
