# One GPU: TinyStories (GPT-2 BPE), every router and the dense rows. Prepare its data once, with
# the network (or the dataset in the local `datasets` cache):
#   python prepare.py --source=roneneldan/TinyStories
#   python experiments/sweep.py experiments/config/sweep_gpu_tinystories.py
import router as _router  # names starting with _ are not settings
out_dir = 'sweeps/gpu_tinystories'
routers = ','.join(_router.ROUTERS)
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 5000
dense = 'active,total'
train_args = ('--dataset=tinystories --n_layer=8 --n_head=8 --n_embd=512 --n_exp=64 '
              '--exp_dim=256 --block_size=512 --batch_size=32 --eval_interval=500 --eval_iters=50 '
              '--learning_rate=6e-4 --min_lr=6e-5 --compile=True')
