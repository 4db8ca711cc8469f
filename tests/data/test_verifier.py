"""Verifier resolution: hub ids through a fake offline Hugging Face cache (no process-wide hub
setting changed), local directories, the name the export records, and the GGUF conversion cache
keyed by the GGUF's content."""

import json
import os

import pytest

from peagle_ext import data as D
from peagle_ext.data import gguf as G
from peagle_ext.testing import make_fake_hub_cache, make_tiny_verifier

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_verifier(tmp_path_factory.mktemp("v") / "verifier", layers=3)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_id_resolves_through_the_local_cache(tiny_dir, hf_home):
    snap = make_fake_hub_cache(hf_home, "tiny-org/tiny-llama", tiny_dir)
    env_before = dict(os.environ)
    assert D.resolve_verifier_path("tiny-org/tiny-llama") == snap
    model, tok = D.load_verifier("tiny-org/tiny-llama")
    assert model.config.num_hidden_layers == 3 and tok.chat_template
    assert dict(os.environ) == env_before  # no process-wide hub setting touched
    # a pinned revision (the commit the cache holds) resolves too; another one does not
    commit = snap.name
    assert D.resolve_verifier_path("tiny-org/tiny-llama", revision=commit) == snap
    with pytest.raises(D.DataError, match="offline mode"):
        D.resolve_verifier_path("tiny-org/tiny-llama", revision="0" * 40)
    # the export names a hub verifier by its id
    assert D.verifier_name("tiny-org/tiny-llama") == "tiny-org/tiny-llama"


def test_missing_hub_id_offline_is_a_clear_error(hf_home):
    with pytest.raises(D.DataError, match=r"'nobody/nothing'.*not in the local Hugging Face cache.*offline"):
        D.resolve_verifier_path("nobody/nothing")


def test_local_paths_and_names(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent)
    # an existing relative directory is a path, never a hub id, and is named by its absolute path
    assert D.resolve_verifier_path("verifier") == tiny_dir.relative_to(tiny_dir.parent)
    assert D.verifier_name("verifier") == str(tiny_dir.resolve())
    assert D.verifier_name("smollm2") == D.SMOLLM2_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(D.DataError, match="not found"):
        D.resolve_verifier_path(str(tmp_path / "a" / "b" / "c"))


def _fake_conversion(out, gguf):
    """A finished conversion of `gguf` in `out`, as convert_gguf_to_hf leaves it (without the slow part)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / G.CONVERSION_MARKER).write_text(json.dumps({"gguf_name": gguf.name, **G.gguf_fingerprint(gguf)}))


def test_gguf_cache_is_keyed_by_content_not_mtime(tmp_path, monkeypatch):
    """Two environments with the same GGUF bytes (different install times) share one conversion;
    changed bytes (same size, same mtime) convert afresh."""
    gguf = tmp_path / "env1" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(range(200)))
    out = tmp_path / "cache" / "conv"
    _fake_conversion(out, gguf)
    other = tmp_path / "env2" / "m.gguf"
    other.parent.mkdir()
    other.write_bytes(gguf.read_bytes())
    os.utime(other, ns=(10**9, 10**9))  # installed at another time
    assert G.converted_dir_is_current(out, gguf) and G.converted_dir_is_current(out, other)
    calls = []
    monkeypatch.setattr("peagle_ext.data.verifier.convert_gguf_to_hf", lambda g, o: calls.append(g))
    monkeypatch.setattr("peagle_ext.data.verifier._check_hf_dir", lambda p, spec: p)
    assert D.resolve_verifier_path(str(other), cache_dir=str(out)) == out
    assert calls == []
    st = other.stat()
    data = bytearray(other.read_bytes())
    data[10] ^= 0xFF
    other.write_bytes(bytes(data))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not G.converted_dir_is_current(out, other)
    D.resolve_verifier_path(str(other), cache_dir=str(out))
    assert calls == [other]


def test_missing_hub_id_is_downloaded_into_the_cache_unless_unreachable(tiny_dir, hf_home, monkeypatch):
    """Not offline and not cached: one download into the HF cache at the asked revision, then the
    snapshot is used; an unreachable hub is a DataError naming the id, not a hub traceback."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, *, local_files_only=False, cache_dir=None, revision=None, **kw):
        calls.append((repo_id, local_files_only, cache_dir, revision))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        if repo_id == "tiny-org/unreachable":
            raise OSError("Name or service not known")
        return str(make_fake_hub_cache(hf_home, repo_id, tiny_dir))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    snap = D.resolve_verifier_path("tiny-org/tiny-llama", revision="v1")
    assert (snap / "config.json").is_file()
    cache = str(hf_home / "hub")
    assert calls == [("tiny-org/tiny-llama", True, cache, "v1"), ("tiny-org/tiny-llama", False, cache, "v1")]
    with pytest.raises(D.DataError, match=r"'tiny-org/unreachable'.*could not be downloaded.*Name or service"):
        D.resolve_verifier_path("tiny-org/unreachable")
