import os

import pytest
import torch

import peagle_ext

HAS_CUDA = torch.cuda.is_available() and peagle_ext.has_cuda_kernels()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA build of peagle_ext")


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the test's name unless PEAGLE_TEST_SEED is set."""
    import zlib
    seed = int(os.environ.get("PEAGLE_TEST_SEED", "0")) or zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    g = torch.Generator().manual_seed(seed)
    return g


def devices():
    return ["cpu"] + (["cuda"] if HAS_CUDA else [])


def random_documents(n: int, g: torch.Generator, *, max_doc_len: int = 200, pad_tail: int = 0,
                     p_loss: float = 0.7):
    """Random packed sequence: documents of random length, trailing padding, random loss mask."""
    doc = torch.empty(n, dtype=torch.int32)
    pos, k = 0, 0
    while pos < n - pad_tail:
        ln = int(torch.randint(1, max_doc_len + 1, (1,), generator=g))
        ln = min(ln, n - pad_tail - pos)
        doc[pos:pos + ln] = k
        pos += ln
        k += 1
    doc[pos:] = -1
    lm = torch.rand(n, generator=g) < p_loss
    lm[doc < 0] = False
    return doc, lm


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP barrier stalls on a busy 2-core CI.
    Test files that build tiny models opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama verifier directory and a small chat JSONL: (verifier_dir, data_path)."""
    from tiny_verifier import make_chat_jsonl, make_tiny_verifier
    d = tmp_path_factory.mktemp("tiny")
    v = make_tiny_verifier(d / "verifier")
    data = make_chat_jsonl(d / "chat.jsonl", n=14, turns=1, words=(4, 12))
    return v, data
