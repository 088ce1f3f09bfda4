"""The second worked example of a changed step: `--task=language_model` with `--dataset=text:PATH`.

A small decoder-only Transformer over bytes (vocabulary 256, nanoGPT-like: token + position
embeddings, BLOCKS blocks of pre-norm causal self-attention + MLP, float32 logits) trained on
next-byte prediction. What it changes, each the way that stays correct on any number of replicas:

  * the loss is per TOKEN, and some tokens are padding (label PAD_LABEL = -1 in the final partial
    window of engine/data/text.py). The loss of a step is

        sum over every real token of the GLOBAL batch of its cross-entropy
        / the number of real tokens in the GLOBAL batch.

    Each replica sees only its own tokens, so it learns the global count with ONE extra scalar
    all-reduce (`global_token_count`) and divides its own sum by it; the engine's all-reduce of the
    gradients then adds up exactly the gradient of the global per-token mean. Two tempting
    shortcuts are wrong: dividing by the replica's OWN count (and by the replica count) weights
    every replica's mean equally, so a replica holding a mostly padded window counts as much as
    one full of text (tests/tasks_equivalence.py:LocalTokenMeanTask; tests/test_language_model.py shows it
    breaks "2 replicas == 1"); dividing by a constant (global batch x seq_len) ignores padding
    and shrinks the loss of every batch that holds padding.
    The count comes from `self.all_reduce`. The Task refuses --grad_accum_steps > 1 at start-up
    (each micro-batch would divide by its own global count, not the whole batch's) and --jit_compile
    (under a mirrored strategy XLA cannot hold the all-reduce).
  * metrics are (total, count) pairs over real tokens: "loss" (per token, nats) and "accuracy"
    (next byte right); "perplexity" = exp(loss) is not a ratio of sums, so it is derived on the host
    from the reduced loss (`derived_metrics`) and shown with the others (console, TensorBoard).
  * at each evaluation the chief writes a text sample (SAMPLE_BYTES bytes after PROMPT, drawn with
    a fixed seed at SAMPLE_TEMPERATURE) to TensorBoard's Text tab ("sample", eval run), through the
    `after_eval` hook: a plain model call outside strategy.run (no collective).

Run: python run.py --task=language_model --dataset=text:/usr/share/games/fortunes --seq_len=128
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from engine.errors import UserError
from engine.task import Task


@keras.saving.register_keras_serializable(package="ctl_engine")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (up to max_len) to (batch, length, d) embeddings."""

    def __init__(self, max_len: int, **kwargs):
        super().__init__(**kwargs)
        self.max_len = max_len

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=(self.max_len, input_shape[-1]),
            name="positions",
            initializer=keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, x):
        return x + keras.ops.cast(self.positions[: keras.ops.shape(x)[1]], x.dtype)

    def get_config(self):
        return {**super().get_config(), "max_len": self.max_len}


def byte_transformer(
    max_len: int, vocabulary: int = 256, d_model: int = 128, heads: int = 4, blocks: int = 2, mlp_ratio: int = 4
) -> keras.Model:
    """(batch, length <= max_len) int32 token ids -> (batch, length, vocabulary) float32 logits."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocabulary, d_model, name="token_embedding")(tokens)
    x = PositionEmbedding(max_len, name="position_embedding")(x)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"block{i}_norm1")(x)
        h = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"block{i}_attention")(
            h, h, use_causal_mask=True
        )
        x = x + h
        h = keras.layers.LayerNormalization(name=f"block{i}_norm2")(x)
        h = keras.layers.Dense(mlp_ratio * d_model, activation="gelu", name=f"block{i}_mlp_in")(h)
        x = x + keras.layers.Dense(d_model, name=f"block{i}_mlp_out")(h)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    logits = keras.layers.Dense(vocabulary, dtype="float32", name="logits")(x)
    return keras.Model(tokens, logits, name="byte_transformer")


def token_metrics(labels, logits, per_token) -> dict:
    """{"loss": (sum of real tokens' losses, real tokens), "accuracy": (right next bytes, real tokens)}."""
    real = tf.cast(labels >= 0, tf.float32)
    predictions = tf.argmax(logits, axis=-1, output_type=labels.dtype)
    correct = tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32) * real)
    count = tf.reduce_sum(real)
    return {"loss": (tf.reduce_sum(per_token), count), "accuracy": (correct, count)}


