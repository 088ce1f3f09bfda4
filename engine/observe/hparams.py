"""The HParams dashboard: the run's flags as hyperparameters, its final metrics as the session's
metrics, so several runs (tensorboard --logdir runs/) compare in one table.

The session lives in the `eval` run and references its scalars by tag (group ""): the HParams
plugin looks metrics up in run <session>/<group>, so the values shown are the last evaluation's,
over the whole test set. A resumed run does not write a second session.
"""

from __future__ import annotations

from tensorboard.plugins.hparams import api as hp


def hparam_values(flags: dict, extra: dict) -> dict:
    """Flag values as the types the HParams plugin accepts (bool, int, float, str)."""
    values = {}
    for name, value in {**flags, **extra}.items():
        values[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return values


def write_session(writer, values: dict, metric_names, trial_id: str) -> None:
    """Writes the experiment config and this run's session start with `writer` (a tf.summary
    writer) as default."""
    with writer.as_default(step=0):
        hp.hparams_config(
            hparams=[hp.HParam(name) for name in values],
            metrics=[hp.Metric(name, display_name=f"eval {name}") for name in metric_names],
        )
        hp.hparams(values, trial_id=trial_id)
