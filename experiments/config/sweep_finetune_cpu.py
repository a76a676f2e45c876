# The paper's Table 1 protocol at toy scale: per seed, pretrain TopK at K=8 (1000 steps), fine-tune
# it 200 steps with each router at K = 8, 4, 2, plus the training-free rows; 3 seeds, about 35
# minutes on 2 CPU cores (results/README.md).
# python experiments/sweep.py experiments/config/sweep_finetune_cpu.py
out_dir = 'sweeps/finetune_rope_cpu'
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
