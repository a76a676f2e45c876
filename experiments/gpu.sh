#!/usr/bin/env bash
# The GPU tables in one run of about 5 minutes on one H100, each part under its own timeout and
# every log in one folder (README, "Speed"; results/README.md, "GPU"):
#   tests         the CUDA tests
#   bench-eager   bench.py, bf16: training step per router, MoE layer vs dense FFN (64 experts,
#                 top-8), cached decoding tok/s, eager and compiled (CUDA graphs)
#   bench-*-compiled  the training step (topk, seqtopk) and the MoE layer again, compiled
#   train         a default train.py run, --compile=True
#   sweep         in the time left: topk and seqtopk at K=2 on GPT-2 BPE Shakespeare, 5 seeds
#                 each, all runs at once on the one GPU, tabulated with paired intervals
# Run it where data/ is (the runs read data/<dataset>). A GPU machine may lack the packages that
# prepare the data and run the tests: prepare data/ first and carry it; wheels/ (pytest and what
# it needs: pip download pytest -d wheels) is installed when present.
#   python prepare.py --tokenizer=gpt2          # data/shakespeare (and train.py makes the other)
#   bash experiments/gpu.sh OUT_DIR             # on the GPU: OUT_DIR/summary.txt, OUT_DIR/*.log
#   bash experiments/gpu.sh OUT_DIR --cpu       # the same parts, tiny, on the CPU (tests run it)
set -u
out=${1:?usage: bash experiments/gpu.sh OUT_DIR [--cpu]}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
# a part its timeout kills mid-compile can leave a broken entry in the compile cache: each run
# compiles into a cache of its own
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
if [ -d wheels ]; then pip install -q --no-index wheels/*.whl > "$out/wheels.log" 2>&1; fi
: > "$out/summary.txt"
budget=300  # seconds, on the GPU
scale=1     # the parts' limits x scale
if [ "${2:-}" = --cpu ]; then
  device=(--device=cpu --dtype=float32)
  sizes=(--sizes=tiny --train_steps=2 --repeats=1 --moe_tokens=256 --moe_embd=64 --moe_exp_dim=32
         --moe_n_exp=16 --moe_top_k=4 --moe_repeats=1 --decode_block_size=64 --prompt_tokens=8
         --new_tokens=16 --contexts=16 --steps_at_context=8 --decode_ways=eager)
  model=("$root/config/tiny.py" --max_iters=4 --eval_interval=4 --eval_iters=1)
  sweep_args="$root/config/tiny.py --dataset=shakespeare --eval_interval=4 --eval_iters=1"
  decode=()
  iters=4
  scale=8  # cold compiles on a laptop's cores, not a GPU's seconds
else
  device=(--device=cuda --dtype=bfloat16)
  sizes=()
  # 128 tokens and one long context: the compiles (three, cold) take most of the part's time
  decode=(--new_tokens=128 --contexts=960 --steps_at_context=32)
  model=(--max_iters=300)
  sweep_args="--dataset=shakespeare --n_layer=6 --n_head=8 --n_embd=256 --n_exp=64 --exp_dim=32
    --block_size=256 --batch_size=16 --learning_rate=1e-3 --min_lr=1e-4 --warmup_iters=30
    --eval_interval=200 --eval_iters=20"
  iters=200
fi
start=$(date +%s)

part() {  # part NAME SECONDS COMMAND...: the command under a timeout, its output in OUT/NAME.log
  local name=$1 limit=$(( $2 * scale )) t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/summary.txt"
}

python -c "import sys, torch; print(torch.__version__, sys.version.split()[0],
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" > "$out/versions.txt"
bench=(python "$root/bench.py" "${device[@]}")  # --cpu: tiny sizes last, so that they win
part tests 70 python -m pytest -q -rs -k cuda "$root/tests/test_model.py" \
  "$root/tests/test_decoding.py" "$root/tests/test_faults.py"
part bench-train 30 "${bench[@]}" --what=train --out_dir="$out/bench-train" "${sizes[@]}"
part bench-moe 20 "${bench[@]}" --what=moe --out_dir="$out/bench-moe" "${sizes[@]}"
part bench-decode 75 "${bench[@]}" --what=decode --out_dir="$out/bench-decode" "${decode[@]}" \
  "${sizes[@]}"
part bench-train-compiled 45 "${bench[@]}" --what=train --compile=True --sizes=default \
  --routers=topk,seqtopk --out_dir="$out/bench-train-compiled" "${sizes[@]}"
part bench-moe-compiled 25 "${bench[@]}" --what=moe --compile=True \
  --out_dir="$out/bench-moe-compiled" "${sizes[@]}"
part train 35 python "$root/train.py" "${model[@]}" --compile=True --out_dir="$out/train" \
  --overwrite=True
left=$(( budget - ($(date +%s) - start) / scale ))
part sweep $(( left > 30 ? left : 30 )) python "$root/experiments/sweep.py" --routers=topk,seqtopk \
  --top_ks=2 --seeds=1,2,3,4,5 --jobs=10 --max_iters=$iters --out_dir="$out/sweep" \
  --train_args="$sweep_args"
echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
