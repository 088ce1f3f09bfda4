"""Data: where examples come from and how they reach the replicas.

  sources.py        a `--dataset` name -> validated arrays (built-in names, local files, generated)
  image_folders.py  --dataset=images:DIR, JPEG/PNG class folders streamed as (path, label) units
  readers.py        file formats (IDX, Keras' mnist.npz), pure NumPy
  pipelines.py      tf.data at the GLOBAL batch: the endless seeded training stream, the whole eval
                    set, and their split across replicas and workers
"""
