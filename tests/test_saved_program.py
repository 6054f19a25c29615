"""Eager engines keep their programs on disk (specc/saved_program.py). The fast JSON reader gives
exactly torch's own reading (after it, both go through torch's deserializer); that the programs
compute what the captured ones do is checked by every eager engine test against Hugging Face, and,
for sampling, by test_engine's eager-vs-inductor test (inductor compiles the captured programs)."""
import json

from specc.saved_program import from_json


def test_reader_matches_torchs(tiny_model_dir, tmp_path):
    import specc
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    path = specc.compile(tiny_model_dir, drafter="ngram", tree="topk:2,2", output_dir=tmp_path / "e", max_len=32,
                         prefill_chunk=4, progress=False, modes="greedy")
    manifest = json.loads((path / "specc.json").read_text())
    for name, entry in manifest["graphs"].items():
        data = json.loads((path / entry["file"]).read_text())
        assert "stack_trace" not in json.dumps(data)  # same engine, same bytes (test_config)
        assert from_json(schema.ExportedProgram, data) == _dict_to_dataclass(schema.ExportedProgram, data), name
