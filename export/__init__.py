"""Export a trained translator as a SavedModel that TF Serving serves, and use it.

- `export.translator`: loading a trained model directory, and the `Translator`
  (tokenizer + model + decoding: the functions that are exported and evaluated).
- The TensorFlow serving engine the `Translator` decodes with (the library's searches, made fast for a
  CPU serving graph): `export.engine_weights` (`engine_model`, the weights mapped into the precision and
  layout the engine decodes in), `export.search` (`engine_greedy_decode`, `engine_beam_search`, parallel loops),
  `export.step` (one decoder step over the key/value caches), `export.tf_internals`.
- `export.export_model`: `kt-export`, writes `EXPORT_DIR/NAME/VERSION/`.
- `export.translate`: `kt-translate`, translates text files through a SavedModel.
- `export.client`: REST and gRPC clients for TF Serving.
- `export.graph_ops`: lists the ops of a SavedModel and checks that TF Serving has them.

See export/README.md.
"""
