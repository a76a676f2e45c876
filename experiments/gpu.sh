#!/usr/bin/env bash
# The GPU tables, each part under its own timeout, every log in one folder (README, "Speed";
# results/README.md, "GPU"). The benchmarks run one at a time, alone; then the parts that time
# nothing run together. PARTS=a,b,... runs only those (the speed tables, about 7 minutes on an
# H100: PARTS=gpu-train,gpu-moe,decode,gpu-decode,tests); all of them take 10 to 12.
#   gpu-train     bench.py, bf16, the gpu size (6 layers, d=512, T=512, 8 experts of 2048,
#                 top-2): the training step of topk, seqtopk and the dense twin, eager and
#                 compiled (CUDA graphs), with MFU, GPU busy time and kernels per step
#   gpu-moe       one MoE layer of that size against the dense FFN, eager and compiled
#   decode        cached decoding, compiled (CUDA graphs), at contexts 64, 512 and 960
#   gpu-decode    the same at the gpu size (contexts 64, 256, 448)
#   bench-train   the training step per router, default model, eager
#   bench-moe     the MoE layer vs the dense FFN (64 experts, top-8), eager
#   tests         the CUDA tests                                      } together,
#   train         a default train.py run, --compile=True              } after the
#   sweep         experiments/config/sweep_gpu.py: topk and seqtopk   } benchmarks
#                 at K=2 on GPT-2 BPE Shakespeare, 5 seeds, 800 steps, all 10 runs at once
# The limits come from the H100 run of 2026-11-27 and, where it did not time a part, the H200's
# (results/README.md, "GPU (NVIDIA H100), 2026-11-27" and "GPU (NVIDIA H200)"): cold compiles
# take most of each compiled part. Run it where data/ is (the runs read data/<dataset>). A GPU
# machine may lack the packages that prepare the data and run the tests: prepare data/ first and
# carry it; wheels/ (pytest and what it needs: pip download pytest -d wheels) is installed when
# present.
#   python prepare.py --tokenizer=gpt2          # data/shakespeare (and train.py makes the other)
#   bash experiments/gpu.sh OUT_DIR             # on the GPU: OUT_DIR/summary.txt, OUT_DIR/*.log
#   bash experiments/gpu.sh OUT_DIR --cpu       # the same parts, tiny, on the CPU (tests run it)
set -u
out=${1:?usage: bash experiments/gpu.sh OUT_DIR [--cpu]}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
# a part its timeout kills mid-compile can leave a broken entry in the compile cache: each run
# compiles into a cache of its own, unless TORCHINDUCTOR_CACHE_DIR names one (the tests' own)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
if [ -d wheels ]; then pip install -q --no-index wheels/*.whl > "$out/wheels.log" 2>&1; fi
: > "$out/summary.txt"
scale=${GPU_SH_SCALE:-1}  # the parts' limits x scale (a test sets GPU_SH_SCALE)
if [ "${2:-}" = --cpu ]; then
  device=(--device=cpu --dtype=float32)
  sizes=(--sizes=tiny --train_steps=1 --repeats=1 --moe_tokens=256 --moe_embd=64 --moe_exp_dim=32
         --moe_n_exp=16 --moe_top_k=4 --moe_repeats=1 --decode_block_size=64 --prompt_tokens=8
         --new_tokens=16 --contexts=16 --steps_at_context=8 --decode_ways=eager)
  # eager and compiled, as on a GPU, one timed step of each: topk alone (each router's cold
  # compile costs about a minute of CPU)
  gpu_size=(--sizes=tiny --routers=topk)
  gpu_decode=(--decode_size=tiny)
  # eager: compiled training through train.py is test_compiled_training_through_train_py_...
  model=("$root/config/tiny.py" --max_iters=2 --eval_interval=2 --eval_iters=1)
  # the GPU preset's sweep (K=2, 5 paired seeds, 10 runs at once) on the tiny model, 2 steps a run
  sweep=(--max_iters=2 "--train_args=$root/config/tiny.py --dataset=shakespeare
    --eval_interval=2 --eval_iters=1")
  decode=()
  scale=${GPU_SH_SCALE:-8}  # cold compiles on a laptop's cores, not a GPU's seconds
else
  device=(--device=cuda --dtype=bfloat16)
  sizes=(--sizes=default)
  gpu_size=(--sizes=gpu --moe_tokens=8192 --moe_embd=512 --moe_exp_dim=2048 --moe_n_exp=8
            --moe_top_k=2)
  gpu_decode=(--decode_size=gpu --decode_block_size=512 --contexts=64,256,448)
  # compiled only, one round a context: the compiles (three, cold: 15.5, 11.8 and 13.9 s on the
  # H100) take most of the part's time
  decode=(--new_tokens=64 --steps_at_context=16 --repeats=1 --decode_ways=compiled)
  model=(--max_iters=300 --compile=True)
  sweep=()  # the preset as it ran on the H100
fi
start=$(date +%s)

part() {  # part NAME SECONDS COMMAND...: the command under a timeout, its output in OUT/NAME.log
  local name=$1 limit=$(( $2 * scale )) t0
  shift 2
  if [ -n "${PARTS:-}" ] && [[ ",$PARTS," != *",$name,"* ]]; then return; fi
  t0=$(date +%s)
  # -k: killed 10 s after the limit (on the H200 a compiling train.py told to stop was still
  # running 2 minutes later)
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/summary.txt"
}

python -c "import sys, torch; print(torch.__version__, sys.version.split()[0],
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" > "$out/versions.txt"
bench=(python "$root/bench.py" "${device[@]}")  # --cpu: tiny sizes last, so that they win
# measured (s): on the H200 bench-train 6 routers < 31, bench-moe 11, a compiled step of the
# default model 60 (3 rounds), tests 73; on the H100 (2026-11-27) gpu-train 130,
# gpu-moe 42, decode 79, gpu-decode 76, tests 83-94, the sweep 137 (133 by its own clock, each run
# 112-127); each limit about twice that, a hang's (tests: 300, for test_graphs.py's five compiled
# train.py runs, unmeasured); after the benchmarks the parts share the GPU
part gpu-train 260 "${bench[@]}" --what=train --routers=dense,topk,seqtopk --ways=eager,compiled \
  --repeats=3 --train_steps=5 --out_dir="$out/gpu-train" "${sizes[@]}" "${gpu_size[@]}"
part gpu-moe 90 "${bench[@]}" --what=moe --ways=eager,compiled --moe_repeats=5 \
  --out_dir="$out/gpu-moe" "${sizes[@]}" "${gpu_size[@]}"
part decode 160 "${bench[@]}" --what=decode --out_dir="$out/decode" "${decode[@]}" "${sizes[@]}"
part gpu-decode 160 "${bench[@]}" --what=decode --out_dir="$out/gpu-decode" "${decode[@]}" \
  "${sizes[@]}" "${gpu_decode[@]}"
part bench-train 40 "${bench[@]}" --what=train --out_dir="$out/bench-train" "${sizes[@]}"
part bench-moe 20 "${bench[@]}" --what=moe --out_dir="$out/bench-moe" "${sizes[@]}"
part tests 300 python -m pytest -q -rs -k cuda "$root/tests/test_model.py" \
  "$root/tests/test_decoding.py" "$root/tests/test_faults.py" "$root/tests/test_scripts.py" \
  "$root/tests/test_graphs.py" &
part train 90 python "$root/train.py" "${model[@]}" --out_dir="$out/train" \
  --overwrite=True &
part sweep 180 python "$root/experiments/sweep.py" "$root/experiments/config/sweep_gpu.py" \
  --out_dir="$out/sweep" "${sweep[@]}"
wait
echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
