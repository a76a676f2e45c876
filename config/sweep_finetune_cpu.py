# The paper's Table 1 protocol at toy scale on 2 CPU cores, 3 seeds; about 35 minutes on the
# 2-core machine (measured: results/README.md). Per seed: pretrain TopK at K=8 (1000 steps), then
# fine-tune it for 200 steps (the paper's budget) with topk, mrltopk, batchtopk and seqtopk at
# K = 8, 4, 2, plus the training-free rows: the TopK checkpoint evaluated with each routing at each
# K. Same val batches.
# python sweep.py config/sweep_finetune_cpu.py
out_root = 'sweeps/finetune_rope_cpu'
routers = 'topk,mrltopk,batchtopk,seqtopk'
top_ks = '8,4,2'
seeds = '1,2,3'
finetune = True
pretrain_k = 8
pretrain_iters = 1000
max_iters = 200
finetune_args = '--learning_rate=1e-3 --warmup_iters=20'  # a fresh AdamW on the loaded weights
jobs = 2
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=200 --eval_iters=100'
