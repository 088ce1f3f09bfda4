"""What a person sees: TensorBoard and the console.

  summaries.py  the writers (chief only; no-ops elsewhere)
  monitor.py    TensorBoard extras decided between loops (images, HParams, histograms, profiles)
  images.py     NumPy rendering of image grids and the confusion matrix
  hparams.py    the HParams session
  progress.py   the console progress line
  report.py     the start-up banner and the end-of-run summary
  startup_noise.py  TensorFlow's C++ start-up lines: each once, INFO only with --verbosity
"""
