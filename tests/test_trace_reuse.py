"""tools/trace_reuse.py: per request, its new blocks and how many a later request uses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "trace_reuse.py"


def load():
    spec = importlib.util.spec_from_file_location("trace_reuse", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_new_blocks_and_their_later_use(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    reqs = [([0, 1, 2], 10), ([0, 1, 3], 20), ([0, 4], 30), ([0, 1, 3, 5], 40)]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(h),
                                         "output_length": out, "hash_ids": h}) + "\n"
                             for i, (h, out) in enumerate(reqs)))
    tool = load()
    # (output, input, hit prefix, new blocks, of them used later)
    assert tool.rows(str(trace)) == [(10, 1536, 0, 3, 2), (20, 1536, 2, 1, 1),
                                     (30, 1024, 1, 1, 0), (40, 2048, 3, 1, 0)]
    tool.main(str(trace))
    out = capsys.readouterr().out
    assert "share reused" in out and "{0.7: 1}" in out
