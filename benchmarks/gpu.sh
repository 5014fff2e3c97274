#!/usr/bin/env bash
# The GPU checks, in one run on one CUDA machine (docs/benchmarks.md quotes what it printed):
#   1. the device=cuda path on the default tiny models: a port, a bf16 cast, a planted bug in fp32 and in bf16;
#   2. a 7B LLaVA port (LLaVA-1.5-7B's shape: Llama-7B text model, CLIP ViT-L/14 at 336 px, random init) against
#      transformers, fp32, both models on the GPU as the memory plan chooses;
#   3. a 70B Llama, refused in one line by the memory plan before anything is built;
#   4. a 7B Llama against its own bf16 cast;
#   5. benchmarks/bench.py on the GPU: capture side by side, comparison throughput.
# Each run's exit code, verdict, phases, planned and measured memory go to stdout and gpu-results.json; each
# run's own output to runs.log; the benchmark's to bench.log and bench-<device>.json.
#   OUT=<dir> bash benchmarks/gpu.sh [quick]     quick: tiny shapes and device=cpu, to try the script here
#   GPU_RUNS="tiny-port llava-7b-port bench"       only these runs (names below; default all), for a short lease
#   BENCH_ARGS="--reps 11 --only-capture"          bench.py's arguments instead of the defaults
# Needs paritylab installed (pip install -e .); MLflow is not needed (tracking=off). Run directories go to a
# temporary directory that is removed.
set -uo pipefail
repository=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quick=${1:-}
device=cuda
[ "$quick" = quick ] && device=cpu

if [ "$quick" = quick ]; then
  llava_7b=(++model.build.hidden_size=64 ++model.build.layers=2 ++model.build.heads=4 ++model.build.vocab_size=256)
  llama_7b=(++model.build.hidden_size=64 ++model.build.layers=2 ++model.build.heads=4)
else
  llava_7b=(++model.build.hidden_size=4096 ++model.build.layers=32 ++model.build.heads=32
    ++model.build.intermediate_size=11008 ++model.build.vocab_size=32064 ++model.build.vision_hidden_size=1024
    ++model.build.vision_layers=24 ++model.build.vision_heads=16 ++model.build.image_size=336
    ++model.build.patch_size=14 inputs.prompt_length=32)
  llama_7b=(++model.build.hidden_size=4096 ++model.build.layers=32 ++model.build.heads=32
    ++model.build.kv_heads=32 ++model.build.intermediate_size=11008 ++model.build.vocab_size=32000
    inputs.prompt_length=128)
fi
llama_70b=(++model.build.hidden_size=8192 ++model.build.layers=80 ++model.build.heads=64 ++model.build.kv_heads=8
  ++model.build.intermediate_size=28672 ++model.build.vocab_size=128256 inputs.prompt_length=128)
planted=(candidate.ports.llava.build._target_=tests.faulty.scaled_port
  +candidate.ports.llava.build.module=llm.layers.1.attention.wo +candidate.ports.llava.build.scale=1.05)

python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

selected() { [ -z "${GPU_RUNS:-}" ] || [[ " $GPU_RUNS " == *" $1 "* ]]; }

run() { # name, time limit (s), overrides...
  local name=$1 limit=$2
  shift 2
  selected "$name" || return 0
  local started
  started=$(date +%s.%N)
  echo "== $name: $*" >>"$out/runs.log"
  (cd "$work" && PYTHONPATH="$repository${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" python3 -m paritylab "$@" \
    "device=$device" tracking=off "hydra.run.dir=$work/$name") >>"$out/runs.log" 2>&1
  local code=$?
  python3 "$repository/benchmarks/gpu_summary.py" "$name" "$code" "$started" "$work/$name" "$out"
  rm -rf "${work:?}/$name" # traces of a 7B model are tens of GB
}

run tiny-port 120 model=llava candidate=port
run tiny-bf16 120 model=llava candidate=bf16
run tiny-planted 120 model=llava candidate=port "${planted[@]}"
run tiny-planted-bf16 120 model=llava candidate=port candidate.dtype=bfloat16 "${planted[@]}"
run llava-7b-port 360 model=llava candidate=port "${llava_7b[@]}"
run llama-70b-refused 90 model=llama candidate=bf16 "${llama_70b[@]}"
run llama-7b-bf16 240 model=llama candidate=bf16 "${llama_7b[@]}"
if [ "$quick" = quick ]; then
  bench=(--quick --reps 2)
else
  bench=(--reps 5)
fi
[ -n "${BENCH_ARGS:-}" ] && read -r -a bench <<<"$BENCH_ARGS"
selected bench || exit 0
(cd "$work" && timeout 240 python3 "$repository/benchmarks/bench.py" "${bench[@]}" --device "$device" --no-libraries \
  --skip-memory --skip-logging --whole-run-rounds 0 --output "$out/bench-$device.json") 2>&1 | tee "$out/bench.log"
