"""Data: where examples come from and how they reach the replicas.

Imports run one way (no cycles; tests/test_import_graph.py checks): formats, spec, readers,
bad_records are leaves; arrays, streams, task_data build on them (resident on arrays, into_memory on both); the
source modules build on those; sources.py dispatches `--dataset` to them; pipelines.py
distributes what a source gives. Nothing here imports the Task: the controller hands the Task's
augmentation to the pipeline.

  formats.py        normalisation, "A,B,C" shapes, the tf.data options of every pipeline
  spec.py           DataSpec: one example's feature and label specs, class count and names
  readers.py        file formats (IDX, Keras' mnist.npz), pure NumPy
  arrays.py         ArraySource: a data set in memory, its seeded index-batch pipelines
  resident.py       --input_mode=resident: in-memory arrays on the devices, gathered in the loop
  bad_records.py    naming a bad record after a pipeline failed: file, offset, cause
  streams.py        StreamSource: files streamed per worker (sharding, shuffle buffer, exact skip)
  builtin.py        --dataset=mnist | fashion_mnist | synthetic, and npz:PATH
  tfrecord.py       --dataset=tfrecord:TRAIN_GLOB[,TEST_GLOB] (and the npz -> shards writer)
  image_folders.py  --dataset=images:DIR, JPEG/PNG class folders
  tfds_source.py    --dataset=tfds:NAME[:CONFIG], a prepared TensorFlow Datasets builder
  text.py           --dataset=text:PATH, byte tokens and their next bytes
  task_data.py      a Task's own pipelines (Task.datasets)
  into_memory.py    --input_mode=resident for a streamed source: read and decoded whole into an ArraySource
  sources.py        --dataset -> the loader of its kind (a dispatch table), validated
  pipelines.py      tf.data at the GLOBAL batch split across replicas and workers
"""
