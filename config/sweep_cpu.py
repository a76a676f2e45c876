# Pretraining at higher sparsity, with dense baselines: the paper's Table 3 routers (topk, seqtopk, relu
# as ReMoE) and batchtopk, with the default gates and with the paper's (topk+route_scale=1), 3 seeds:
# about 2 hours on 2 CPU cores (measured: results/README.md).
# python sweep.py config/sweep_cpu.py
# 64 experts of width 16 on the default 4-layer, 128-wide model: K = 8, 4, 2 is sparsity 1/8 .. 1/32.
# Dense rows: FFN width K*16 (the MoE's active parameters at each K) and 64*16 = 1024 (its total).
out_root = 'sweeps/cpu'
routers = 'topk,seqtopk,relu,batchtopk,topk+route_scale=1'
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 800
dense = 'active,total'
jobs = 2  # two runs at once, one thread each: 1.4x the throughput of one two-thread run here
train_args = '--n_exp=64 --exp_dim=16 --eval_interval=400'