class LanguageModelTask(Task):
    D_MODEL = 128  # width of the residual stream
    HEADS = 4  # attention heads per block
    BLOCKS = 2  # Transformer blocks
    PROMPT = "The "  # start of the text sample written at each evaluation
    SAMPLE_BYTES = 300  # bytes generated per sample
    SAMPLE_TEMPERATURE = 0.8  # softmax temperature of the sample (0: greedy)
    SAMPLE_SEED = 1234  # the sample's draws repeat at every evaluation: only the weights change it

    train_metrics = ("loss", "accuracy")  # per real token
    eval_metrics = ("loss", "accuracy")

    def __init__(self, config, spec=None, **kwargs):
        super().__init__(config, spec, **kwargs)
        self._next_logits = None
        for flag, value, allowed, why in (
            ("jit_compile", config.jit_compile, False, "which a mirrored strategy cannot run inside XLA"),
            ("grad_accum_steps", config.grad_accum_steps, 1, "which each micro-batch would count for itself only"),
        ):
            if value != allowed:
                raise UserError(
                    f"--task={config.task} all-reduces the global batch's real-token count inside the step, "
                    f"{why}: drop --{flag}={value}"
                )

    def build_model(self) -> keras.Model:
        features, labels = self.spec.features, self.spec.labels
        if (
            features.shape.rank != 1
            or not features.dtype.is_integer
            or labels.shape != features.shape
            or not self.num_classes
        ):
            raise UserError(
                f"--task={self.config.task} needs token sequences, e.g. --dataset=text:PATH; "
                f"the data has {self.spec.describe()}"
            )
        return byte_transformer(features.shape[0], self.num_classes, self.D_MODEL, self.HEADS, self.BLOCKS)

    # ---- replica context ----
    def per_example_loss(self, labels, outputs):
        """Per-token cross-entropy, (batch, seq_len); 0 at padded positions (label < 0)."""
        real = labels >= 0
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.where(real, labels, 0), tf.cast(outputs, tf.float32))
        return tf.where(real, losses, 0.0)

    def global_token_count(self, labels):
        """Real tokens in the GLOBAL batch: this replica's count, summed over every replica and
        worker (one scalar all-reduce; every replica calls it, unconditionally)."""
        local = tf.reduce_sum(tf.cast(labels >= 0, tf.float32))
        return self.all_reduce(local)

    def normaliser(self, labels):
        """What this replica divides its summed token losses by."""
        return tf.maximum(self.global_token_count(labels), 1.0)

    def train_step(self, batch):
        tokens, labels = batch
        normaliser = self.normaliser(labels)  # outside the tape: no gradient flows through a count
        with tf.GradientTape() as tape:
            logits = self.model(tokens, training=True)
            per_token = self.per_example_loss(labels, logits)
            loss = tf.reduce_sum(per_token) / normaliser
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            scaled_loss = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled_loss, self.model.trainable_variables))
        return token_metrics(labels, logits, per_token)

    def eval_step(self, batch):
        tokens, labels = batch
        logits = self.model(tokens, training=False)
        return token_metrics(labels, logits, self.per_example_loss(labels, logits))

    # ---- on the host ----
    def derived_metrics(self, metrics: dict) -> dict:
        return {"perplexity": float(np.exp(metrics["loss"]))} if "loss" in metrics else {}

    def sample(self, num_bytes: int | None = None) -> str:
        """PROMPT and `num_bytes` generated bytes, from this host's copy of the weights (a plain
        model call outside strategy.run: no collective). The same seed at every call."""
        if self._next_logits is None:
            model = self.model

            @tf.function(input_signature=[tf.TensorSpec([1, None], tf.int32)])
            def next_logits(context):
                return model(context, training=False)[0, -1]

            self._next_logits = next_logits
        max_len = self.spec.features.shape[0]
        rng = np.random.default_rng(self.SAMPLE_SEED)
        tokens = list(self.PROMPT.encode("utf-8"))
        for _ in range(self.SAMPLE_BYTES if num_bytes is None else num_bytes):
            logits = self._next_logits(tf.constant([tokens[-max_len:]], tf.int32)).numpy().astype(np.float64)
            if self.SAMPLE_TEMPERATURE <= 0:
                tokens.append(int(logits.argmax()))
                continue
            p = np.exp((logits - logits.max()) / self.SAMPLE_TEMPERATURE)
            tokens.append(int(rng.choice(len(p), p=p / p.sum())))
        return bytes(tokens).decode("utf-8", errors="replace")

    def after_eval(self, step: int, writer) -> None:
        text = self.sample()
        fence = "~~~~" if "```" in text else "```"
        writer.write_text(
            step,
            "sample",
            f"{fence}\n{text}\n{fence}\n\n(temperature {self.SAMPLE_TEMPERATURE}, "
            f"seed {self.SAMPLE_SEED}, step {step})",
        )
