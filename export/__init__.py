"""Export a trained translator as a SavedModel that TF Serving serves, and use it.

- `export.translator`: the `Translator` module (tokenizer + model + decoding signatures).
- `export.export_model`: `kt-export`, writes `EXPORT_DIR/NAME/VERSION/`.
- `export.translate`: `kt-translate`, translates text files through a SavedModel.
- `export.client`: REST and gRPC clients for TF Serving.
- `export.graph_ops`: lists the ops of a SavedModel and checks that TF Serving has them.
- `export.quick_model`: a small model trained in a minute, for tests and benchmarks.

See export/README.md.
"""
