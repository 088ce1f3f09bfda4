"""The controller: the outer Python loop and what it keeps between runs.

trainer.py      the training job: runs a built run's compiled loops, decides when to
                evaluate/checkpoint/log and call the actions; rolls back a bad step
build.py        builds a run (strategy, data, schedule, state, actions, writers, loops): BuiltRun
evaluator.py    the evaluation job: --mode=eval and --mode=continuous_eval (the sidecar)
job.py          what both jobs do first: the job's context, seeding, the Task class and its data
preflight.py    --preflight: evaluation, summaries, export signature and checkpoint tried on one
                batch before the first training loop
evaluation.py   one evaluation of the whole test split and its console line
schedule.py     loop lengths and what is due at a step, as pure functions of the step
state.py        the Task and what is built in strategy.scope() and checkpointed, and its restore
checkpoint_names.py  how checkpoints are named on disk (no TensorFlow: the launcher reads them too)
checkpoints.py  tf.train.Checkpoint + CheckpointManager (non-chief workers in a temp dir); a resume
                from the newest checkpoint that reads back whole, damaged ones set aside
run_lock.py     model_dir/.lock: one training run per directory (the chief's flock)
run_record.py   model_dir/config.json: written on a fresh run, compared on resume, every change named
storage.py      a write into model_dir that fails (disk full, read-only): one line, the partial
                checkpoint removed, the intact one named (StorageFailed, exit 3)
error_files.py  model_dir/errors/: a failure's whole traceback when the console gets one line
best.py         --best_metric: the best checkpoint and model in model_dir/best/
rollback.py     --on_nonfinite=rollback: back to the last checkpoint, the data past the bad batch
export.py       the exporters: model.keras and the SavedModel with a raw-input serving signature
actions/        host-side work at known points (after a loop, after an eval, at the end):
                histograms, eval summaries, EMA evaluation, best, early stopping, export
"""
