"""Distribution plumbing: everything between the flags and a working `tf.distribute` strategy.

cluster.py      TF_CONFIG parsing and checks (no TensorFlow import: run.py fails fast)
slurm.py        TF_CONFIG from an srun step's SLURM variables (no TensorFlow import)
jobset.py       TF_CONFIG from a Kubeflow TrainJob's JobSet pod indexes (no TensorFlow import)
ray_job.py      `python -m engine.distribute.ray_job`: run.py on Ray Train workers, retried by Ray's policy
strategy.py     the strategy factory, logical CPU devices, chief/worker placement
watchdog.py     rendezvous before the multi-worker strategy; peer watchdog during training
agreement.py    start-up check that every worker runs the same flags
launch.py       `--num_workers=N`: local worker processes on 127.0.0.1, restarted (--max_restarts)
stall.py        --stall_timeout: a thread that ends a worker whose steps stopped, naming who stalled
preemption.py   SIGTERM/SIGINT, checked at loop boundaries and agreed across workers
"""
