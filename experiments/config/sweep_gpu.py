# One GPU, minutes, on GPT-2 BPE Shakespeare (python prepare.py --tokenizer=gpt2): 6 layers, 256
# wide, 64 experts of width 32, two passes over the text, bf16 and compiled; 5 to 10 minutes on an
# H100 by results/README.md's step times (not yet run on a GPU).
# python experiments/sweep.py experiments/config/sweep_gpu.py
out_dir = 'sweeps/gpu'
routers = 'topk,seqtopk'
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 640
dense = 'active,total'
jobs = 4  # small compiled runs leave a GPU idle between kernels: four at once fill it
train_args = ('--dataset=shakespeare --n_layer=6 --n_head=8 --n_embd=256 --n_exp=64 '
              '--exp_dim=32 --block_size=256 --batch_size=16 --learning_rate=1e-3 --min_lr=1e-4 '
              '--warmup_iters=60 --eval_interval=160 --eval_iters=40 --compile=True')
