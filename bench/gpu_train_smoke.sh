#!/usr/bin/env bash
# The real trainer (`peagle train`) on 2 GPUs under torchrun, NCCL: a tiny random Llama verifier
# (python_tests/tiny_verifier.py, head dim 64) and synthetic chats, 4 steps, global batch 2 rows:
#   1 process with --grad-accum 2  vs  DDP 2 ranks  vs  FSDP2 2 ranks (then resumed on 1 GPU to 6)
# and the final weights / per-step losses compared. Usage: bash bench/gpu_train_smoke.sh WORKDIR
# (DEVICE=cpu: the same on CPU processes with gloo, a dry run of this script)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${1:?work dir}
mkdir -p "$W"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$PWD/python_tests
python3 -c "
from tiny_verifier import make_tiny_verifier, make_chat_jsonl
make_tiny_verifier('$W/verifier', hidden=128, heads=2, kv_heads=1)
make_chat_jsonl('$W/chats.jsonl', n=48)
" || exit 1
flags="train --verifier $W/verifier --data $W/chats.jsonl --seq-len 256 --num-depths 4 --num-layers 1 --device ${DEVICE:-cuda}
 --dtype bfloat16 --checkpoint-every 2 --val-every 2 --warmup-steps 1 --lr 3e-3 --schedule constant --log-every 1
 --no-progress"
st=0
python3 -m peagle_ext.cli $flags --max-steps 4 --grad-accum 2 --output "$W/single" > "$W/single.log" 2>&1 || { st=1; echo "single failed"; tail -20 "$W/single.log"; }
for mode in ddp fsdp; do
  torchrun --standalone --nproc_per_node 2 -m peagle_ext.cli $flags --max-steps 4 --grad-accum 1 --dist $mode \
    --output "$W/$mode" > "$W/$mode.log" 2>&1 || { st=1; echo "$mode failed"; tail -20 "$W/$mode.log"; }
done
python3 -m peagle_ext.cli $flags --max-steps 6 --grad-accum 2 --resume --output "$W/fsdp" > "$W/fsdp_resume.log" 2>&1 \
  || { st=1; echo "fsdp resume on 1 GPU failed"; tail -20 "$W/fsdp_resume.log"; }
python3 - "$W" <<'PY' || st=1
import json, sys
from pathlib import Path
from safetensors.torch import load_file
w = Path(sys.argv[1])
def weights(p):
    return load_file(str(p / "model.safetensors"))
def losses(run):
    recs = [json.loads(x) for x in (w / run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("split") == "train"}
ref = weights(w / "single" / "checkpoint-4")
ok = True
for run in ("ddp", "fsdp"):
    got = weights(w / run / "checkpoint-4")
    num = den = worst = 0.0
    for k, a in ref.items():
        if not a.is_floating_point():
            continue
        d = (got[k].double() - a.double())
        num += float((d * d).sum()); den += float((a.double() ** 2).sum()); worst = max(worst, float(d.abs().max()))
    rel = (num ** 0.5) / den ** 0.5
    la, lb = losses("single"), losses(run)
    dl = max(abs(la[s] - lb[s]) / abs(la[s]) for s in range(1, 5))
    print(f"{run} 2 GPUs vs 1 GPU after 4 steps: weights rel. L2 {rel:.3g}, max |diff| {worst:.3g}; "
          f"per-step loss max rel. diff {dl:.3g}")
    ok &= rel < 2e-2 and dl < 2e-2
res = losses("fsdp")
print("fsdp run resumed on 1 GPU reached step", max(res), "loss", res[max(res)])
ok &= max(res) == 6
print("train smoke:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
grep -hE "ranks|DDP|FSDP|resum" "$W"/*.log | head -8
exit $st
