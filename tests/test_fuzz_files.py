"""Fuzz targets, one per file format peagle reads: checkpoint config.json, trainer state, hidden-state
cache index, data JSONL and the --config YAML. The property: whatever the bytes, the reader either
accepts them or raises the documented error type (ValueError / DataError / TrainError) naming the
file; never another exception, a hang or a crash.

Brief in CI (derandomized, a few seconds). Longer, fresh runs:
    PEAGLE_HYPOTHESIS_SCALE=50 PEAGLE_HYPOTHESIS_RANDOM=1 pytest tests/test_fuzz_files.py
"""

from __future__ import annotations

import json
import shutil

import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from tests.helpers import hypothesis_settings


def fuzz(n: int):
    return hypothesis_settings(n, list(HealthCheck))


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mutate(doc, path_and_value):
    """Replace the value at one key path of a nested dict (or add it)."""
    path, value = path_and_value
    d = doc
    for k in path[:-1]:
        nxt = d.get(k) if isinstance(d, dict) else None
        if not isinstance(nxt, dict):
            return doc
        d = nxt
    if isinstance(d, dict):
        d[path[-1]] = value
    return doc


def _paths(doc, prefix=()):
    out = []
    for k, v in doc.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _paths(v, (*prefix, k))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            out += [(*prefix, k)]
    return out


def test_fuzz_checkpoint_config_json(tiny_drafter_dir, tmp_path_factory):
    from peagle_ext.model import PEagleDraftModel

    base = json.loads((tiny_drafter_dir / "config.json").read_text())
    paths = _paths(base)
    work = tmp_path_factory.mktemp("cfg") / "m"
    shutil.copytree(tiny_drafter_dir, work)

    @fuzz(60)
    @given(st.lists(st.tuples(st.sampled_from(paths), json_values), min_size=1, max_size=3))
    def run(edits):
        doc = json.loads(json.dumps(base))
        for e in edits:
            doc = _mutate(doc, e)
        (work / "config.json").write_text(json.dumps(doc))
        try:
            PEagleDraftModel.from_pretrained(work)
        except ValueError as e:
            assert "config.json" in str(e) or "checkpoint" in str(e) or "tensor" in str(e), e

    run()


def test_fuzz_trainer_state(tmp_path_factory):
    from safetensors.torch import save_file

    from peagle_ext.train.checkpoint import check_trainer_state, load_state_files

    d = tmp_path_factory.mktemp("state")
    save_file({"t0": torch.zeros(3), "t1": torch.zeros(2, dtype=torch.uint8)}, str(d / "s.safetensors"))
    markers = st.sampled_from(["__tensor__", "__ndarray__", "__tuple__", "__items__", "__float__", "dtype"])
    tricky = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.one_of(markers, st.text(max_size=6)), inner, max_size=3)
        ),
        max_leaves=10,
    )

    @fuzz(150)
    @given(st.one_of(tricky, st.text(max_size=40)))
    def run(doc):
        f = d / "s.json"
        f.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        try:
            st_ = load_state_files(f, d / "s.safetensors")
            check_trainer_state(st_, d)
        except ValueError as e:
            assert str(d) in str(e), e

    run()


def test_fuzz_cache_index(tmp_path_factory):
    from peagle_ext.data import DataError, HiddenStateCache

    d = tmp_path_factory.mktemp("cache")
    entry = st.fixed_dictionaries(
        {"file": st.one_of(st.just("shard-000000.safetensors"), st.text(max_size=20)), "sha256": json_values},
        optional={"bytes": json_values, "rows": json_values},
    )
    index = st.fixed_dictionaries(
        {"version": st.one_of(st.just(1), json_values)},
        optional={
            "meta": json_values,
            "layout": json_values,
            "shards": st.one_of(json_values, st.dictionaries(st.text(max_size=4), entry, max_size=3)),
        },
    )

    @fuzz(120)
    @given(st.one_of(index, json_values))
    def run(doc):
        (d / "index.json").write_text(json.dumps(doc))
        try:
            c = HiddenStateCache(d)
        except DataError as e:
            assert "index.json" in str(e), e
            return
        for i in c.shard_ids:
            assert c.index["shards"][str(i)]["file"] == f"shard-{i:06d}.safetensors"
            c.has_shard(i)

    run()


def test_fuzz_data_jsonl(tmp_path_factory):
    from peagle_ext.data import DataError, load_conversations

    d = tmp_path_factory.mktemp("data")
    message = st.fixed_dictionaries({"role": json_values, "content": json_values})
    good = st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": st.text(max_size=8)}
                ),
                max_size=4,
            )
        }
    )
    record = st.one_of(good, st.fixed_dictionaries({"messages": st.one_of(json_values, st.lists(message))}))

    @fuzz(120)
    @given(st.lists(st.one_of(record.map(json.dumps), st.text(max_size=30)), min_size=1, max_size=4))
    def run(lines):
        f = d / "d.jsonl"
        f.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        try:
            load_conversations(str(f))
        except DataError as e:
            assert str(f) in str(e), e

    run()


def test_fuzz_config_yaml(tmp_path_factory):
    import yaml

    from peagle_ext.train import TrainError, TrainSettings, settings_from

    d = tmp_path_factory.mktemp("yaml")
    names = TrainSettings.field_names()

    @fuzz(150)
    @given(
        st.one_of(st.dictionaries(st.sampled_from(names), json_values, max_size=4), json_values, st.binary(max_size=40))
    )
    def run(doc):
        f = d / "c.yaml"
        if isinstance(doc, bytes):
            f.write_bytes(doc)
        else:
            f.write_text(yaml.safe_dump(doc))
        try:
            settings_from({}, str(f))
        except TrainError as e:
            assert "--" in str(e), e

    run()
