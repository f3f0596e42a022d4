"""Training pipeline for keras-transformer: data, tokenizer, tf.data batches,
`model.fit` under tf.distribute, evaluation with sacreBLEU and checkpoint
averaging. See training/README.md."""
