"""The Transformer: tokens in, next-token logits out (paper figure 1)."""

import keras
import numpy as np
from keras import ops

from keras_transformer.attention import head_size
from keras_transformer.decoder import Decoder
from keras_transformer.embedding import PositionalEmbedding, saved_max_positions
from keras_transformer.encoder import Encoder
from keras_transformer.masking import padding_mask
from keras_transformer.renamed import renamed_arguments
from keras_transformer.residual import LAYER_NORM_EPSILON

PRESETS = {
    # For tests: builds and trains in seconds.
    "tiny": dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, dropout=0.1),
    # Trains on a 2-core CPU in under an hour on Multi30k.
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3, dropout=0.1),
    # Paper table 3, "base" and "big".
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6, dropout=0.1),
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6, num_decoder_layers=6, dropout=0.3),
}


def _token_ids(name, token_ids):
    """`token_ids` as an int tensor `[batch, length]`; a clear error for another rank.

    Non-integer ids are cast to int32, as `keras.layers.Embedding` does: Keras'
    own `fit()` under tf.distribute builds the model from a batch averaged
    across replicas, which arrives as floats.
    """
    token_ids = ops.convert_to_tensor(token_ids)
    if len(token_ids.shape) != 2:
        raise ValueError(
            f"Transformer expects {name} of shape [batch, length] (rank 2), "
            f"got shape {tuple(token_ids.shape)}."
        )
    return token_ids if "int" in keras.backend.standardize_dtype(token_ids.dtype) else ops.cast(token_ids, "int32")


