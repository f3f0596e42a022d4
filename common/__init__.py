"""What training and serving share, below both: a run directory's format (`run_dir`: its file names,
config.json, the checkpoints, the model it holds), the in-graph tokenizer (`tokenizer`: tensorflow-text ops
that `tf.data` and the exported graph run alike), and the commands' quiet start-up (`native_logs`).

`training/` and `export/` import it; it imports only the library (`keras_transformer`) and TensorFlow, so the
modules kt-train runs never load the serving engine (tests/test_layout.py checks both).
"""
