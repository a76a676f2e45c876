# Pretraining sparsity sweep on 2 CPU cores (about an hour): python sweep.py config/sweep_cpu.py
# 32 experts of width 32 on the default 4-layer, 128-wide model; K = 8, 4, 2 (sparsity 1/4 .. 1/16).
out_root = 'sweeps/cpu'
routers = 'topk,seqtopk'
top_ks = '8,4,2'
seeds = '1,2'
max_iters = 1500
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=500'
