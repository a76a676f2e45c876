# A seconds-long smoke run: python train.py config/tiny.py
n_layer = 2
n_head = 2
n_embd = 32
n_exp = 4
top_k = 2
exp_dim = 32
block_size = 32
batch_size = 8
max_iters = 20
eval_interval = 10
eval_iters = 2
log_interval = 5
warmup_iters = 5
