"""The CIFAR ResNets of He et al. 2016 ("Deep Residual Learning for Image Recognition", section 4.2).

`resnet20` (`--model=resnet20`): for 32x32x3 images (other sizes work: the network ends in a global
average pool). 6n+2 layers with n = 3 basic blocks per stage:

    conv 3x3 16, no bias -> batch norm -> relu
    stage 1: 3 x basic block, 16 filters, 32x32
    stage 2: 3 x basic block, 32 filters, the first with stride 2 (16x16)
    stage 3: 3 x basic block, 64 filters, the first with stride 2 (8x8)
    global average pool -> dense num_classes (float32 logits)

A basic block: conv 3x3 (stride s) -> BN -> relu -> conv 3x3 -> BN, plus the shortcut, -> relu.
Where the shape changes (stride 2, more filters) the shortcut is a projection, conv 1x1 stride 2 ->
BN (the paper's option B; its CIFAR results used option A, zero-padding, which has no weights).

Parameters for 10 classes: 272,474 trainable (convolutions 270,256 without biases, BN scale and
offset 1,568, dense 650) plus 1,568 BN moving statistics: 274,042 in all. About 41 M multiply-adds
per 32x32 example forward, so roughly 0.25 GFLOP per trained example.

Batch norm as in `cnn_bn` (engine/models/classifiers.py, whose docstring says why): synchronised
across replicas, so N replicas train like one fed the global batch, and momentum 0.9. The paper's
weight decay (1e-4) is not built in: use `--weight_decay`. Convolutions use He-normal
initialisation, as in the paper. Every layer is named, so weight paths are stable.
"""

from __future__ import annotations

import keras


def resnet20(input_shape, num_classes, *, synchronized=True, momentum=0.9):
    """ResNet-20 (3 basic blocks per stage): 272,474 trainable parameters for 10 classes."""
    return cifar_resnet(input_shape, num_classes, blocks_per_stage=3, synchronized=synchronized, momentum=momentum)


def cifar_resnet(input_shape, num_classes, *, blocks_per_stage, synchronized=True, momentum=0.9):
    """The CIFAR ResNet with 6 * blocks_per_stage + 2 layers (3: ResNet-20, 5: ResNet-32, ...)."""

    def conv(x, filters, kernel, stride, name):
        return keras.layers.Conv2D(
            filters, kernel, strides=stride, padding="same", use_bias=False, kernel_initializer="he_normal", name=name
        )(x)

    def norm(x, name):
        return keras.layers.BatchNormalization(synchronized=synchronized, momentum=momentum, name=name)(x)

    def block(x, filters, stride, name):
        shortcut = x
        if stride != 1 or x.shape[-1] != filters:
            shortcut = norm(conv(x, filters, 1, stride, f"{name}_shortcut_conv"), f"{name}_shortcut_bn")
        y = conv(x, filters, 3, stride, f"{name}_conv1")
        y = keras.layers.ReLU(name=f"{name}_relu1")(norm(y, f"{name}_bn1"))
        y = norm(conv(y, filters, 3, 1, f"{name}_conv2"), f"{name}_bn2")
        y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
        return keras.layers.ReLU(name=f"{name}_relu2")(y)

    inputs = keras.Input(shape=input_shape, name="images")
    x = keras.layers.ReLU(name="stem_relu")(norm(conv(inputs, 16, 3, 1, "stem_conv"), "stem_bn"))
    for stage, filters in enumerate((16, 32, 64), start=1):
        for index in range(1, blocks_per_stage + 1):
            stride = 2 if stage > 1 and index == 1 else 1
            x = block(x, filters, stride, f"stage{stage}_block{index}")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=f"resnet{6 * blocks_per_stage + 2}")
