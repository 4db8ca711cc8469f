import os
import zlib

import pytest
import torch


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the test's name unless PEAGLE_TEST_SEED is set."""
    seed = int(os.environ.get("PEAGLE_TEST_SEED", "0")) or zlib.crc32(
        os.environ.get("PYTEST_CURRENT_TEST", "").encode()
    )
    return torch.Generator().manual_seed(seed)


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
    from tests.helpers import tiny_run_inputs

    return tiny_run_inputs(tmp_path_factory.mktemp("tiny"), n=14, words=(4, 12))


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory):
    """A saved one-layer, two-depth drafter of tests/helpers.make_model, to copy and corrupt."""
    from tests.helpers import make_model

    d = tmp_path_factory.mktemp("drafter") / "m"
    make_model(torch.Generator().manual_seed(1), num_layers=1, k=2).save_pretrained(d)
    return d
