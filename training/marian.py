"""A Hugging Face Marian checkpoint (OPUS-MT) as this library's `Transformer`: the configuration, the ids and the
weights, mapped exactly. numpy only: neither PyTorch nor transformers is imported.

What differs, and how it is mapped (transformers' `modeling_marian.py` and `convert_marian_to_pytorch.py`):

- The architecture is the paper's post-norm Transformer with scaled, tied embeddings, and Marian's own choices,
  which the model takes as arguments: the feed-forward activation (`activation`: "swish" is Keras' "silu"),
  the sinusoids as every sin then every cos (`sinusoid_layout="halves"`), a bias on the logits
  (`output_bias=True`, Marian's `final_logits_bias`) and LayerNorms of epsilon 1e-5 (`layer_norm_epsilon`).
- The special ids. Marian's vocabulary (`vocab.json`, V ids) has the end of sentence at 0, `<unk>` at 1, the
  pieces at 2 to V - 2 and `<pad>` last, and its decoder starts from `<pad>`, whose embedding row is zeros. This
  library's ids are fixed: pad 0, unk 1, start 2, end 3 (`keras_transformer.text`). The model's vocabulary is
  V + 1 ids, our id i holding Marian's id `MarianIds.ours_to_marian[i]`: pad and start both take Marian's
  `<pad>` row, end takes its 0, the pieces follow in their order (our 4 is Marian's 2). Pad and start are
  never an output: their logits' bias is `MASKED_LOGIT` (transformers bans `<pad>` as a bad word;
  CTranslate2 removes its row).

- The vocabulary. Marian tokenizes the source with `source.spm` and the target with `target.spm`, two
  sentencepiece models whose own ids it ignores: a piece's id is its line in `vocab.json`, shared by both sides
  (transformers' `MarianTokenizer`). This library's tokenizer is a sentencepiece model whose ids are the
  model's. So each side becomes one (`marian_sentencepiece`): a copy of its `.spm`, normalisation and all, whose
  pieces are renumbered to our ids, with the pieces of the other side in their places as unused pieces (never
  produced on this side). A piece of the `.spm` that `vocab.json` lacks, which `MarianTokenizer` turns into
  `<unk>`, is dropped, so sentencepiece segments around it instead (the import counts them).

A configuration this mapping does not cover is refused with a `MarianError` that names the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from keras_transformer.masking import PAD_ID
from keras_transformer.text import END_ID, START_ID, UNK_ID

# The bias of the logits of our pad and start ids: never an output, as in transformers' generation of Marian
# (their probability is about e^-100 of the others', nothing in float32). Finite, and not -1e9, for fine-tuning:
# label smoothing puts eps / V of the target distribution on every id, so each of the two costs the loss
# eps / V times its log-probability, about 100 here, where -1e9 made the loss of a token about 2e8 / V.
MASKED_LOGIT = -100.0
# Marian's "activation_function" values and the Keras activation of the same function.
ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}
MARIAN_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which Marian's layers keep
MARIAN_EOS_ID, MARIAN_UNK_ID = 0, 1


class MarianError(ValueError):
    """A Marian checkpoint this mapping does not cover: names the configuration key or the weight."""


@dataclasses.dataclass(frozen=True)
class MarianIds:
    """Where Marian's ids go. `ours_to_marian[i]` is the Marian id whose embedding row (and logits bias) our
    id i takes; `marian_to_ours` maps Marian's ids to ours (its `<pad>` to our pad)."""

    vocab_size: int  # Marian's V

    @property
    def ours_to_marian(self) -> np.ndarray:
        pad = self.vocab_size - 1
        specials = {PAD_ID: pad, UNK_ID: MARIAN_UNK_ID, START_ID: pad, END_ID: MARIAN_EOS_ID}
        assert sorted(specials) == [0, 1, 2, 3]
        return np.array([specials[i] for i in range(4)] + list(range(2, pad)), dtype=np.int64)

    @property
    def marian_to_ours(self) -> np.ndarray:
        table = np.arange(self.vocab_size, dtype=np.int64) + 2  # the pieces: Marian's 2 is our 4
        table[MARIAN_EOS_ID], table[MARIAN_UNK_ID], table[self.vocab_size - 1] = END_ID, UNK_ID, PAD_ID
        return table


