# The pretraining comparison on word pieces: GPT-2 BPE Shakespeare
# (python prepare.py --tokenizer=gpt2), where a token is closer to the paper's than a character.
# topk and seqtopk at K = 8 and 2 beside the dense FFN with their active parameters, 3 seeds; 64
# experts of width 16 as in sweep_cpu.py, a 64-token context (about 230 characters). The
# 50,257-word output layer is most of the compute: about 75 minutes on 2 CPU cores
# (results/README.md).
# python sweep.py config/sweep_bpe_cpu.py
out_root = 'sweeps/bpe_cpu'
routers = 'topk,seqtopk'
top_ks = '8,2'
seeds = '1,2,3'
max_iters = 500
dense = 'active'
jobs = 2
train_args = ('--dataset=shakespeare --block_size=64 --n_exp=64 --exp_dim=16 '
              '--eval_interval=500 --eval_iters=50')
