"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers."""

from keras_transformer.attention import MultiHeadAttention
from keras_transformer.decoding import beam_search, greedy_decode, greedy_generate, length_penalty, sample_decode
from keras_transformer.decoder import Decoder, DecoderLayer
from keras_transformer.embedding import PositionalEmbedding, positional_encoding
from keras_transformer.encoder import Encoder, EncoderLayer
from keras_transformer.feed_forward import FeedForward
from keras_transformer.losses import MaskedAccuracy, MaskedRDropCrossentropy, MaskedSparseCategoricalCrossentropy
from keras_transformer.masking import PAD_ID, causal_mask, padding_mask
from keras_transformer.model import PRESETS, Transformer
from keras_transformer.scoring import align_targets, score_targets
from keras_transformer.schedule import PaperAdam, TransformerSchedule, paper_adam

__version__ = "0.1.0"


def __getattr__(name):
    # TensorFlow's training step, loaded on first use: `import keras_transformer` imports no TensorFlow (on JAX and
    # PyTorch the library runs without it).
    if name == "UpdateStep":
        import keras

        if keras.backend.backend() != "tensorflow":
            raise ImportError(f"kt.UpdateStep is the training step for tf.distribute, on the TensorFlow backend; "
                              f"this is {keras.backend.backend()!r}, where Keras' own step sums gradients itself")
        from keras_transformer.distributed import UpdateStep

        return UpdateStep
    raise AttributeError(f"module 'keras_transformer' has no attribute {name!r}")
