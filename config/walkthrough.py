# The walkthrough's short training (walkthrough.ipynb): the default model for 300 steps, about 40 s
# on 2 CPU cores, long enough for routing to differ between tokens.
# python train.py config/walkthrough.py --router=seqtopk --out_dir=out-walkthrough-seqtopk
max_iters = 300
eval_interval = 300
eval_iters = 5
log_interval = 50
warmup_iters = 30
