"""Training pipeline for keras-transformer: data, tokenizer, tf.data batches,
`model.fit` under tf.distribute, evaluation with sacreBLEU and checkpoint
averaging. See training/README.md."""

import os as _os

# TensorFlow (since 2.9) turns its oneDNN kernels on by default only on CPUs with AVX512_VNNI, AVX512_BF16
# or AMX. On an AVX2-only CPU it then trains on its Eigen kernels, much slower (BENCHMARKS.md, issue 27).
# TensorFlow reads this variable once, when it loads: it is set here, before any training module imports
# TensorFlow, so that every kt-* command has it. A value the user set wins (0 turns oneDNN off).
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
_os.environ.setdefault(ONEDNN_ENV, "1")
