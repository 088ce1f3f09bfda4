"""MoCo (He et al., 2020) as a Task: a momentum key encoder and a queue of past keys as negatives,
both moved once per optimizer update by `Task.after_update`.

    python run.py --task=examples/moco.py:MocoTask --model=cnn --dataset=fashion_mnist \
        --strategy=mirrored --cpu_replicas=2 --optimizer=sgd

Shows: state that moves once per update, not once per micro-batch: with --grad_accum_steps=K
train_step runs K times per update, each time on one micro-batch, and keeps that micro-batch's
keys (every replica's, `self.all_gather`) in the `pending` variable at the rows `self.micro_batch`
says; `after_update` then pushes the update's keys into the queue and moves the key encoder
towards the trained one, once. Each query's loss needs only its own key and the queue, so N
replicas and any K train exactly like one device fed the same global batch. The queue starts as
random unit vectors (seeded like the initial weights); the key encoder starts as a copy of the model.
Both are Task attributes, so checkpoints hold them and a resume continues exactly.
"""

import keras
import tensorflow as tf

from engine.errors import UserError
from engine.models.registry import build_model
from engine.task import Task


class MocoTask(Task):
    EMBEDDING = 32  # width of the projection the loss compares
    QUEUE = 256  # negatives kept from past updates (at least one global batch)
    momentum = 0.99  # key encoder = momentum * key encoder + (1 - momentum) * model, per update
    temperature = 0.2
    noise = 0.1  # standard deviation of each view's Gaussian pixel noise

    train_metrics = ("loss", "accuracy")  # accuracy: the positive key scores above every queued one
    eval_metrics = ("loss", "accuracy")
    is_classifier = False

    def build_model(self):
        if self.spec.features.shape.rank != 3:
            raise UserError(f"{type(self).__name__} augments images (H, W, C); the data has {self.spec.describe()}")
        if self.QUEUE < self.global_batch:
            raise UserError(
                f"{type(self).__name__}.QUEUE={self.QUEUE} must hold one --global_batch={self.global_batch}"
            )
        return build_model(self.config.model, self.input_shape, self.EMBEDDING, spec=self.spec)

    def build_extras(self):
        self.key_encoder = build_model(self.config.model, self.input_shape, self.EMBEDDING, spec=self.spec)
        self.key_encoder.trainable = False
        for key, query in zip(self.key_encoder.weights, self.model.weights):
            key.assign(query)
        queue = keras.random.normal([self.QUEUE, self.EMBEDDING])  # seeded like the model's initial weights
        self.queue = tf.Variable(tf.math.l2_normalize(queue, axis=1), trainable=False)
        # The keys of the update under way, all replicas', filled micro-batch by micro-batch.
        self.pending = tf.Variable(tf.zeros([self.global_batch, self.EMBEDDING]), trainable=False)

    def view(self, images, salt):
        """One random view per image: mirrored with probability 1/2, plus Gaussian noise."""
        n = tf.shape(images)[0]
        flip = self.example_normal(n, (), salt) > 0
        images = tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]), images)
        return images + self.noise * self.example_normal(n, self.input_shape, salt + 1)

    @staticmethod
    def embed(model, images, training):
        return tf.math.l2_normalize(tf.cast(model(images, training=training), tf.float32), axis=1)

    def contrastive(self, queries, keys):
        """Per-query InfoNCE loss against its own key (the positive) and the queue's keys."""
        positive = tf.reduce_sum(queries * keys, axis=1, keepdims=True)
        negatives = tf.matmul(queries, self.queue, transpose_b=True)
        logits = tf.concat([positive, negatives], axis=1) / self.temperature
        labels = tf.zeros(tf.shape(queries)[:1], tf.int32)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
        right = tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), 0), tf.float32)
        return losses, right

    def train_step(self, batch):
        images, _ = batch
        n = tf.shape(images)[0]
        keys = self.embed(self.key_encoder, self.view(images, 2), False)
        with tf.GradientTape() as tape:
            queries = self.embed(self.model, self.view(images, 0), True)
            per_example, right = self.contrastive(queries, keys)
            loss = tf.reduce_sum(per_example) / self.global_batch
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
        self.apply_gradients(tape.gradient(self.scale_loss(loss), self.model.trainable_variables))
        # This micro-batch's keys, every replica's, kept at their examples' rows of the global batch
        # (replica r holds rows r*n*K .. (r+1)*n*K - 1, micro-batch i the i-th n of them).
        gathered = self.all_gather(keys)
        row = tf.range(tf.shape(gathered)[0])
        place = (row // n) * n * self.config.grad_accum_steps + self.micro_batch * n + row % n
        self.pending.assign(tf.tensor_scatter_nd_update(self.pending, place[:, None], gathered))
        count = tf.cast(n, tf.float32)
        return {"loss": (tf.reduce_sum(per_example), count), "accuracy": (tf.reduce_sum(right), count)}

    def after_update(self):
        # Newest keys first, the oldest global batch's dropped; then the momentum step.
        self.queue.assign(tf.concat([self.pending, self.queue[: self.QUEUE - self.global_batch]], axis=0))
        for key, query in zip(self.key_encoder.weights, self.model.weights):
            key.assign(self.momentum * key + (1.0 - self.momentum) * tf.cast(query, key.dtype))

    def eval_step(self, batch):
        images, _ = batch
        queries = self.embed(self.model, images, False)
        keys = self.embed(self.key_encoder, tf.reverse(images, axis=[2]), False)  # a fixed second view
        per_example, right = self.contrastive(queries, keys)
        count = tf.cast(tf.shape(images)[0], tf.float32)
        return {"loss": (tf.reduce_sum(per_example), count), "accuracy": (tf.reduce_sum(right), count)}
