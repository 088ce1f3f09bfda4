"""SimCLR (Chen et al., 2020) as a Task: two augmented views of each image, made inside train_step
from one batch, and the NT-Xent loss of each view against every other view of the GLOBAL batch.

    python run.py --task=examples/simclr.py:SimclrTask --model=cnn --dataset=fashion_mnist \
        --strategy=mirrored --cpu_replicas=2 --optimizer=sgd

Shows: global negatives through `self.all_gather` (each replica sends its embeddings once; the
gradient reaching them is summed over every replica that used them as negatives), so N replicas
train like one device fed the same global batch; per-example augmentation noise from
`self.example_normal` (the same whatever the replica count); a Task that is no classifier (the
`--model` network's outputs are the projection, EMBEDDING wide).

With --grad_accum_steps=K each micro-batch gathers its own rows: an anchor's negatives are the
global batch / K examples of its micro-batch across replicas, not the whole global batch, so the
loss (and the update) differs from the same run without accumulation. eval_step gathers too: the
eval loss is over each eval batch's global negatives, with fixed views (the image and its mirror).
"""

import tensorflow as tf

from engine.errors import UserError
from engine.models.registry import build_model
from engine.task import Task

LARGE = 1e9  # subtracted from an anchor's similarity to itself: never its own negative


def nt_xent(anchors, keys, own, positives, temperature):
    """Per-anchor NT-Xent loss and whether its positive is its most similar key.

    anchors [a, d] and keys [k, d] are unit vectors; own[i] is anchor i's own row in keys (masked
    out), positives[i] the row of its other view."""
    similarity = tf.matmul(anchors, keys, transpose_b=True) / temperature
    similarity -= LARGE * tf.one_hot(own, tf.shape(keys)[0])
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(positives, similarity)
    right = tf.equal(tf.argmax(similarity, axis=1, output_type=positives.dtype), positives)
    return losses, tf.cast(right, tf.float32)


class SimclrTask(Task):
    EMBEDDING = 32  # width of the projection the loss compares
    temperature = 0.5
    noise = 0.1  # standard deviation of each view's Gaussian pixel noise

    train_metrics = ("loss", "accuracy")  # accuracy: the positive is the most similar of all keys
    eval_metrics = ("loss", "accuracy")
    is_classifier = False

    def build_model(self):
        if self.spec.features.shape.rank != 3:
            raise UserError(f"{type(self).__name__} augments images (H, W, C); the data has {self.spec.describe()}")
        return build_model(self.config.model, self.input_shape, self.EMBEDDING, spec=self.spec)

    def view(self, images, salt):
        """One random view per image: mirrored with probability 1/2, plus Gaussian noise."""
        n = tf.shape(images)[0]
        flip = self.example_normal(n, (), salt) > 0
        images = tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]), images)
        return images + self.noise * self.example_normal(n, self.input_shape, salt + 1)

    def embed(self, images, training):
        return tf.math.l2_normalize(tf.cast(self.model(images, training=training), tf.float32), axis=1)

    def contrastive(self, z1, z2, offset):
        """Per-example loss and accuracy of this replica's n examples (both views as anchors)
        against every view of the gathered batch; `offset`: this replica's first row in it."""
        n = tf.shape(z1)[0]
        keys = tf.concat(self.all_gather([z1, z2]), axis=0)  # [2m, d]: views 1 then views 2
        m = tf.shape(keys)[0] // 2
        rows = offset + tf.range(n)
        own, positives = tf.concat([rows, m + rows], 0), tf.concat([m + rows, rows], 0)
        losses, right = nt_xent(tf.concat([z1, z2], 0), keys, own, positives, self.temperature)
        return (losses[:n] + losses[n:]) / 2, (right[:n] + right[n:]) / 2

    def train_step(self, batch):
        images, _ = batch
        n = tf.shape(images)[0]
        offset = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32) * n
        with tf.GradientTape() as tape:
            z1, z2 = self.embed(self.view(images, 0), True), self.embed(self.view(images, 2), True)
            per_example, right = self.contrastive(z1, z2, offset)
            loss = tf.reduce_sum(per_example) / self.global_batch
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
        self.apply_gradients(tape.gradient(self.scale_loss(loss), self.model.trainable_variables))
        count = tf.cast(n, tf.float32)
        return {"loss": (tf.reduce_sum(per_example), count), "accuracy": (tf.reduce_sum(right), count)}

    def eval_step(self, batch):
        images, _ = batch
        n = tf.shape(images)[0]
        # Eval batches may be uneven (the partial last one): this replica's offset from every size.
        sizes = self.all_gather(tf.reshape(n, [1]))
        offset = tf.reduce_sum(sizes[: tf.distribute.get_replica_context().replica_id_in_sync_group])
        z1, z2 = self.embed(images, False), self.embed(tf.reverse(images, axis=[2]), False)
        per_example, right = self.contrastive(z1, z2, offset)
        count = tf.cast(n, tf.float32)
        return {"loss": (tf.reduce_sum(per_example), count), "accuracy": (tf.reduce_sum(right), count)}
