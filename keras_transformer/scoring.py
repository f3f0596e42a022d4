"""Given outputs, read back: their score under the model, and the source piece each output token reads most.

Both run one teacher-forced pass of the model (the decoder reads the start id,
then the output, as in training), in `keras.ops`, on every backend:

- `score_targets`: log P(target | source) = sum_t log P(y_t | y_<t, source),
  and the searches' score, that over the length penalty
  lp(y) = ((5 + |y|) / 6)^alpha (`decoding.length_penalty`). Scoring a search's
  own output gives back the search's score. Used to filter parallel data and
  to rerank (CTranslate2's `score_batch`).
- `align_targets`: for each output token, the source piece with the largest
  cross-attention weight (averaged over the heads of one decoder layer) at
  the position that predicted it (paper section 3.2.3; CTranslate2's
  `return_attention`), for terminology, tags and formatting.

Targets come as the searches return them: tokens, the end id, then 0.
"""

from keras import ops

from keras_transformer.decoding import length_penalty as penalty_of_length
from keras_transformer.masking import PAD_ID
from keras_transformer.renamed import renamed_arguments


def _decoder_input(target_ids, start_id):
    """`[start_id] + target[:-1]`, per row: what the decoder reads to predict each target token."""
    target_ids = ops.cast(ops.convert_to_tensor(target_ids), "int32")
    if len(target_ids.shape) != 2:
        raise ValueError(f"target_ids must have shape [batch, target_len], got shape {target_ids.shape}")
    start = ops.full((ops.shape(target_ids)[0], 1), start_id, "int32")
    # As long as the target, also when that is 0 (an empty batch's): the start id, then all but its last token.
    return target_ids, ops.concatenate([start, target_ids], axis=1)[:, :ops.shape(target_ids)[1]]


@renamed_arguments(alpha="length_penalty")
def score_targets(model, source_ids, target_ids, start_id, length_penalty=0.6):
    """Teacher-forced log-probabilities of given outputs, and their length-penalised scores.

    Args:
        model: a `Transformer`.
        source_ids: int `[batch, source_len]`, padded with 0.
        target_ids: int `[batch, target_len]`: each output's tokens and its
            end id (no start id), padded with 0, as the searches return them.
        start_id: the target's start id.
        length_penalty: the length penalty's exponent alpha (Wu et al., 2016).
            `alpha=` is its old name, still accepted (a `DeprecationWarning`).

    Returns:
        scores: float32 `[batch]`, log P(target | source) / ((5 + |target|) / 6)^alpha,
            |target| counting the end id: the score a search reports for that output.
        log_prob: float32 `[batch]`, log P(target | source).
        token_log_probs: float32 `[batch, target_len]`, log P(y_t | y_<t, source), 0 at padding.

    Example:

    ```python
    tokens, scores = kt.beam_search(model, source_ids, START_ID, END_ID)
    rescored, log_prob, _ = kt.score_targets(model, source_ids, tokens, START_ID)  # rescored == scores
    ```
    """
    target_ids, target_in = _decoder_input(target_ids, start_id)
    log_probs = ops.log_softmax(ops.cast(model((source_ids, target_in), training=False), "float32"), axis=-1)
    real = target_ids != PAD_ID
    token_log_probs = ops.where(real, ops.take_along_axis(log_probs, target_ids[..., None], axis=-1)[..., 0], 0.0)
    log_prob = ops.sum(token_log_probs, axis=1)
    return log_prob / penalty_of_length(ops.sum(ops.cast(real, "int32"), axis=1), length_penalty), log_prob, token_log_probs


def align_targets(model, source_ids, target_ids, start_id, end_id, layer=-1):
    """For each output token, the source piece it reads most.

    Args:
        model, source_ids, target_ids, start_id: as in `score_targets`.
        end_id: the source's end id, which is not a piece: never an alignment.
        layer: the decoder layer whose cross-attention is read (the last by
            default), averaged over its heads.

    Returns:
        int32 `[batch, target_len]`: the index in `source_ids` of the piece
        with the largest attention weight from the position that predicted
        each output token; -1 at padding, and where the source has no piece.
    """
    target_ids, target_in = _decoder_input(target_ids, start_id)
    source_ids = ops.cast(ops.convert_to_tensor(source_ids), "int32")
    weights = ops.mean(model.attention_scores(source_ids, target_in)["decoder_cross_attention"][layer], axis=1)
    is_piece = (source_ids != PAD_ID) & (source_ids != end_id)  # [batch, source_len]
    # One more column, never the largest: argmax needs one, and a source of length 0 (an empty batch's) has none.
    candidates = ops.pad(ops.where(is_piece[:, None], weights, -1.0), [[0, 0], [0, 0], [0, 1]], constant_values=-2.0)
    alignment = ops.cast(ops.argmax(candidates, axis=-1), "int32")
    return ops.where((target_ids != PAD_ID) & ops.any(is_piece, axis=1)[:, None], alignment, -1)
