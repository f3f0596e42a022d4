"""Training pipeline for keras-transformer: data, tokenizer, tf.data batches,
`model.fit` under tf.distribute, evaluation with sacreBLEU and checkpoint
averaging. See training/README.md."""

# TensorFlow's switch for its oneDNN kernels, which kt-train turns on (training/train.py says why).
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
