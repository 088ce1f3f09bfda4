"""Models: `registry.py` resolves `--model` (registered names, `module:function`,
`path/file.py:function`, `keras.applications.NAME`); `classifiers.py` (cnn, cnn_bn, mlp) and
`resnet.py` (resnet20) hold the built-in networks."""