def check_marian_config(config: dict) -> None:
    """A `MarianError` naming the first key of a Hugging Face `config.json` (as a dict) that the mapping does
    not cover."""
    def refuse(key, why):
        raise MarianError(f"Marian config: {key}={config.get(key)!r} is not supported: {why}")

    if config.get("model_type", "marian") != "marian":
        refuse("model_type", "only Marian models (\"marian\") are read")
    for key in ("normalize_before", "normalize_embedding", "add_final_layer_norm"):
        if config.get(key):
            refuse(key, "the mapping reads Marian's post-norm layers, without an embedding or final LayerNorm")
    if config.get("static_position_embeddings") is False:
        refuse("static_position_embeddings", "learned positions are not mapped (sinusoids only)")
    if not config.get("scale_embedding"):
        refuse("scale_embedding", "the library scales the token embedding by sqrt(d_model), as Marian's OPUS-MT do")
    if config.get("activation_function", "gelu") not in ACTIVATIONS:
        refuse("activation_function", f"the mapped activations are {', '.join(ACTIVATIONS)}")
    if not config.get("share_encoder_decoder_embeddings", True):
        refuse("share_encoder_decoder_embeddings", "only one vocabulary shared by source and target is mapped")
    if config.get("tie_word_embeddings", True) is False:
        refuse("tie_word_embeddings", "only an output projection tied to the embedding is mapped")
    vocab = config.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 4:
        refuse("vocab_size", "it must be a whole number of ids: </s>, <unk>, the pieces and <pad>")
    if config.get("decoder_vocab_size") not in (None, vocab):
        refuse("decoder_vocab_size", f"the target vocabulary must be the shared one ({vocab})")
    for key, expected in (("pad_token_id", vocab - 1), ("decoder_start_token_id", vocab - 1),
                          ("eos_token_id", MARIAN_EOS_ID)):
        if config.get(key, expected) != expected:
            refuse(key, f"Marian's ids are <pad> = vocab_size - 1 = {vocab - 1} (also the decoder's start) and "
                        f"</s> = {MARIAN_EOS_ID}")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config.get(a) != config.get(b):
            refuse(b, f"the library's encoder and decoder have one {a.split('_', 1)[1]} ({a}={config.get(a)!r})")


def transformer_arguments(config: dict) -> dict:
    """`keras_transformer.Transformer`'s arguments for a Marian `config.json` (checked first): the shared
    vocabulary of V + 1 ids (`MarianIds`), Marian's sizes and its options; no dropout (a pretrained model
    translates; fine-tuning sets its own)."""
    check_marian_config(config)
    return dict(
        vocab_size=config["vocab_size"] + 1, d_model=config["d_model"], num_heads=config["encoder_attention_heads"],
        d_ff=config["encoder_ffn_dim"], num_encoder_layers=config["encoder_layers"],
        num_decoder_layers=config["decoder_layers"], dropout=0.0, activation=ACTIVATIONS[config["activation_function"]],
        sinusoid_layout="halves", output_bias=True, layer_norm_epsilon=MARIAN_LAYER_NORM_EPSILON,
    )


