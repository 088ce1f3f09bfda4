"""A custom training loop engine for Keras models under tf.distribute.

Layers, from the inside out (see BUILD.md):
  task.py      the researcher's step functions (replica context)
  loop.py      compiled inner loops: many `strategy.run` steps per tf.function call
  trainer.py   the outer Python loop: epochs, evaluation, checkpoints, summaries
"""

__version__ = "0.1.0"
