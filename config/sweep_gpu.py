# A larger sweep for one GPU: GPT-2 BPE Shakespeare, 64 experts, K = 8, 4, 2, three seeds.
# python sweep.py config/sweep_gpu.py
out_root = 'sweeps/gpu'
routers = 'topk,seqtopk,batchtopk,relu'
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 5000
train_args = ('--dataset=shakespeare --n_layer=8 --n_head=8 --n_embd=512 --n_exp=64 --exp_dim=256 '
              '--block_size=512 --batch_size=32 --eval_interval=500 --eval_iters=50 --learning_rate=6e-4 '
              '--min_lr=6e-5 --compile=True')
