"""Train a Keras model with the custom training loop engine.

python run.py --strategy=mirrored --global_batch=256
    MNIST CNN on every visible device (GPUs, else one CPU replica), 3 epochs.
python run.py --strategy=mirrored --cpu_replicas=2 --dataset=fashion_mnist
    two CPU replicas, Fashion-MNIST from /usr/share/datasets/fashion-mnist.
python run.py --dataset=synthetic --train_steps=200 --model_dir=/tmp/run1
    no files needed; rerun the same command to resume from /tmp/run1.
python run.py --mode=eval --model_dir=/tmp/run1 --dataset=synthetic --strategy=mirrored --cpu_replicas=2
    evaluate /tmp/run1's latest checkpoint on the test split (any strategy), print and log it.
python run.py --strategy=multi_worker_mirrored --num_workers=2 --evaluator --best_metric=accuracy
    two local workers train; a sidecar evaluates each checkpoint, keeps model_dir/best/.
python run.py --flagfile=my.flags      flags from a file
python run.py --help                   every flag, its meaning and units
"""

from __future__ import annotations

import os
import sys

from engine import startup_signals  # noqa: E402  (plain Python: no TensorFlow, no absl)

if __name__ == "__main__":  # the process is a run (not a test importing main): from its first moment,
    startup_signals.install()  # SIGTERM/SIGINT at any moment of start-up: a clean exit (engine/startup_signals.py)

if not os.environ.get("TF_CPP_MIN_LOG_LEVEL"):  # keep TensorFlow's C++ chatter out of the log
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # (start-up lines: engine/observe/startup_noise.py)

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import flags as engine_flags  # noqa: E402
from engine import exit_codes  # noqa: E402
from flags import definitions  # noqa: E402

__doc__ += "\n" + exit_codes.usage() + "\n"  # absl's --help prints this docstring

engine_flags.define_flags()
absl_flags.adopt_module_key_flags(definitions)  # so `--help` lists them


def main(argv) -> int:
    from absl import logging

    # TensorFlow's C++ INFO lines only when --verbosity=0 (absl's INFO) or more is asked for.
    show_info = absl_flags.FLAGS["verbosity"].present and absl_flags.FLAGS.verbosity >= 0
    logging.set_verbosity(logging.INFO if show_info else logging.WARNING)
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]} (flags look like --name=value)", file=sys.stderr)
        return 2
    from engine.errors import StopRun

    try:
        startup_signals.raise_from_now_on()
        config = engine_flags.config_from_flags()
        _cluster_from_environment(config)
        from engine.observe.startup_noise import import_tensorflow

        if show_info:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        import_tensorflow(show_info=show_info)
        if config.strategy == "multi_worker_mirrored" and config.num_workers and not os.environ.get("TF_CONFIG"):
            from engine.distribute.launch import launch

            # Every worker gets the same model_dir (a default one is resolved here, once).
            return launch(
                config.num_workers,
                [*sys.argv[1:], f"--model_dir={config.model_dir}"],
                script=os.path.abspath(__file__),
                evaluator=config.evaluator,
                max_restarts=config.max_restarts,
            )
        config = _role(config)
        if config.mode != "train":
            from engine.controller.evaluator import evaluate

            startup_signals.check()
            startup_signals.handover()  # an evaluation ends by a signal's default action, as before
            evaluate(config)
            return 0
        from engine.controller.trainer import train

        train(config)
        return 0
    except StopRun as err:  # the codes: engine/exit_codes.py
        from engine import exit_codes

        exit_code = err.exit_code
        message = f"{err.prefix}: {err.message}"
        if exit_codes.retryable(exit_code):  # say so: a cluster manager (and a person) may restart it
            message += f" (exit {exit_code}: {exit_codes.describe(exit_code)})"
    # `err` and the trainer's frames are gone now; collect them so TensorFlow's clean-up warnings
    # (e.g. "deleted with unrestored values" after a failed restore) come before the error line.
    import gc

    gc.collect()
    print(message, file=sys.stderr)
    return exit_code


def _cluster_from_environment(config) -> None:
    """Under srun with several tasks (engine/distribute/slurm.py) or in a JobSet pod of Kubeflow
    Trainer's TrainJob (engine/distribute/jobset.py), with no TF_CONFIG, the cluster comes from
    their variables: TF_CONFIG is set here, before TensorFlow loads, so everything after it
    (validation, agreement, watchdog, stall detection) is the same as for a written one."""
    from engine.distribute import jobset, slurm

    built = slurm.configure(config.strategy, config.num_workers, os.environ)
    if built:
        os.environ["TF_CONFIG"] = built
    os.environ.update(jobset.configure(config.strategy, config.num_workers, os.environ))


def _role(config):
    """A TF_CONFIG task of type evaluator is a sidecar: continuous_eval on a local strategy
    (mirrored over its own devices), outside the workers' collectives. TF_CONFIG is checked in a
    second, before TensorFlow loads."""
    if config.strategy != "multi_worker_mirrored":
        return config
    from engine.distribute.cluster import parse_tf_config
    from engine.errors import UserError

    raw = os.environ.get("TF_CONFIG")
    if not (raw and parse_tf_config(raw).is_evaluator):
        if config.mode != "train":
            raise UserError(
                f"--mode={config.mode} runs in one process, outside the workers' collectives: use "
                "--strategy=mirrored (or default), or a TF_CONFIG task of type evaluator"
            )
        parse_tf_config(raw)  # fail in a second, before TensorFlow loads
        return config
    return config.replace(mode="continuous_eval", strategy="mirrored", num_workers=0)


def entry_point() -> None:
    """The console script (`ctl-train`): the same as `python run.py`."""
    startup_signals.install()
    try:
        app.run(main)
    except SystemExit as exit_:
        # absl exits 1 after --help; 1 means "flag error" here, and asking for help is not one.
        if exit_.code == 1 and _HELP_FLAGS.intersection(sys.argv[1:]):
            raise SystemExit(0) from None
        raise
    finally:
        # The run is over (writers and checkpoints closed, atexit handlers still to come): spare
        # the interpreter's last full garbage collection over TensorFlow's and Keras' objects, a
        # visible wait at exit (docs/performance.md#whole-process-time-to-a-result). Objects are
        # still freed by reference count as modules unload.
        import gc

        gc.freeze()


_HELP_FLAGS = {"--help", "-help", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml"}


if __name__ == "__main__":
    entry_point()
