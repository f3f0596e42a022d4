from setuptools import find_packages, setup

setup(
    name="keras-transformer",
    version="0.1.0",
    description=(
        'The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) '
        "as Keras 3 layers for JAX, PyTorch and TensorFlow, with a TF training pipeline and a TF Serving export."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["keras_transformer*", "common*", "training*", "export*"]),
    # The library (keras_transformer/) runs on any Keras 3 backend: JAX, PyTorch or TensorFlow. The backend is
    # the user's to install (the `jax` extra, a torch wheel, or the `tensorflow` extra); see the README.
    install_requires=[
        # keras_transformer/ and training/keras_internals.py use private Keras API written for 3.15: recheck them first.
        "keras>=3.15,<3.16",
        "numpy",
        "sentencepiece>=0.2",
    ],
    extras_require={
        # training/, export/ and the kt-* commands: the TF pipeline, the TF Serving export, the scores.
        "tensorflow": [
            "tensorflow>=2.21,<2.22",
            "tensorflow-text>=2.21,<2.22",
            # keras.callbacks.TensorBoard (kt-train's logs/) needs it; TensorFlow 2.21 no longer depends on it.
            "tensorboard>=2.21,<2.22",
            "tensorflow-datasets>=4.9",
            "sacrebleu>=2.4",
            # kt-evaluate's Multi30k-protocol BLEU: Moses punctuation normalisation and tokenisation in Python.
            "sacremoses>=0.1",
            # TF Serving's protos: kt-export writes warm-up requests (PredictionLog records); the gRPC client.
            # Its own dependencies (grpcio, protobuf, tensorflow) are TensorFlow's already.
            "tensorflow-serving-api>=2.21,<2.22",
            # kt-import reads a Hugging Face model's weights (model.safetensors) with numpy.
            "safetensors>=0.4",
        ],
        # The library on the JAX backend (KERAS_BACKEND=jax), CPU only: tested with 0.10, the release beside Keras
        # 3.15 (pinned above); recheck tests/portable on JAX before widening. (PyTorch: install its CPU wheel
        # yourself, as `make venv-torch` does: a plain `pip install torch` brings gigabytes of CUDA libraries.)
        "jax": ["jax[cpu]>=0.10,<0.11"],
        # export/client.py's gRPC client alone (its REST client needs nothing): TF Serving's protos, which bring
        # TensorFlow. (Also in `tensorflow`, for kt-export's warm-up requests.)
        "serving": ["tensorflow-serving-api>=2.21,<2.22"],
        # Figures of a run (python -m training.plots); tests/test_plots.py needs it too.
        "plots": ["matplotlib>=3.6"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.6"],
        # The reference Marian implementation that tests/test_marian.py checks training/marian.py against, in the
        # PyTorch test virtualenv (`make venv-torch`): transformers 5 has PyTorch models only.
        "marian-reference": ["transformers>=5.23,<6", "safetensors>=0.4", "sacremoses>=0.1"],
    },
    entry_points={
        "console_scripts": [
            "kt-train=training.train:main",
            "kt-prepare=training.prepare:main",
            "kt-evaluate=training.evaluate:main",
            "kt-average-checkpoints=training.average_checkpoints:main",
            "kt-export=export.export_model:main",
            "kt-translate=export.translate:main",
            "kt-treebank=training.trees:main",
            "kt-import=training.import_marian:main",
        ]
    },
)
