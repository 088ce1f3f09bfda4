"""What a person sees: TensorBoard and the console.

summaries.py  the writers (chief only; no-ops elsewhere)
monitor.py    TensorBoard extras decided between loops (pictures, PR curves, HParams, layout, profiles)
figures.py    matplotlib figure -> image summary (the engine's and a Task's one plotting path)
pictures.py   the classifier pictures: confusion matrix, per-class accuracy, captioned image grids
pr_curves.py  per-class precision-recall curves for the PR Curves dashboard
layout.py     the Custom Scalars layout (train and eval of each quantity on one chart)
hparams.py    the HParams session
progress.py   the console progress line
report.py     the start-up banner and the end-of-run summary
startup_noise.py  TensorFlow's C++ start-up lines: each once, INFO only with --verbosity
"""
