# The paper's Table 1 protocol at toy scale on 2 CPU cores (13 to 25 minutes here, depending on load):
# pretrain TopK at K=8 once, then fine-tune it with topk vs seqtopk at K = 8 and 2 for the same
# steps, plus training-free SeqTopK (the TopK checkpoint evaluated with seqtopk routing).
# python sweep.py config/sweep_finetune_cpu.py
out_root = 'sweeps/finetune_cpu'
routers = 'topk,seqtopk'
top_ks = '8,2'
seeds = '1'
finetune = True
pretrain_k = 8
pretrain_iters = 1500
max_iters = 500
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=250 --warmup_iters=50 --learning_rate=1e-3'
