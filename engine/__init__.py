"""A custom training loop engine for Keras models under tf.distribute.

Data flows one way: flags -> config -> distribute (strategy) -> data -> task -> loop -> update
-> observe (TensorBoard, console) / controller (checkpoints).

This docstring and each package's own are the module map (one line per module); BUILD.md says
where to change what, docs/ how to use it.

The core a researcher touches (replica context, inside compiled loops):
  task.py        the Task: build_model, build_optimizer, build_extras, per_example_loss, train_step, eval_step
  task_state.py  what a Task holds (models, optimizers, variables as attributes): found, checkpointed
  losses.py      replica_loss: sum of per-example losses / GLOBAL batch (+ scaled regularisation)
  step_context.py  what a step may call while traced: gradient hand-over, all_reduce, all_gather, per-example seeds
  loop.py        compiled inner loops: next batch -> strategy.run(step) -> reduce -> judge -> count
  update.py      the handed-over gradients of every optimizer: one all-reduce, unscale, finite check,
                 clip, apply
  randomness.py  per-replica, per-step seeds for random layers and stateless ops
  ema.py         --ema_decay: the moving average of the weights, updated in the compiled step
  optimizers.py  optimizer registry, schedules and weight decay
Around it:
  data/        sources, file readers, tf.data pipelines at the global batch
  models/      --model resolution (registered, module/file function, keras.applications) and the built-in networks
  tasks/       ready Tasks and `--task` resolution
  distribute/  strategy factory, TF_CONFIG, flag agreement, watchdog, launcher, preemption
  observe/     TensorBoard writers, monitor, images, hparams, console progress and report
  controller/  the outer loop (trainer), the evaluation job, job set-up, schedule, state and
               checkpoints, run record, best checkpoint
  config.py, errors.py   the frozen run configuration and the errors a run stops with
  exit_codes.py  the one table of exit codes: permanent ones small, the ones a restart cures >= 128
  startup_signals.py  SIGTERM/SIGINT from run.py's first lines until training runs: a clean exit (154)
  refused_combinations.py  the flag combinations refused before training, one line each
  user_code.py  imports `package.module:NAME` / `path/file.py:NAME` for --task and --model
  compat.py     every private TensorFlow/Keras API the engine touches, one named function each
"""

__version__ = "0.1.0"
