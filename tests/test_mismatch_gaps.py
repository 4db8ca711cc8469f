"""tools/mismatch_gaps.py and the eval report's mismatch details: a difference from the baseline
is rescored in fp32 and called a near-tie only when the verifier's two tokens are within bf16's
resolution of each other."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle_ext.eval import summarize_k
from peagle_ext.serving import GreedyResult, SpecResult
from peagle_ext.testing import make_tiny_verifier

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import mismatch_gaps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_report_records_the_first_difference_and_its_prefix():
    spec = [SpecResult([5, 6, 7], 3, 0.1, 2, [1, 1]), SpecResult([5, 9], 3, 0.1, 2, [0, 0])]
    base = [GreedyResult([5, 6, 7], 3, 0.1), GreedyResult([5, 8, 1], 3, 0.1)]
    r = summarize_k(2, ["a", "b"], spec, base, [[1, 2], [3]])
    same, diff = r["prompts"]
    assert same["mismatch"] is None and same["lossless"]
    assert diff["mismatch"] == {"position": 1, "token": 9, "baseline_token": 8, "prefix": [3, 5]}


def test_gaps_tell_a_near_tie_from_a_mismatch(tmp_path):
    from transformers import AutoModelForCausalLM

    vm = AutoModelForCausalLM.from_pretrained(make_tiny_verifier(tmp_path / "v"), dtype=torch.float32).eval()
    prefix = [3, 17, 40, 9]
    with torch.no_grad():
        z = vm(input_ids=torch.tensor([prefix])).logits[0, -1]
    order = torch.argsort(z, descending=True).tolist()
    top, second, last = order[0], order[1], order[-1]

    def row(spec_tok, base_tok):
        return {"id": "p", "mismatch": {"position": 4, "token": spec_tok, "baseline_token": base_tok, "prefix": prefix}}

    tie, far, short = mismatch_gaps.gaps(vm, [row(second, top), row(last, top), row(None, top)], torch.device("cpu"))
    assert tie["gap_fp32"] == pytest.approx(float(z[top] - z[second]), rel=1e-5)
    assert tie["fp32_argmax_is"] == "baseline"
    assert tie["kind"] == ("near-tie" if tie["gap_fp32"] <= 4 * tie["bf16_resolution"] else "mismatch")
    assert far["kind"] == "mismatch" and far["gap_fp32"] > 4 * far["bf16_resolution"]
    assert short["kind"] == "length"
    assert mismatch_gaps.bf16_resolution(1.0) == 2.0**-7 and mismatch_gaps.bf16_resolution(-20.0) == 2.0**-3


@pytest.mark.parametrize(
    "content, says",
    [
        ("not json", "--eval"),
        ('{"x": 1}', "no prompts"),
        ('{"prompts": [{"lossless": false, "mismatch": {}}]}', "older"),
    ],
)
def test_bad_reports_exit_2_naming_the_file(tmp_path, content, says):
    f = tmp_path / "r.json"
    f.write_text(content)
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mismatch_gaps.py"), "--eval", str(f)], capture_output=True, text=True
    )
    assert p.returncode == 2 and says in p.stderr and str(f) in p.stderr
    assert "Traceback" not in p.stderr
