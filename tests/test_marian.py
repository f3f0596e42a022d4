"""training/marian.py against the reference implementation: small random `MarianMTModel`s of transformers (in the
PyTorch test virtualenv, where transformers is installed), saved as Hugging Face saves them, mapped with numpy into
the library's `Transformer` on the PyTorch backend, give the same logits and the same greedy output."""

import pytest

from conftest import run_on_backend
from training.marian import MarianError, check_marian_config, transformer_arguments

REFERENCE = r"""
import json, sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import GenerationConfig, MarianConfig, MarianMTModel

import keras_transformer as kt
from keras_transformer.text import END_ID, START_ID
from training.marian import MarianIds, transformer_arguments, transformer_weights


def check(out, activation):
    V = 30
    config = MarianConfig(vocab_size=V, decoder_vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          activation_function=activation, max_position_embeddings=64, scale_embedding=True,
                          pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1, forced_eos_token_id=None,
                          dropout=0.0)
    torch.manual_seed(0)
    reference = MarianMTModel(config).eval()
    with torch.no_grad():  # every weight random, the LayerNorms' and the logits' bias too (they start as 1 and 0)
        for name, weight in reference.named_parameters():
            if "embed_positions" not in name:
                weight.normal_(std=0.5)
        reference.final_logits_bias.normal_()
        reference.model.shared.weight[V - 1] = 0.0  # Marian's <pad> row, the decoder's start
    reference.save_pretrained(out)
    config_json = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    model = kt.Transformer(**transformer_arguments(config_json))
    model.build()
    weights = transformer_weights(state, config_json)
    by_path = {w.path.split("/", 1)[1]: w for w in model.weights}
    assert sorted(by_path) == sorted(weights), sorted(set(by_path) ^ set(weights))
    for path, weight in by_path.items():
        weight.assign(weights[path])

    ids = MarianIds(V)
    rng = np.random.default_rng(1)
    source = rng.integers(2, V - 1, size=(3, 7))
    source[:, -1] = 0  # Marian's </s> ends each source
    source[1, 4:] = V - 1  # a shorter one, padded with <pad>
    source[1, 3] = 0
    target_in = np.concatenate([np.full((3, 1), V - 1), rng.integers(2, V - 1, size=(3, 5))], axis=1)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(source), attention_mask=torch.tensor(source != V - 1),
                           decoder_input_ids=torch.tensor(target_in)).logits.numpy()
    ours_source, ours_target = ids.marian_to_ours[source], ids.marian_to_ours[target_in]
    ours_target[:, 0] = START_ID
    ours = np.asarray(model((ours_source, ours_target)).detach().cpu())
    columns = ids.marian_to_ours[: V - 1]  # every Marian id but <pad>, which is never an output
    gap = float(np.max(np.abs(ours[..., columns] - theirs[..., : V - 1])))
    assert gap < 1e-4, gap
    assert (ours[..., [0, START_ID]] < -1e8).all()

    generated = reference.generate(torch.tensor(source), attention_mask=torch.tensor(source != V - 1),
                                   generation_config=GenerationConfig(num_beams=1, do_sample=False, max_length=12,
                                                                      decoder_start_token_id=V - 1, eos_token_id=0,
                                                                      pad_token_id=V - 1, bad_words_ids=[[V - 1]]))
    tokens, _ = kt.greedy_decode(model, ours_source, START_ID, END_ID, max_output_length=11)
    tokens = np.asarray(tokens.detach().cpu() if hasattr(tokens, "detach") else tokens)
    for theirs_row, ours_row in zip(generated.numpy(), tokens):
        theirs_row = [int(t) for t in ids.marian_to_ours[[t for t in theirs_row[1:].tolist() if t != V - 1]]]
        ours_row = [int(t) for t in ours_row.tolist() if t != 0]
        # Ours ends at 11 tokens, the last an END the limit forces; transformers' max_length 12 counts its start.
        n = len(ours_row) - 1 if len(ours_row) == 11 else len(ours_row)
        assert ours_row[:n] == theirs_row[:n] and (n == 10 or theirs_row[n - 1] == END_ID), (theirs_row, ours_row)
    print(activation, json.dumps({"gap": gap, "outputs": tokens.tolist()}))


for activation in sys.argv[2:]:
    check(Path(sys.argv[1]) / activation, activation)
"""


def test_a_random_marian_model_maps_to_the_same_logits_and_greedy_output(tmp_path):
    """A random MarianMTModel (OPUS-MT's swish, and gelu; every weight random, the logits' bias too), saved as
    safetensors, read with numpy and mapped: the logits of every Marian id but <pad> agree to 1e-4 on a batch with
    padding, pad and start are never outputs, and greedy decoding gives transformers' `generate(num_beams=1)`
    token for token."""
    printed = run_on_backend("torch", REFERENCE, tmp_path, "swish", "gelu", cwd=tmp_path)
    assert [line.split()[0] for line in printed.splitlines() if line.startswith(("swish", "gelu"))] == [
        "swish", "gelu"]


OPUS_MT = {"model_type": "marian", "vocab_size": 58101, "decoder_vocab_size": 58101, "d_model": 512,
           "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8, "decoder_attention_heads": 8,
           "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "activation_function": "swish", "scale_embedding": True,
           "normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
           "static_position_embeddings": True, "pad_token_id": 58100, "eos_token_id": 0,
           "decoder_start_token_id": 58100, "share_encoder_decoder_embeddings": True}


@pytest.mark.parametrize("key,value,why", [
    ("normalize_before", True, "post-norm layers"),
    ("normalize_embedding", True, "without an embedding or final LayerNorm"),
    ("add_final_layer_norm", True, "without an embedding or final LayerNorm"),
    ("static_position_embeddings", False, "learned positions are not mapped"),
    ("scale_embedding", False, "scales the token embedding by sqrt"),
    ("activation_function", "tanh", "the mapped activations are swish, silu, relu, gelu"),
    ("share_encoder_decoder_embeddings", False, "one vocabulary shared"),
    ("decoder_vocab_size", 100, "the target vocabulary must be the shared one"),
    ("pad_token_id", 3, "<pad> = vocab_size - 1 = 58100"),
    ("decoder_ffn_dim", 1024, "one ffn_dim"),
    ("model_type", "bart", "only Marian models"),
    ("vocab_size", None, "a whole number of ids"),
])
def test_a_config_the_mapping_does_not_cover_is_refused_naming_the_key(key, value, why):
    """OPUS-MT's en-de configuration (its keys as the Hub's config.json has them) maps to the base model's shape
    with Marian's options and V + 1 ids; each key changed to what the mapping does not read is refused by name."""
    assert transformer_arguments(OPUS_MT) == dict(
        vocab_size=58102, d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6,
        dropout=0.0, activation="silu", sinusoid_layout="halves", output_bias=True, layer_norm_epsilon=1e-5)
    with pytest.raises(MarianError, match=f"Marian config: {key}={value!r} is not supported: .*{why}"):
        check_marian_config({**OPUS_MT, key: value})
