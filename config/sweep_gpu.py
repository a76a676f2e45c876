# A sweep for one GPU that answers in minutes, on data that travels with the repository: GPT-2 BPE
# Shakespeare (python prepare.py --tokenizer=gpt2; 1.31 M train tokens), topk and seqtopk at
# K = 8, 4, 2 beside the dense FFN with their active and total parameters, 3 seeds, bf16 (the
# default on such a GPU) and compiled. 6 layers, 256 wide, 64 experts of width 32: about 6x the
# non-embedding parameters of sweep_cpu.py's model. 640 steps of 16 x 256 tokens are two passes
# over the text; four evaluations on the same val batches show whether a run still improves at
# its end.
# Not yet run on a GPU: from the H100 step times in results/README.md, 5 to 10 minutes on one.
# python sweep.py config/sweep_gpu.py
out_root = 'sweeps/gpu'
routers = 'topk,seqtopk'
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 640
dense = 'active,total'
jobs = 4  # small compiled runs leave a GPU idle between kernels: four at once fill it
train_args = ('--dataset=shakespeare --n_layer=6 --n_head=8 --n_embd=256 --n_exp=64 '
              '--exp_dim=32 --block_size=256 --batch_size=16 --learning_rate=1e-3 --min_lr=1e-4 '
              '--warmup_iters=60 --eval_interval=160 --eval_iters=40 --compile=True')
