# Pretraining at higher sparsity, with dense baselines: the paper's Table 3 routers (topk,
# seqtopk with offline and causal evaluation, relu as ReMoE) and batchtopk, 5 seeds: about 2 h on
# 2 CPU cores (measured: results/README.md).
# python sweep.py config/sweep_cpu.py
# 64 experts of width 16 on the default 4-layer, 128-wide model: K = 8, 4, 2 is sparsity 1/8..1/32.
# Dense rows: FFN width K*16 (the MoE's active parameters at each K) and 64*16 = 1024 (its total).
# The recipe: RoPE (the default), so no run sits on the bigram plateau that learned positions
# give, and 100 val batches, the same in every run, so seeds differ only by what they train.
out_root = 'sweeps/pretrain_cpu'
routers = 'topk,seqtopk,relu,batchtopk'
top_ks = '8,4,2'
seeds = '1,2,3,4,5'
max_iters = 800
dense = 'active,total'
jobs = 2  # two runs at once, one thread each: 1.4x the throughput of one two-thread run here
train_args = '--n_exp=64 --exp_dim=16 --eval_interval=800 --eval_iters=100'
