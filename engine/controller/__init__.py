"""The controller: the outer Python loop and what it keeps between runs.

  trainer.py      builds everything, runs compiled loops, decides when to evaluate/checkpoint/log
  schedule.py     loop lengths and what is due at a step, as pure functions of the step
  state.py        what is built in strategy.scope() and checkpointed, and its restore
  checkpoints.py  tf.train.Checkpoint + CheckpointManager (non-chief workers in a temp dir)
  run_record.py   model_dir/config.json: written on a fresh run, compared on resume
"""
