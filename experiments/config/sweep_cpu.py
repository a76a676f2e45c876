# Pretraining at sparsity 1/8..1/32 with dense baselines (FFN width K*16 and 64*16): the paper's
# Table 3 routers and batchtopk, 5 seeds, 100 val batches shared by every run (RoPE, the default,
# keeps runs off the bigram plateau); about 2 h on 2 CPU cores (results/README.md).
# python experiments/sweep.py experiments/config/sweep_cpu.py
out_dir = 'sweeps/pretrain_cpu'
routers = 'topk,seqtopk,relu,batchtopk'
top_ks = '8,4,2'
seeds = '1,2,3,4,5'
max_iters = 800
dense = 'active,total'
jobs = 2  # two runs at once, one thread each: 1.4x the throughput of one two-thread run here
train_args = '--n_exp=64 --exp_dim=16 --eval_interval=800 --eval_iters=100'
