from setuptools import find_packages, setup

setup(
    name="keras-transformer",
    version="0.1.0",
    description=(
        'The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) '
        "as Keras 3 layers, with a training pipeline and a TF Serving export."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["keras_transformer*", "training*", "export*"]),
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "tensorflow-text>=2.21,<2.22",
        "keras>=3.12",
        "tensorflow-datasets>=4.9",
        "sentencepiece>=0.2",
        "sacrebleu>=2.4",
    ],
    extras_require={
        # The gRPC client (export/client.py) and its test; REST needs nothing extra.
        "serving": ["tensorflow-serving-api>=2.21,<2.22"],
        # Figures of a run (python -m training.plots); tests/test_plots.py needs it too.
        "plots": ["matplotlib>=3.6"],
        "test": ["pytest>=8", "tensorflow-serving-api>=2.21,<2.22", "matplotlib>=3.6"],
    },
    entry_points={
        "console_scripts": [
            "kt-train=training.train:main",
            "kt-evaluate=training.evaluate:main",
            "kt-average-checkpoints=training.average_checkpoints:main",
            "kt-export=export.export_model:main",
            "kt-translate=export.translate:main",
        ]
    },
)
