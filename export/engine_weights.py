"""The model the serving engine decodes with: a trained model's weights, mapped into the precision and layout
the engine computes fastest in.

One mapping, `engine_model`, for every copy the export makes:

- the graph decoder's, in the Keras dtype policy `decode_policy` picks (float32 unless bfloat16 is asked
  for), whatever policy the model was trained in;
- the XLA decoder's (`kt-export --xla-max-batch`), in float32;

both with the output projection stored `[d_model, vocab]` (`untie_output_projection=True`), the graph
decoder's as one column block per decoding loop (`output_blocks`, `ColumnBlocks`).

Weights are copied by their path (`variable.path`, the name a `.keras` file stores them under, without
the model's own name), and the mapping fails loudly, naming the weights, when a weight of the model is
not copied or a weight of the copy is not written: a layer the library adds, renames or drops must
show here, not as a copy decoding with its initial weights.
"""

import keras
import numpy as np
import tensorflow as tf


def engine_model(model, dtype=None, untie_output_projection=False, output_blocks=1):
    """`model`'s weights in a model of its class and config computing under the Keras dtype policy `dtype`.

    Args:
        model: a built `keras_transformer.Transformer`.
        dtype: the Keras dtype policy of the copy: "bfloat16" (weights stored in bfloat16) rather than
            mixed_bfloat16 for a bfloat16 decode: the same bfloat16 matmuls, minus a cast of every
            weight at every decoding step (a visible part of a step's time on CPU; docs/design.md, "How the
            engine stores its weights"); "float32" for the XLA decoder;
            None: `model`'s own.
        untie_output_projection: a tied output projection (the target embedding, `[vocab, d_model]`)
            becomes an untied `Dense` whose kernel is the embedding transposed, `[d_model, vocab]`,
            and whose bias is 0, or the model's `output_bias` weight. The logits are the same products,
            x E^T (+ b). XLA's CPU matmul and oneDNN's both read them faster from `[d_model, vocab]` than
            from the embedding's `[vocab, d_model]`, with the same tokens (docs/design.md, "How the engine
            stores its weights"). It costs the export one more `[d_model, vocab]` variable for each decoder.
        output_blocks: the untied output projection as this many column blocks (`ColumnBlocks`): the
            graph decoder passes its number of decoding loops, the inter-op threads it is served on.
            1 (default): one `Dense`.

    Returns:
        `model` itself when nothing changes (its policy is `dtype`, and its projection is untied or
        stays tied, in one block), else a new built model holding `model`'s weights, cast to `dtype`.

    Raises:
        ValueError: naming the weights, when a weight of `model` has no place in the copy or a weight
            of the copy gets no value; when `output_blocks` is below 1, or above 1 with the output
            projection tied.
    """
    dtype = model.dtype_policy.name if dtype is None else dtype
    untie = untie_output_projection and model.output_projection is None
    if output_blocks < 1 or (output_blocks > 1 and model.output_projection is None and not untie_output_projection):
        raise ValueError(f"output_blocks must be >= 1, and 1 for a tied output projection (pass "
                         f"untie_output_projection=True); got {output_blocks}")
    if dtype == model.dtype_policy.name and not untie and output_blocks == 1:
        return model
    overrides = {"dtype": dtype, **({"tie_output_embedding": False, "output_bias": False} if untie else {})}
    copy = type(model).from_config(model.get_config() | overrides)
    copy.build()
    values = {path: _numpy(variable) for path, variable in _weights_by_path(model).items()}
    if untie:
        embeddings = _relative_path(model.target_embedding.token_embedding.embeddings, model)
        projection = copy.output_projection
        values[_relative_path(projection.kernel, copy)] = np.transpose(values[embeddings])
        bias = model.logits_bias  # the tied projection's bias (`output_bias=True`), the Dense's then
        values[_relative_path(projection.bias, copy)] = (
            np.zeros(projection.bias.shape, values[embeddings].dtype) if bias is None
            else values.pop(_relative_path(bias, model)))
    assign_by_path(copy, values)
    if output_blocks > 1:
        # Set after the weights are mapped by path: the blocks are the engine's layout, not the model's.
        copy.output_projection = ColumnBlocks(copy.output_projection, output_blocks)
    return copy


