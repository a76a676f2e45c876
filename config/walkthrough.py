# The walkthrough's short training (walkthrough.ipynb): the default model for 150 steps, about 40 s
# on 2 CPU cores, long enough for routing to differ between tokens.
# python train.py config/walkthrough.py --router=seqtopk --out_dir=out-walkthrough-seqtopk
max_iters = 150
eval_interval = 150
eval_iters = 5
log_interval = 50
warmup_iters = 30
