# One GPU, about two minutes, on GPT-2 BPE Shakespeare (python prepare.py --tokenizer=gpt2): topk
# against seqtopk at K=2 of 64 experts of width 32 (6 layers, 256 wide: 20.84M parameters, 14.75M
# active), 5 seeds, 800 steps, eager, all 10 runs at once. On one H100 (2026-11-27) it took 133 s
# and resolved the paper's pretraining claim on word pieces: seqtopk - topk = -0.0112 [-0.0178,
# -0.0045] nats offline, -0.0090 [-0.0149, -0.0031] causal (results/README.md, "GPU (NVIDIA H100),
# 2026-11-27").
# python experiments/sweep.py experiments/config/sweep_gpu.py
out_dir = 'sweeps/gpu'
routers = 'topk,seqtopk'
top_ks = '2'
seeds = '1,2,3,4,5'
max_iters = 800
jobs = 10  # every run at once: runs this small leave a GPU idle between kernels
train_args = ('--dataset=shakespeare --n_layer=6 --n_head=8 --n_embd=256 --n_exp=64 '
              '--exp_dim=32 --block_size=256 --batch_size=16 --learning_rate=1e-3 --min_lr=1e-4 '
              '--warmup_iters=30 --eval_interval=400 --eval_iters=40')