class ColumnBlocks:
    """A built `Dense` layer's product as `blocks` matmuls over column blocks of its kernel (and bias),
    concatenated: the same outputs, column for column.

    Why: in the TensorFlow graph a decoding loop runs one op at a time on one inter-op thread, and at batch 1
    only one loop is busy; the output projection, `[d_model, vocab]`, is a step's largest matmul. As
    independent ops, its blocks run at once on the threads the idle loops leave (docs/design.md, "The output
    projection in column blocks").

    Not a Keras layer: it takes the place of a built model's `output_projection` (Keras adds no state to a
    built model), and its weights are `tf.Variable`s, which the export's functions capture and save like
    the model's own.

    Args:
        dense: a built `keras.layers.Dense`; its kernel `[d_in, units]` and bias are copied, in their dtype.
        blocks: the number of column blocks (`units` split as evenly as `numpy.array_split` splits it).

    Input `[..., d_in]` -> output `[..., units]`, computed as `dense` computes it: `x @ kernel + bias` in
    the input's dtype (a bias of zeros is not added).
    """

    def __init__(self, dense, blocks):
        kernel = _numpy(dense.kernel)
        bias = _numpy(dense.bias) if dense.use_bias else None
        columns = np.array_split(np.arange(kernel.shape[1]), blocks)
        self.units = kernel.shape[1]
        self.kernels = [tf.Variable(kernel[:, c], trainable=False, name=f"output_block_{i}_kernel")
                        for i, c in enumerate(columns)]
        # A zero bias (an untied copy of a tied embedding's) is left out: one op less per block and step.
        self.biases = None if bias is None or not bias.any() else [
            tf.Variable(bias[c], trainable=False, name=f"output_block_{i}_bias") for i, c in enumerate(columns)]

    def __call__(self, x):
        # 2-D matmuls on rows: Keras' matmul of a `[rows, 1, d]` input is a tensordot of some twenty shape
        # ops, which each block would repeat at every step.
        rows = tf.reshape(x, [-1, x.shape[-1]])
        outputs = []
        for i, kernel in enumerate(self.kernels):
            y = tf.matmul(rows, tf.cast(kernel, x.dtype))
            outputs.append(y if self.biases is None else tf.nn.bias_add(y, tf.cast(self.biases[i], x.dtype)))
        return tf.reshape(tf.concat(outputs, axis=-1), tf.concat([tf.shape(x)[:-1], [self.units]], axis=0))


def assign_by_path(model, values):
    """Writes `values` (`{path relative to the model: array}`) into `model`'s weights, each cast to its
    weight's dtype as `Layer.set_weights` casts; a ValueError names the values that no weight takes
    and the weights that no value reaches."""
    weights = _weights_by_path(model)
    unmapped = sorted(set(values) - set(weights))
    unassigned = sorted(set(weights) - set(values))
    if unmapped or unassigned:
        raise ValueError(
            f"The weight mapping into {type(model).__name__} '{model.name}' is incomplete: "
            + "; ".join(message for message in (
                unmapped and f"weights with no place in the copy: {', '.join(unmapped)}",
                unassigned and f"weights of the copy given no value: {', '.join(unassigned)}",
            ) if message)
        )
    for path, weight in weights.items():
        if tuple(weight.shape) != tuple(np.shape(values[path])):
            raise ValueError(f"Weight {path}: the copy's shape is {tuple(weight.shape)}, "
                             f"the value's {tuple(np.shape(values[path]))}.")
        weight.assign(values[path])


def _weights_by_path(model):
    """`{path relative to the model: weight}` for every weight of `model`; a repeated path is an error."""
    weights = {}
    for weight in model.weights:
        path = _relative_path(weight, model)
        if path in weights:
            raise ValueError(f"Two weights of {type(model).__name__} '{model.name}' have the path {path}.")
        weights[path] = weight
    return weights


def _relative_path(weight, model):
    """`weight.path` without the model's name in front (a copy may be named otherwise)."""
    prefix = f"{model.name}/"
    return weight.path[len(prefix):] if weight.path.startswith(prefix) else weight.path


def _numpy(variable):
    """A weight's value as `Model.get_weights` gives it: copied from the weight's own dtype, so a float32
    weight cast into a bfloat16 copy rounds once, as `set_weights(get_weights())` rounded it."""
    return keras.ops.convert_to_numpy(variable)
