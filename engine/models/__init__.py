"""Models: `registry.py` maps `--model` names to builders; `classifiers.py` holds the built-in ones."""
