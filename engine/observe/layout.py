"""The Custom Scalars layout written once per run: each quantity on one chart, train and eval (and
eval_ema) lines together, so the tab tells the run's story without clicking through runs."""

from __future__ import annotations

from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata

TAG = custom_scalar_metadata.CONFIG_SUMMARY_TAG


def _chart(title: str, *tags: str):
    """One chart of every run's scalars named exactly `tags`."""
    return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[f"^{tag}$" for tag in tags]))


def run_layout(metrics, loss_scale: bool = False) -> layout_pb2.Layout:
    """Train and eval of each metric (the Task's train and eval metric names) on one chart; the
    optimiser's learning rate and gradient norm (and with `loss_scale`, mixed precision's loss scale
    and skipped updates); throughput."""
    optimisation = [_chart("learning rate", "learning_rate"), _chart("gradient norm (before clipping)", "grad_norm")]
    if loss_scale:
        optimisation += [_chart("loss scale", "loss_scale"), _chart("skipped updates", "skipped_updates")]
    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title="train and eval", chart=[_chart(f"{name} (train and eval)", name) for name in metrics]
            ),
            layout_pb2.Category(title="optimisation", chart=optimisation),
            layout_pb2.Category(
                title="speed",
                chart=[
                    _chart("examples per second", "examples_per_sec"),
                    _chart("seconds per compiled loop", "loop_seconds"),
                ],
            ),
        ]
    )


def layout_summary(metrics, loss_scale: bool = False) -> tuple:
    """(tag, serialized layout, serialized SummaryMetadata) for SummaryWriter.write_tensor."""
    meta = custom_scalar_metadata.create_summary_metadata()
    return TAG, run_layout(metrics, loss_scale).SerializeToString(), meta.SerializeToString()
