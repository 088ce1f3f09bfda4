"""The textbook Keras program for the README's Fashion-MNIST job: what a user would write instead
of `python run.py --strategy=mirrored --cpu_replicas=2 --global_batch=256 --dataset=fashion_mnist`.

    python -m benchmarks.fit_program                 # 3 epochs, prints the test accuracy
    python -m benchmarks.fit_program --epochs=1 --seed=1

MirroredStrategy over two logical CPU devices, the engine's `cnn` (conv 32 3x3, max-pool, dense 128,
dense 10) built and compiled in the scope with Adam(1e-3) and SparseCategoricalCrossentropy(from_logits),
Fashion-MNIST from the Debian IDX files, tf.data shuffle -> batch 256 -> prefetch, `model.fit`, then
`model.evaluate` on the 10,000 test images. benchmarks/whole_process.py times it, as a whole process,
against run.py. Where it differs from run.py's job (by design: it is the usual tutorial program):
  * the shuffle is a 10,000-example buffer (the tutorials' BUFFER_SIZE), not a permutation of all
    60,000 per epoch, and the last partial batch is kept (235 steps an epoch, run.py: 234);
  * it evaluates once, at the end (run.py: after each of the 3 epochs), writes no checkpoints,
    TensorBoard logs or exported model;
  * Keras' defaults elsewhere: MirroredStrategy's own cross-device reduction, steps_per_execution=1,
    tf.data autotuning on (`--no_autotune` switches it off, as the engine does: see
    engine/data/pipelines.py on the iterator deletions it can stall for seconds).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the engine's helpers

import tensorflow as tf  # noqa: E402

from engine.data.readers import read_idx_split  # noqa: E402
from engine.data.builtin import DEBIAN_FASHION_MNIST_DIR  # noqa: E402
from engine.distribute.strategy import configure_cpu_replicas  # noqa: E402
from engine.models.classifiers import seed_cnn  # noqa: E402

import keras  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU devices to mirror over")
    parser.add_argument("--shuffle_buffer", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data_dir", default=DEBIAN_FASHION_MNIST_DIR)
    parser.add_argument(
        "--no_autotune",
        action="store_true",
        help="not textbook: switch tf.data autotuning off, as the engine does (also on the "
        "per-device datasets MirroredStrategy builds), to show what the exit delays cost",
    )
    args = parser.parse_args()

    configure_cpu_replicas(args.replicas)  # tf.config.set_logical_device_configuration, before TF starts
    keras.utils.set_random_seed(args.seed)

    (x_train, y_train), (x_test, y_test) = (read_idx_split(args.data_dir, split) for split in ("train", "test"))
    x_train = x_train[..., None].astype("float32") / 255.0
    x_test = x_test[..., None].astype("float32") / 255.0
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train.astype("int32")))
        .shuffle(args.shuffle_buffer, seed=args.seed)
        .batch(args.global_batch)
        .prefetch(tf.data.AUTOTUNE)
    )
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test.astype("int32"))).batch(args.global_batch)
    if args.no_autotune:
        from engine import compat

        options = tf.data.Options()
        options.autotune.enabled = False
        train, test = train.with_options(options), test.with_options(options)
        compat.device_datasets_without_autotune()

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    print(f"replicas: {strategy.num_replicas_in_sync}", flush=True)
    with strategy.scope():
        model = seed_cnn((28, 28, 1), 10)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    model.fit(train, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"test loss {loss:.4f}  accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
