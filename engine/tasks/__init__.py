"""Ready Tasks and `--task` resolution. The base Task (image classification) is engine/task.py.

registry.py         `--task` names, `package.module:Class` and `path/to/file.py:Class`
label_smoothing.py  the worked example of a changed step
language_model.py   the second worked example: a byte-level causal Transformer
"""