@keras.saving.register_keras_serializable(package="keras_transformer")
class Transformer(keras.Model):
    """Encoder-decoder Transformer (Vaswani et al., 2017, "Attention Is All You Need").

    Args:
        vocab_size: size of a vocabulary shared by source and target (the
            paper's setting: one embedding matrix for source, target and the
            output projection). Give either this or both of:
        source_vocab_size, target_vocab_size: separate vocabularies.
        d_model: model width (512 base).
        num_heads: attention heads h (8 base); d_model must be divisible by it.
        d_ff: feed-forward inner width (2048 base).
        num_encoder_layers, num_decoder_layers: N (6 base).
        dropout: residual and embedding dropout P_drop (0.1 base).
        norm_first: pre-norm residual blocks instead of the paper's post-norm.
        tie_output_embedding: the pre-softmax projection reuses the target
            embedding matrix (paper section 3.4).
        learned_positions: learned position embeddings instead of sinusoids.
        max_positions: number of learned positions, required with
            `learned_positions`: sources and decoder inputs may have at most
            `max_positions` tokens, and decoding stops its outputs there.
            `max_length=` is its old name, still accepted (with a
            `DeprecationWarning`; a saved configuration with "max_length",
            a .keras file or config.json's "model_config", loads without one).
        attention_dropout: dropout on every attention's weights in training
            (not in the paper; 0 by default).
        activation_dropout: dropout on the feed-forward's inner activations
            in training (not in the paper; 0 by default).
        key_dim: d_k, every attention's query and key size per head. None
            (default): d_model // num_heads, the paper's. The value size per
            head d_v stays d_model // num_heads (paper table 3, rows B).
        activation: the feed-forward networks' activation, the name of a Keras
            activation: "relu" (default, the paper's max(0, .)), "silu" or
            "swish" (Marian's, OPUS-MT's), "gelu", ...
        sinusoid_layout: the sinusoids' order along d_model: "interleaved"
            (default, the paper's) or "halves" (Marian's; `positional_encoding`).
        layer_norm_epsilon: every LayerNorm's epsilon (1e-6 by default;
            Marian's is 1e-5).
        output_bias: a bias `[target_vocab]` added to the tied output
            projection's logits, x E^T + b (Marian's `final_logits_bias`;
            zeros when built). Not in the paper: False (default). An untied
            projection (`tie_output_embedding=False`) is a `Dense` with its
            own bias, and refuses the option.

    Shapes:
        call((source_ids `[batch, source_len]`, target_ids `[batch, target_len]`))
        -> float32 logits `[batch, target_len, target_vocab]`.
        Token id 0 is padding and is masked out of every attention, derived
        from the ids themselves (not from Keras masks, which a `tf.function`
        or a model boundary drops).

    Example:

    ```python
    model = Transformer.from_preset("base", vocab_size=37000)
    model.compile(optimizer=paper_adam(512), loss=MaskedSparseCategoricalCrossentropy())
    model.fit(dataset)  # elements ((source_ids, target_in), target_out)
    logits = model((source_ids, target_in))
    ```
    """

    @renamed_arguments(max_length="max_positions")
    def __init__(
        self,
        vocab_size=None,
        *,
        source_vocab_size=None,
        target_vocab_size=None,
        d_model=512,
        num_heads=8,
        d_ff=2048,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout=0.1,
        norm_first=False,
        tie_output_embedding=True,
        learned_positions=False,
        max_positions=None,
        attention_dropout=0.0,
        activation_dropout=0.0,
        key_dim=None,
        activation="relu",
        sinusoid_layout="interleaved",
        output_bias=False,
        layer_norm_epsilon=LAYER_NORM_EPSILON,
        **kwargs,
    ):
        super().__init__(**kwargs)
        given = (vocab_size is not None, source_vocab_size is not None, target_vocab_size is not None)
        if given not in ((True, False, False), (False, True, True)):
            raise ValueError(
                "Transformer needs either vocab_size (one vocabulary shared by source and target) "
                "or both source_vocab_size and target_vocab_size, got "
                f"vocab_size={vocab_size}, source_vocab_size={source_vocab_size}, "
                f"target_vocab_size={target_vocab_size}."
            )
        head_size(d_model, num_heads)
        if output_bias and not tie_output_embedding:
            raise ValueError("Transformer(output_bias=True) adds a bias to the tied output projection; an untied one "
                             "(tie_output_embedding=False) is a Dense layer with its own bias.")
        self.vocab_size = vocab_size
        self.source_vocab_size = source_vocab_size
        self.target_vocab_size = target_vocab_size
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.num_encoder_layers = num_encoder_layers
        self.num_decoder_layers = num_decoder_layers
        self.dropout = dropout
        self.norm_first = norm_first
        self.tie_output_embedding = tie_output_embedding
        self.learned_positions = learned_positions
        self.max_positions = max_positions
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.key_dim = key_dim
        self.activation = activation
        self.sinusoid_layout = sinusoid_layout
        self.output_bias = output_bias
        self.layer_norm_epsilon = layer_norm_epsilon
        self.logits_bias = None  # the output_bias weight, made in build()

        def embedding(size, name):
            return PositionalEmbedding(
                size, d_model, dropout, learned_positions, max_positions, sinusoid_layout=sinusoid_layout,
                dtype=self.dtype_policy, name=name
            )

        if vocab_size is not None:
            self.target_embedding = embedding(vocab_size, "embedding")
            self.source_embedding = None
        else:
            self.source_embedding = embedding(source_vocab_size, "source_embedding")
            self.target_embedding = embedding(target_vocab_size, "target_embedding")
        layer_args = dict(
            d_model=d_model, num_heads=num_heads, d_ff=d_ff, dropout=dropout, norm_first=norm_first,
            attention_dropout=attention_dropout, activation_dropout=activation_dropout, key_dim=key_dim,
            activation=activation, layer_norm_epsilon=layer_norm_epsilon, dtype=self.dtype_policy,
        )
        self.encoder = Encoder(num_encoder_layers, name="encoder", **layer_args)
        self.decoder = Decoder(num_decoder_layers, name="decoder", **layer_args)
        self.output_projection = (
            None
            if tie_output_embedding
            else keras.layers.Dense(
                target_vocab_size or vocab_size, dtype=self.dtype_policy, name="output_projection"
            )
        )

    @classmethod
    def from_preset(cls, name, **overrides):
        """A model sized as preset `name` ("tiny", "small", "base", "big").

        Pass the vocabulary (`vocab_size=...`) and any constructor argument
        to override, e.g. `Transformer.from_preset("small", vocab_size=8000, dropout=0.3)`.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}. Available presets: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    def build(self, input_shape=None):
        for embedding in (self.source_embedding, self.target_embedding):
            if embedding is not None:
                embedding.build((None, None))
        hidden_shape = (None, None, self.d_model)
        self.encoder.build(hidden_shape)
        self.decoder.build(hidden_shape, hidden_shape)
        if self.output_projection is not None:
            self.output_projection.build(hidden_shape)
        if self.output_bias and self.logits_bias is None:
            self.logits_bias = self.add_weight(shape=(self.target_vocab_size or self.vocab_size,),
                                               initializer="zeros", name="output_bias")
        self.built = True

    def _build_once(self):
        # encode/decode/decoding may be the first thing a user calls.
        if not self.built:
            self.build()

    # -- training on TensorFlow: the summed update (keras_transformer/distributed.py) -------------------------

    def compile(self, *args, **kwargs):
        """Keras' `compile`, with the same arguments.

        On TensorFlow, with one of the library's masked losses, `fit` and `evaluate` then run the library's
        `kt.UpdateStep`: on one device and under any `tf.distribute` strategy, N replicas compute what one
        computes. The loss is the mean over every real target token of the update. The optimizer's clipping
        (`global_clipnorm`, ...) applies to the gradient summed over the replicas. Its
        `gradient_accumulation_steps` is taken over by the step (the optimizer's is set to None), and counts
        batches per replica. Under `mixed_float16`, an overflow on any replica skips the update on all.

        With another loss, under more than one replica, settings that Keras' own step would apply to each
        replica's gradient (clipping, accumulation, loss scaling) are refused with a `ValueError` here.
        On JAX and PyTorch this is Keras' `compile`.
        """
        super().compile(*args, **kwargs)
        for name in ("train_step", "test_step"):
            self.__dict__.pop(name, None)  # a step installed for the previous compile
        self._steps_per_update = 1
        if keras.backend.backend() == "tensorflow":
            from keras_transformer.distributed import prepare_compiled

            ids = np.ones((2, 2), "int32")  # two rows: one pair for R-Drop's loss
            self._steps_per_update = prepare_compiled(self, ((ids, ids), ids))

    def compile_from_config(self, config):
        """Compiles as the saved model was compiled (`keras.models.load_model`), through `compile` above. (Keras
        compiles a loaded model only if its class keeps Keras' own `compile`, or defines this.)"""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        """Keras' `make_train_function`; on TensorFlow, it first installs the summed update (see `compile`)."""
        self._use_update_step(self.train_function is None or force)
        return super().make_train_function(force)

    def make_test_function(self, force=False):
        """Keras' `make_test_function`; on TensorFlow, it first installs the summed update (see `compile`)."""
        self._use_update_step(self.test_function is None or force)
        return super().make_test_function(force)

    def _use_update_step(self, making):
        # Once per compile: `compile` removes the step it installs (an attribute of the instance).
        if making and keras.backend.backend() == "tensorflow" and "train_step" not in self.__dict__:
            from keras_transformer.distributed import use_update_step

            use_update_step(self, getattr(self, "_steps_per_update", 1))

    def call(self, inputs, training=None):
        source_ids, target_ids = inputs
        source_ids = _token_ids("source_ids", source_ids)
        encoder_output = self.encode(source_ids, training=training)
        return self.decode(target_ids, encoder_output, padding_mask(source_ids), training=training)

    def encode(self, source_ids, training=None):
        """Source ids `[batch, source_len]` -> encoder output `[batch, source_len, d_model]`."""
        source_ids = _token_ids("source_ids", source_ids)
        self._build_once()
        embedding = self.source_embedding or self.target_embedding
        x = embedding(source_ids, training=training)
        return self.encoder(x, padding_mask=padding_mask(source_ids), training=training)

    def decode(self, target_ids, encoder_output, encoder_padding_mask, training=None):
        """Target ids `[batch, target_len]` and encoder output -> logits `[batch, target_len, vocab]`.

        `encoder_padding_mask` is `padding_mask(source_ids)`, `[batch, source_len]`.
        """
        target_ids = _token_ids("target_ids", target_ids)
        self._build_once()
        x = self.target_embedding(target_ids, training=training)
        x = self.decoder(
            x,
            encoder_output,
            encoder_padding_mask=encoder_padding_mask,
            decoder_padding_mask=padding_mask(target_ids),
            training=training,
        )
        return self.project(x)

    def project(self, x):
        """Decoder output `[..., d_model]` -> float32 logits `[..., target_vocab]`."""
        if self.output_projection is not None:
            logits = self.output_projection(x)
        else:
            embeddings = ops.cast(self.target_embedding.token_embedding.embeddings, x.dtype)
            # One 2-D matmul over all positions: a batched matmul that broadcasts the
            # embedding over the batch computes its gradient per sentence, then sums it.
            shape = ops.shape(x)
            logits = ops.matmul(ops.reshape(x, (-1, shape[-1])), ops.transpose(embeddings))
            logits = ops.reshape(logits, (*shape[:-1], embeddings.shape[0]))
            if self.logits_bias is not None:
                logits = logits + ops.cast(self.logits_bias, logits.dtype)
        # float32 logits keep softmax and the loss exact under mixed precision.
        return ops.cast(logits, "float32")

    def attention_scores(self, source_ids, target_ids):
        """The attention weights of every layer, for plotting or inspection.

        A full, inference-mode pass (no dropout) over `source_ids`
        `[batch, source_len]` and decoder input `target_ids`
        `[batch, target_len]` (start id first, as in `call`).

        Returns a dict of lists, one float32 tensor per layer, first layer first,
        each `[batch, num_heads, query_len, key_len]` (softmax weights, rows
        summing to 1 at real query tokens, 0 on padding keys):

        - `"encoder_self_attention"`: `[batch, heads, source_len, source_len]`
        - `"decoder_self_attention"`: `[batch, heads, target_len, target_len]`
          (0 above the diagonal: the decoder is causal)
        - `"decoder_cross_attention"`: `[batch, heads, target_len, source_len]`
          (which source tokens each target position reads, paper section 3.2.3)

        Example:

        ```python
        scores = model.attention_scores(source_ids, target_in)
        heatmap = scores["decoder_cross_attention"][-1][0].numpy().mean(axis=0)  # [target_len, source_len]
        ```
        """
        source_ids = _token_ids("source_ids", source_ids)
        target_ids = _token_ids("target_ids", target_ids)
        self._build_once()
        source_mask = padding_mask(source_ids)
        embedding = self.source_embedding or self.target_embedding
        encoder_output, encoder_scores = self.encoder(
            embedding(source_ids, training=False),
            padding_mask=source_mask,
            training=False,
            return_attention_scores=True,
        )
        _, decoder_scores = self.decoder(
            self.target_embedding(target_ids, training=False),
            encoder_output,
            encoder_padding_mask=source_mask,
            decoder_padding_mask=padding_mask(target_ids),
            training=False,
            return_attention_scores=True,
        )

        def float32(tensors):
            # Under mixed precision the weights are bfloat16/float16; plots and sums want float32.
            return [ops.cast(t, "float32") for t in tensors]

        return {
            "encoder_self_attention": float32(encoder_scores),
            "decoder_self_attention": float32(decoder_scores["self_attention"]),
            "decoder_cross_attention": float32(decoder_scores["cross_attention"]),
        }

    def init_decoding_cache(self, encoder_output, cache_length, rows_per_sentence=1):
        """Caches for `decode_step`: empty self-attention keys/values for `cache_length` target
        positions (0 for caches that grow), and the cross-attention keys/values of `encoder_output`,
        projected once here.

        `rows_per_sentence` g (beam search's hypotheses): the self-attention caches get g consecutive
        rows per sentence, `[batch * g, ...]`, while the cross-attention cache keeps one entry per
        sentence, which its g rows read together (no copy of the source per hypothesis).

        Returns `{"self_attention": [...], "cross_attention": [...]}`, one
        `(keys, values)` pair per decoder layer: keys
        `[rows, num_heads, length, key_dim]` (key_dim None: d_model // num_heads)
        and values `[rows, num_heads, length, d_model // num_heads]`: rows first
        everywhere, so beam search reorders the self-attention tensors on axis 0.
        """
        self._build_once()
        batch_size = ops.shape(encoder_output)[0]
        return {
            "self_attention": self.decoder.empty_cache(batch_size * rows_per_sentence, cache_length),
            "cross_attention": self.decoder.compute_cross_attention_cache(encoder_output),
        }

    def decode_step(self, token_ids, cache_index, encoder_output, encoder_padding_mask, cache, attention_ops=None):
        """One step of incremental decoding.

        Args:
            token_ids: `[rows]` the target token at position `cache_index`.
            cache_index: scalar int, its position (0 for the start token),
                where its keys and values are written in the cache.
            encoder_output: `[batch, source_len, d_model]`, or None (the
                cache holds its projections).
            encoder_padding_mask: `[batch, source_len]` bool.
            cache: from `init_decoding_cache` or the previous step. Its
                cross-attention entries may be one per sentence for `g`
                consecutive rows each (beam search's hypotheses):
                rows = batch * g.
            attention_ops: how the cached attentions compute
                (`keras_transformer.attention.AttentionOps`); None: a fixed
                buffer, `keras.ops`. `AttentionOps(growing_cache=True)`
                takes a cache made with `cache_length=0`.

        Returns:
            (float32 logits `[rows, vocab]` for position `cache_index + 1`, updated cache).
        """
        x = self.target_embedding(token_ids[:, None], start_index=cache_index, training=False)
        x, self_attention_cache = self.decoder(
            x,
            encoder_output,
            encoder_padding_mask=encoder_padding_mask,
            self_attention_cache=cache["self_attention"],
            cache_index=cache_index,
            cross_attention_cache=cache["cross_attention"],
            training=False,
            attention_ops=attention_ops,
        )
        cache = {"self_attention": self_attention_cache, "cross_attention": cache["cross_attention"]}
        return self.project(x)[:, 0], cache

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "source_vocab_size": self.source_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "d_ff": self.d_ff,
            "num_encoder_layers": self.num_encoder_layers,
            "num_decoder_layers": self.num_decoder_layers,
            "dropout": self.dropout,
            "norm_first": self.norm_first,
            "tie_output_embedding": self.tie_output_embedding,
            "learned_positions": self.learned_positions,
            "max_positions": self.max_positions,
            "attention_dropout": self.attention_dropout,
            "activation_dropout": self.activation_dropout,
            "key_dim": self.key_dim,
            "activation": self.activation,
            "sinusoid_layout": self.sinusoid_layout,
            "output_bias": self.output_bias,
            "layer_norm_epsilon": self.layer_norm_epsilon,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # A model saved before the rename (a .keras file, config.json's "model_config") has "max_length".
        return super().from_config(saved_max_positions(config), custom_objects=custom_objects)