def transformer_weights(state: dict, config: dict) -> dict:
    """The weights of the `Transformer` that `transformer_arguments(config)` builds, `{path: array}` (the path
    without the model's name, `embedding/token_embedding/embeddings`, ...), from Marian's `state` (its
    safetensors' `{key: array}`, float16 or float32), as float32. A `MarianError` names a weight that is
    missing, or of another shape than the config gives."""
    check_marian_config(config)
    d, heads = config["d_model"], config["encoder_attention_heads"]
    head = d // heads
    ids = MarianIds(config["vocab_size"])

    def get(key, shape):
        if key not in state:
            raise MarianError(f"Marian checkpoint: the weight {key!r} is missing")
        value = np.asarray(state[key], dtype=np.float32)
        if value.shape != shape:
            raise MarianError(f"Marian checkpoint: {key!r} is {value.shape}, the config gives {shape}")
        return value

    embedding_key = next((k for k in ("model.shared.weight", "model.encoder.embed_tokens.weight") if k in state),
                         "model.shared.weight")
    embedding = get(embedding_key, (config["vocab_size"], d))[ids.ours_to_marian]
    bias = get("final_logits_bias", (1, config["vocab_size"]))[0][ids.ours_to_marian]
    bias[[PAD_ID, START_ID]] = MASKED_LOGIT
    weights = {"embedding/token_embedding/embeddings": embedding, "output_bias": bias}

    def attention(ours, theirs):
        for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            weights[f"{ours}/{name}/kernel"] = get(f"{theirs}.{proj}.weight", (d, d)).T.reshape(d, heads, head)
            weights[f"{ours}/{name}/bias"] = get(f"{theirs}.{proj}.bias", (d,)).reshape(heads, head)
        weights[f"{ours}/attention_output/kernel"] = get(f"{theirs}.out_proj.weight", (d, d)).T.reshape(heads, head, d)
        weights[f"{ours}/attention_output/bias"] = get(f"{theirs}.out_proj.bias", (d,))

    def norm(ours, theirs):
        weights[f"{ours}/gamma"] = get(f"{theirs}.weight", (d,))
        weights[f"{ours}/beta"] = get(f"{theirs}.bias", (d,))

    def feed_forward(ours, theirs):
        ff = config["encoder_ffn_dim"]
        weights[f"{ours}/inner/kernel"] = get(f"{theirs}.fc1.weight", (ff, d)).T
        weights[f"{ours}/inner/bias"] = get(f"{theirs}.fc1.bias", (ff,))
        weights[f"{ours}/outer/kernel"] = get(f"{theirs}.fc2.weight", (d, ff)).T
        weights[f"{ours}/outer/bias"] = get(f"{theirs}.fc2.bias", (d,))

    for i in range(config["encoder_layers"]):
        ours, theirs = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        attention(f"{ours}/self_attention", f"{theirs}.self_attn")
        norm(f"{ours}/self_attention_norm", f"{theirs}.self_attn_layer_norm")
        feed_forward(f"{ours}/feed_forward", theirs)
        norm(f"{ours}/feed_forward_norm", f"{theirs}.final_layer_norm")
    for i in range(config["decoder_layers"]):
        ours, theirs = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        attention(f"{ours}/self_attention", f"{theirs}.self_attn")
        norm(f"{ours}/self_attention_norm", f"{theirs}.self_attn_layer_norm")
        attention(f"{ours}/cross_attention", f"{theirs}.encoder_attn")
        norm(f"{ours}/cross_attention_norm", f"{theirs}.encoder_attn_layer_norm")
        feed_forward(f"{ours}/feed_forward", theirs)
        norm(f"{ours}/feed_forward_norm", f"{theirs}.final_layer_norm")
    return weights



def marian_transformer(config: dict, state: dict):
    """The built `keras_transformer.Transformer` of a Marian `config` (config.json as a dict) with the weights of
    `state` (its safetensors, `{key: array}`) mapped (`transformer_arguments`, `transformer_weights`). A
    `MarianError` names a weight of the model that nothing maps to, or a mapped weight the model lacks."""
    import keras_transformer as kt

    model = kt.Transformer(**transformer_arguments(config))
    model.build()
    weights = transformer_weights(state, config)
    by_path = {w.path.split("/", 1)[1]: w for w in model.weights}
    for unmapped, where in ((set(by_path) - set(weights), "no weight maps to the model's"),
                            (set(weights) - set(by_path), "the model has no weight for the mapped")):
        if unmapped:
            raise MarianError(f"Marian checkpoint: {where} {', '.join(sorted(unmapped))}")
    for path, variable in by_path.items():
        variable.assign(weights[path])
    return model

# ---------------------------------------------------------------- the vocabularies

# A Hugging Face Marian directory's files (transformers' `MarianTokenizer.vocab_files_names`, its model's).
MARIAN_FILES = {"config": "config.json", "weights": "model.safetensors", "source_spm": "source.spm",
                "target_spm": "target.spm", "vocab": "vocab.json"}
MARIAN_SPECIAL_PIECES = ("</s>", "<unk>", "<pad>")  # Marian's ids 0, 1 and V - 1


def check_marian_vocab(vocab: dict, vocab_size: int) -> None:
    """A `MarianError` unless `vocab` (`vocab.json`: piece -> id) numbers the config's `vocab_size` ids once
    each, with `</s>` 0, `<unk>` 1 and `<pad>` last."""
    ids = sorted(vocab.values())
    if ids != list(range(vocab_size)):
        raise MarianError(f"Marian vocab.json: its {len(vocab):,} ids are not 0 to {vocab_size - 1} once each "
                          f"(config.json's vocab_size={vocab_size})")
    for piece, expected in zip(MARIAN_SPECIAL_PIECES, (MARIAN_EOS_ID, MARIAN_UNK_ID, vocab_size - 1)):
        if vocab.get(piece) != expected:
            raise MarianError(f"Marian vocab.json: {piece} is {vocab.get(piece)!r}, Marian's is {expected}")


