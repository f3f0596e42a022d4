"""Export a trained translator as a SavedModel that TF Serving serves, and use it.

- `export.translator`: loading a trained model directory, and the `Translator`
  (tokenizer + model + decoding: the functions that are exported and evaluated).
- `export.export_model`: `kt-export`, writes `EXPORT_DIR/NAME/VERSION/`.
- `export.translate`: `kt-translate`, translates text files through a SavedModel.
- `export.client`: REST and gRPC clients for TF Serving.
- `export.graph_ops`: lists the ops of a SavedModel and checks that TF Serving has them.

See export/README.md.
"""
