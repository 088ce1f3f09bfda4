"""A GAN (generator + discriminator, two Adam optimizers) as a Task, the pattern of TensorFlow's
DCGAN tutorial: one forward pass, two tapes, both updates from the pre-step weights.

    python run.py --task=examples/gan.py:GanTask --dataset=fashion_mnist --global_batch=128 \
        --epochs=5 --strategy=mirrored --cpu_replicas=2

Shows: a second model and optimizer built in `build_extras` (checkpointed, restored on resume, a
resume without them refused), `apply_gradients(..., optimizer=...)` (one all-reduce, finite check,
clipping and a grad_norm/d_optimizer summary for both), `when=` for k discriminator updates per
generator update without a collective inside a tf.cond, per-example latent vectors that do not
depend on the replica count (`self.example_normal`), and a Task that is no classifier.

The main model (and the export) is the generator: latent vector -> image in [0, 1] of the data's
shape (height and width divisible by 4); its optimizer is the engine's, with DCGAN's Adam defaults.
Evaluation reports the discriminator's mean probability "real" on the test images (d_real) and on
generated images (d_fake; drawn with self.random_seed, so the same fakes for every eval batch of
one evaluation); after_eval writes 16 samples to TensorBoard (`samples`, eval run). The command
above: about 3 minutes on 2 CPU cores, rough garments with checkerboard artefacts.
"""

import keras
import tensorflow as tf

from engine.errors import UserError
from engine.losses import replica_loss
from engine.observe.figures import new_figure
from engine.optimizers import build_optimizer
from engine.task import Task

LATENT = 32


def _bce(targets, logits):
    return tf.nn.sigmoid_cross_entropy_with_logits(targets, tf.cast(tf.squeeze(logits, -1), tf.float32))


class GanTask(Task):
    is_classifier = False
    train_metrics = ("d_loss", "g_loss")
    eval_metrics = ("d_real", "d_fake")  # mean discriminator probability "real" on test images / on fakes
    d_steps_per_g_step = 1  # k: the generator steps at every k-th step only

    def build_model(self):  # the generator: latent vector -> image in [0, 1], the data's shape
        h, w, channels = self._image_shape()
        return keras.Sequential(
            [
                keras.Input((LATENT,)),
                keras.layers.Dense(h // 4 * w // 4 * 64),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Reshape((h // 4, w // 4, 64)),
                keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same"),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Conv2DTranspose(
                    channels, 4, strides=2, padding="same", activation="sigmoid", dtype="float32"
                ),  # pixels in [0, 1], like the data's
            ],
            name="generator",
        )

    def build_optimizer(self):
        """The generator's optimizer: the engine's (--optimizer, --lr_schedule, --weight_decay), with
        DCGAN's Adam settings unless flags say otherwise: rate 2e-4 (--learning_rate), beta_1 0.5."""
        config = self.config if self.config.learning_rate is not None else self.config.replace(learning_rate=2e-4)
        optimizer = build_optimizer(config, self.total_steps)
        if isinstance(optimizer, keras.optimizers.Adam):
            optimizer.beta_1 = 0.5
        return optimizer

    def build_extras(self):
        self.discriminator = keras.Sequential(
            [
                keras.Input(self.input_shape),
                keras.layers.Conv2D(32, 4, strides=2, padding="same"),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Conv2D(64, 4, strides=2, padding="same"),
                keras.layers.LeakyReLU(0.2),
                keras.layers.Flatten(),
                keras.layers.Dense(1, dtype="float32"),  # a logit: "real"
            ],
            name="discriminator",
        )
        self.d_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.d_optimizer.build(self.discriminator.trainable_variables)

    def _image_shape(self):
        shape = tuple(self.input_shape)
        if len(shape) != 3 or shape[0] % 4 or shape[1] % 4:
            raise UserError(f"GanTask makes images of height and width divisible by 4; the data's examples are {shape}")
        return shape

    def train_step(self, batch):
        images, _ = batch
        n = tf.shape(images)[0]
        z = self.example_normal(n, (LATENT,))  # the same latent vectors whatever the replica count
        with tf.GradientTape() as g_tape, tf.GradientTape() as d_tape:
            fakes = self.model(z, training=True)
            real_logits = self.discriminator(images, training=True)
            fake_logits = self.discriminator(fakes, training=True)
            d_per_example = _bce(tf.ones([n]), real_logits) + _bce(tf.zeros([n]), fake_logits)
            g_per_example = _bce(tf.ones([n]), fake_logits)
            d_loss = self.scale_loss(replica_loss(d_per_example, self.global_batch))
            g_loss = self.scale_loss(replica_loss(g_per_example, self.global_batch))
        k = self.d_steps_per_g_step
        self.apply_gradients(
            g_tape.gradient(g_loss, self.model.trainable_variables),
            when=None if k == 1 else tf.equal(self.global_step % k, 0),
        )
        self.apply_gradients(
            d_tape.gradient(d_loss, self.discriminator.trainable_variables),
            self.discriminator.trainable_variables,
            optimizer=self.d_optimizer,
        )
        count = tf.cast(n, tf.float32)
        return {"d_loss": (tf.reduce_sum(d_per_example), count), "g_loss": (tf.reduce_sum(g_per_example), count)}

    def eval_step(self, batch):
        images, _ = batch
        n = tf.shape(images)[0]
        z = tf.random.stateless_normal([n, LATENT], self.random_seed(salt=1))
        real = tf.sigmoid(tf.squeeze(self.discriminator(images, training=False), -1))
        fake = tf.sigmoid(tf.squeeze(self.discriminator(self.model(z, training=False), training=False), -1))
        count = tf.cast(n, tf.float32)
        return {"d_real": (tf.reduce_sum(real), count), "d_fake": (tf.reduce_sum(fake), count)}

    def after_eval(self, step, writer):
        """16 samples from the same latent vectors at every evaluation, drawn as a matplotlib figure
        (a 4 x 4 grid, each sample titled with the discriminator's belief that it is real): the image
        `samples` in TensorBoard's Images tab (eval run). On the host, chief only."""
        samples = self.model(tf.random.stateless_normal([16, LATENT], seed=[0, 0]), training=False)
        belief = tf.sigmoid(tf.cast(tf.squeeze(self.discriminator(samples, training=False), -1), tf.float32)).numpy()
        figure = new_figure(width=6, height=6.4)
        figure.suptitle(f"generator samples at step {step}")
        for ax, image, real in zip(figure.subplots(4, 4).flat, tf.cast(samples, tf.float32).numpy(), belief):
            ax.imshow(image.squeeze(-1) if image.shape[-1] == 1 else image, cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_title(f"D(x) = {real:.2f}", fontsize=8)
            ax.set_axis_off()
        writer.write_figure(
            step,
            "samples",
            figure,
            description="16 samples from fixed latent vectors; D(x): the discriminator's P(real).",
        )


class TwoDiscriminatorStepsGanTask(GanTask):
    """k = 2: two discriminator updates per generator update."""

    d_steps_per_g_step = 2
