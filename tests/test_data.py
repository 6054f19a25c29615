"""Prompt sets that install offline (specc.data)."""
from __future__ import annotations

import itertools
import json

import pytest

from specc.data import load_prompts, sharegpt_conversations
from specc.errors import SpeccError


@pytest.mark.parametrize("name, count", [("mt-bench", 80), ("humaneval", 164)])
def test_builtin_sets(name, count):
    prompts = load_prompts(name)
    assert len(prompts) == count
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == count


def test_limit_is_respected():
    full = load_prompts("mt-bench")
    assert load_prompts("mt-bench", limit=5) == full[:5]
    assert load_prompts("humaneval", limit=3) == load_prompts("humaneval")[:3]
    assert load_prompts("mt-bench", limit=1000) == full


def test_humaneval_prompts_are_code():
    assert all("def " in p for p in load_prompts("humaneval", limit=10))


def test_jsonl_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "first"}\n\n{"prompt": "second", "id": 2}\n{"prompt": "third"}\n')
    assert load_prompts(str(f)) == ["first", "second", "third"]
    assert load_prompts(str(f), limit=2) == ["first", "second"]


def test_jsonl_turns_form(tmp_path):
    # MT-Bench's own layout: the first turn is the prompt.
    f = tmp_path / "turns.jsonl"
    f.write_text(json.dumps({"turns": ["one", "two"]}) + "\n")
    assert load_prompts(str(f)) == ["one"]


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "ok"}\n{"prompt": oops}\n', "line 2"),
    ('{"prompt": "ok"}\n{"text": "no prompt key"}\n', "line 2"),
    ('{"prompt": 3}\n', "line 1"),
    ('["prompt", "a list"]\n', "line 1"),
    ("\n\n", "no prompts"),
])
def test_bad_jsonl(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(SpeccError, match=needle) as e:
        load_prompts(str(f))
    assert "\n" not in str(e.value)


def test_missing_jsonl_and_unknown_name(tmp_path):
    with pytest.raises(SpeccError, match="does not exist"):
        load_prompts(str(tmp_path / "absent.jsonl"))
    with pytest.raises(SpeccError, match="unknown"):
        load_prompts("no-such-set")


def test_sharegpt_conversations():
    convs = list(sharegpt_conversations(limit=50))
    assert len(convs) == 50
    for c in convs:
        assert isinstance(c, dict) and isinstance(c["conversations"], list)
    assert any(c["conversations"] for c in convs)
    turn = next(c["conversations"][0] for c in convs if c["conversations"])
    assert {"from", "value"} <= set(turn)


def test_sharegpt_is_lazy():
    gen = sharegpt_conversations()
    first = list(itertools.islice(gen, 3))
    assert len(first) == 3 and all("conversations" in c for c in first)