def marian_sentencepiece(spm_proto: bytes, vocab: dict) -> tuple[bytes, int]:
    """One side's Marian tokenizer as a sentencepiece model proto in this library's ids: `spm_proto` (the
    bytes of `source.spm` or `target.spm`) with its pieces renumbered by `vocab` (`vocab.json`, piece ->
    Marian id, as `read_marian_dir` checked it with `check_marian_vocab`) through `MarianIds`: our id i is the
    piece of Marian's id `ours_to_marian[i]`, with the `.spm`'s score and type where it has the piece, else
    unused (the other side's pieces: never produced here); pad, unk, start and end are ours. Returns the proto and how many of the `.spm`'s pieces
    `vocab` lacks (dropped: `MarianTokenizer` makes them `<unk>`, sentencepiece now segments around them)."""
    from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf, sentencepiece's own schema

    model = pb.ModelProto()
    model.ParseFromString(spm_proto)
    Piece = pb.ModelProto.SentencePiece
    own = {p.piece: (p.score, p.type) for p in model.pieces if p.type in (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE)}
    by_id = {i: piece for piece, i in vocab.items()}
    del model.pieces[:]
    specials = {PAD_ID: ("<pad>", Piece.CONTROL), UNK_ID: ("<unk>", Piece.UNKNOWN), START_ID: ("<s>", Piece.CONTROL),
                END_ID: ("</s>", Piece.CONTROL)}
    for ours, theirs in enumerate(MarianIds(len(vocab)).ours_to_marian):
        if ours in specials:
            piece, kind = specials[ours]
            model.pieces.add(piece=piece, score=0.0, type=kind)
            continue
        piece = by_id[int(theirs)]
        score, kind = own.get(piece, (0.0, Piece.UNUSED))
        model.pieces.add(piece=piece, score=score, type=kind)
    spec = model.trainer_spec
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD_ID, UNK_ID, START_ID, END_ID
    spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = "<pad>", "<unk>", "<s>", "</s>"
    spec.vocab_size = len(model.pieces)
    return model.SerializeToString(), sum(piece not in vocab for piece in own)


@dataclasses.dataclass
class MarianCheckpoint:
    """A Hugging Face Marian directory, read (`read_marian_dir`)."""

    config: dict  # config.json
    state: dict  # model.safetensors: {key: numpy array}
    source_spm: bytes
    target_spm: bytes
    vocab: dict  # vocab.json: piece -> Marian id
    tokenizer_config: dict  # tokenizer_config.json ({} without one): source_lang, target_lang, separate_vocabs
    generation_config: dict  # generation_config.json ({} without one): num_beams, max_length, ...


def read_marian_dir(path) -> MarianCheckpoint:
    """A Hugging Face Marian (OPUS-MT) directory as `MarianCheckpoint`, with numpy and safetensors (no PyTorch
    or transformers). A `MarianError` names a missing file or a configuration, vocabulary or tokenizer the
    mapping does not cover; a `FileNotFoundError` a directory that is not there."""
    from safetensors.numpy import load_file

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (a Hugging Face Marian model's, e.g. a download of "
                                "Helsinki-NLP/opus-mt-en-de)")
    files = {name: root / file for name, file in MARIAN_FILES.items()}
    if not files["weights"].is_file() and (root / "pytorch_model.bin").is_file():
        raise MarianError(f"{root} has pytorch_model.bin but no model.safetensors: the import reads safetensors "
                          "only (it never loads PyTorch). Download the model's model.safetensors (most OPUS-MT "
                          "repositories have one), or convert it once with transformers: "
                          "MarianMTModel.from_pretrained(DIR).save_pretrained(DIR)")
    for name, file in files.items():
        if not file.is_file():
            raise MarianError(f"{root}: {file.name} is missing (a Marian directory has "
                              f"{', '.join(MARIAN_FILES.values())})")

    def json_file(name, required=True):
        file = root / name
        if not file.is_file() and not required:
            return {}
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise MarianError(f"{file}: not JSON ({e})") from None

    config = json_file(MARIAN_FILES["config"])
    check_marian_config(config)
    tokenizer_config = json_file("tokenizer_config.json", required=False)
    if tokenizer_config.get("separate_vocabs"):
        raise MarianError(f"{root / 'tokenizer_config.json'}: separate_vocabs=True is not supported: only one "
                          "vocabulary shared by source and target (vocab.json) is mapped")
    vocab = json_file(MARIAN_FILES["vocab"])
    check_marian_vocab(vocab, config["vocab_size"])
    return MarianCheckpoint(config, load_file(files["weights"]), files["source_spm"].read_bytes(),
                            files["target_spm"].read_bytes(), vocab, tokenizer_config,
                            json_file("generation_config.json", required=False))
