"""Data sources: JSONL (.xz), JSON arrays, Parquet, save_to_disk directories (with splits), a hub
dataset id through a fake offline Hugging Face cache, several sources mixed, and the struct
columns `datasets` fills with None."""

import json
import lzma
import sys

import pytest

from peagle_ext import data as D
from peagle_ext.testing import make_fake_hub_cache


def conv(i, tool=False):
    msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    if tool:
        call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        msgs[1:1] = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "42"},
        ]
    return {"messages": msgs}


def answers(convs):
    return [c[-1]["content"] for c in convs]


def test_jsonl_xz_and_json_array(tmp_path):
    xz = tmp_path / "d.jsonl.xz"
    xz.write_bytes(lzma.compress("".join(json.dumps(conv(i)) + "\n" for i in range(3)).encode()))
    assert answers(D.load_conversations(str(xz))) == ["answer 0", "answer 1", "answer 2"]
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([conv(i) for i in range(2)]))
    assert answers(D.load_conversations(str(arr))) == ["answer 0", "answer 1"]
    cut = tmp_path / "cut.jsonl.xz"
    cut.write_bytes(xz.read_bytes()[:30])
    with pytest.raises(D.DataError, match="corrupt or truncated xz"):
        D.load_conversations(str(cut))
    odd = tmp_path / "d.csv"
    odd.write_text("a,b\n")
    with pytest.raises(D.DataError, match="unknown format"):
        D.load_conversations(str(odd))


def test_sharegpt_columns_and_mixing(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(conv(i)) + "\n" for i in range(4)))
    b = tmp_path / "b.jsonl"
    sg = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"b{i}"}]} for i in range(4)]
    b.write_text("".join(json.dumps(x) + "\n" for x in sg))
    # several sources are taken in turn, so a limit keeps the mix even
    assert answers(D.load_conversations([str(a), str(b)], limit=4)) == ["answer 0", "b0", "answer 1", "b1"]
    assert len(D.load_conversations([str(a), str(b)])) == 8


datasets = pytest.importorskip("datasets")


def _dataset(rows):
    return datasets.Dataset.from_list(rows)


def test_parquet_and_none_filled_struct_fields(tmp_path):
    # one row with tool calls: datasets gives every other message tool_calls=None, content may be None
    ds = _dataset([conv(0, tool=True), conv(1)])
    p = tmp_path / "d.parquet"
    ds.to_parquet(str(p))
    convs = D.load_conversations(str(p))
    assert answers(convs) == ["answer 0", "answer 1"]
    assert [m["role"] for m in convs[0]] == ["user", "assistant", "tool", "assistant"]
    assert convs[0][1]["tool_calls"][0]["function"]["name"] == "f"
    assert "tool_calls" not in convs[1][1] and "reasoning_content" not in convs[1][1]


def test_save_to_disk_directory_and_split(tmp_path):
    dd = datasets.DatasetDict({"train": _dataset([conv(0), conv(1)]), "test": _dataset([conv(7)])})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert answers(D.load_conversations(str(tmp_path / "saved"))) == ["answer 0", "answer 1"]
    assert answers(D.load_conversations(str(tmp_path / "saved"), split="test")) == ["answer 7"]
    with pytest.raises(D.DataError, match="no split 'validation'"):
        D.load_conversations(str(tmp_path / "saved"), split="validation")
    _dataset([conv(3)]).save_to_disk(str(tmp_path / "one"))
    assert answers(D.load_conversations(str(tmp_path / "one"))) == ["answer 3"]


def test_hub_dataset_through_the_local_cache(tmp_path, monkeypatch):
    src = tmp_path / "src" / "data"
    src.mkdir(parents=True)
    _dataset([conv(0), conv(1)]).to_parquet(str(src / "train-00000-of-00001.parquet"))
    _dataset([conv(5)]).to_parquet(str(src / "test-00000-of-00001.parquet"))
    home = tmp_path / "hf"
    make_fake_hub_cache(home, "someone/chats", src.parent, repo_type="dataset")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert answers(D.load_conversations("someone/chats")) == ["answer 0", "answer 1"]
    assert answers(D.load_conversations("someone/chats", split="test")) == ["answer 5"]
    with pytest.raises(D.DataError, match="not in the local Hugging Face cache"):
        D.load_conversations("someone/missing")


def test_jsonl_needs_no_datasets(tmp_path):
    """The GPU image has no `datasets`: JSON / JSONL loading must not import it, and a source
    that needs it says which package to install."""
    import subprocess

    from tests.helpers import subprocess_env

    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(conv(0)) + "\n")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "from peagle_ext import data as D\n"
        f"assert D.load_conversations({str(p)!r})[0][-1]['content'] == 'answer 0'\n"
        "try:\n"
        f"    D.load_conversations({str(tmp_path / 'x.parquet')!r})\n"
        "    raise SystemExit('no error')\n"
        "except D.DataError as e:\n"
        "    assert 'peagle_ext[data]' in str(e), e\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stderr
