# Pretraining on GPT-2 BPE Shakespeare (python prepare.py --tokenizer=gpt2): topk and seqtopk at
# K = 8, 2 beside dense FFNs of their active parameters, 3 seeds, a 64-token context; the 50,257-
# word output layer is most of the compute: about 75 minutes on 2 CPU cores (results/README.md).
# python experiments/sweep.py experiments/config/sweep_bpe_cpu.py
out_dir = 'sweeps/bpe_cpu'
routers = 'topk,seqtopk'
top_ks = '8,2'
seeds = '1,2,3'
max_iters = 500
dense = 'active'
jobs = 2
train_args = ('--dataset=shakespeare --block_size=64 --n_exp=64 --exp_dim=16 '
              '--eval_interval=500 --eval_iters=50')
