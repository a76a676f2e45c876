#!/usr/bin/env bash
# The GPU tables in one run of about 6 minutes on one H100 or H200, each part under its own
# timeout and every log in one folder (README, "Speed"; results/README.md, "GPU"). The benchmarks
# run one at a time, alone; then the parts that time nothing run together:
#   bench-train   bench.py, bf16: the training step per router, default model, eager
#   bench-moe     the MoE layer vs the dense FFN (64 experts, top-8), eager
#   bench-decode  cached decoding tok/s, eager and compiled (CUDA graphs)
#   bench-*-compiled  the training step (topk, seqtopk) and the MoE layer again, compiled
#   tests         the CUDA tests                                      } together,
#   train         a default train.py run, --compile=True              } after the
#   sweep         topk and seqtopk at K=2 on GPT-2 BPE Shakespeare,   } benchmarks
#                 5 seeds each, all runs at once, with paired intervals
# The limits come from one H200 run (results/README.md, "GPU (NVIDIA H200)"): cold compiles take
# most of each compiled part. Run it where data/ is (the runs read data/<dataset>). A GPU machine
# may lack the packages that prepare the data and run the tests: prepare data/ first and carry
# it; wheels/ (pytest and what it needs: pip download pytest -d wheels) is installed when present.
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
scale=${GPU_SH_SCALE:-1}  # the parts' limits x scale (a test sets GPU_SH_SCALE)
if [ "${2:-}" = --cpu ]; then
  device=(--device=cpu --dtype=float32)
  sizes=(--sizes=tiny --train_steps=2 --repeats=1 --moe_tokens=256 --moe_embd=64 --moe_exp_dim=32
         --moe_n_exp=16 --moe_top_k=4 --moe_repeats=1 --decode_block_size=64 --prompt_tokens=8
         --new_tokens=16 --contexts=16 --steps_at_context=8 --decode_ways=eager)
  model=("$root/config/tiny.py" --max_iters=4 --eval_interval=4 --eval_iters=1)
  sweep_args="$root/config/tiny.py --dataset=shakespeare --eval_interval=4 --eval_iters=1"
  decode=()
  iters=4
  scale=${GPU_SH_SCALE:-8}  # cold compiles on a laptop's cores, not a GPU's seconds
else
  device=(--device=cuda --dtype=bfloat16)
  sizes=(--sizes=default)
  # one round at one long context: the compiles (three, cold: 19, 14 and about 14 s on the H200)
  # take most of the part's time
  decode=(--new_tokens=64 --contexts=960 --steps_at_context=16 --repeats=1)
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
  # -k: killed 10 s after the limit (on the H200 a compiling train.py told to stop was still
  # running 2 minutes later)
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/summary.txt"
}

python -c "import sys, torch; print(torch.__version__, sys.version.split()[0],
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" > "$out/versions.txt"
bench=(python "$root/bench.py" "${device[@]}")  # --cpu: tiny sizes last, so that they win
# measured on the H200 (s): bench-train 6 routers < 31, bench-moe 11, bench-decode > 95 (with 3
# rounds), bench-train-compiled 60 (3 rounds), tests 73 and the sweep 46 (side by side)
part bench-train 40 "${bench[@]}" --what=train --out_dir="$out/bench-train" "${sizes[@]}"
part bench-moe 20 "${bench[@]}" --what=moe --out_dir="$out/bench-moe" "${sizes[@]}"
part bench-decode 110 "${bench[@]}" --what=decode --out_dir="$out/bench-decode" "${decode[@]}" \
  "${sizes[@]}"
part bench-train-compiled 70 "${bench[@]}" --what=train --compile=True --sizes=default \
  --routers=topk,seqtopk --repeats=3 --out_dir="$out/bench-train-compiled" "${sizes[@]}"
part bench-moe-compiled 50 "${bench[@]}" --what=moe --compile=True --moe_repeats=5 \
  --out_dir="$out/bench-moe-compiled" "${sizes[@]}"
part tests 90 python -m pytest -q -rs -k cuda "$root/tests/test_model.py" \
  "$root/tests/test_decoding.py" "$root/tests/test_faults.py" &
part train 90 python "$root/train.py" "${model[@]}" --compile=True --out_dir="$out/train" \
  --overwrite=True &
part sweep 90 python "$root/experiments/sweep.py" --routers=topk,seqtopk --top_ks=2 \
  --seeds=1,2,3,4,5 --jobs=10 --max_iters=$iters --out_dir="$out/sweep" --train_args="$sweep_args"
wait
echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
