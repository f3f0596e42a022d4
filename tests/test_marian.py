"""training/marian.py against the reference implementation: small random `MarianMTModel`s of transformers (in the
PyTorch test virtualenv, where transformers is installed), saved as Hugging Face saves them, mapped with numpy into
the library's `Transformer` on the PyTorch backend, give the same logits, the same greedy output, and the same
beam search output as transformers' `generate(num_beams=4)` where both rank by the same objective.

transformers' beam search is made to score as ours (`on_our_terms`, bench/marian_bleu.py): log-probabilities
renormalised without Marian's <pad> (as `renormalize_logits=True` does; `bad_words_ids` alone leaves <pad>'s
probability out of the sum), and at the length limit only EOS, counted at its own log-probability."""

import pytest

from conftest import run_on_backend
from training.marian import MarianError, check_marian_config, transformer_arguments

REFERENCE = r"""
import json, sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import GenerationConfig, LogitsProcessorList, MarianConfig, MarianMTModel

import keras_transformer as kt
from keras_transformer.text import END_ID, START_ID
from training.marian import MarianIds, marian_transformer
from bench.marian_bleu import on_our_terms


def numpy(x):
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


def check_beams(reference, model, ids, V, rng):
    '''Beam search of 4 against transformers' `generate(num_beams=4)` on a batch of sources of 2 to 9 tokens.

    The same limit: ours `max_output_length=N` tokens, transformers' `max_length=N + 1`, which counts the decoder's
    start. At length penalty 0 (the plain sum of log-probabilities for both) the same stopping rule:
    `early_stopping=True`, where transformers ends a sentence's search once `num_beams` hypotheses have ended
    (those ending among the best `num_beams` candidates of a step, as in ours), which is our beam's rule; ours also
    stops once no live hypothesis can beat the best ended one, which cannot change the best. With
    `early_stopping=False` transformers searches on until no live hypothesis can enter its `num_beams` best, so it
    may find a likelier output after ours has stopped. At length penalty 1 (transformers' default) the objectives
    differ anyway: there transformers runs with its default `early_stopping=False`.
    '''
    N, lengths = 11, [9, 2, 6, 4, 8, 3, 7, 5]
    source = np.full((len(lengths), max(lengths)), V - 1)
    for row, n in enumerate(lengths):
        source[row, :n - 1] = rng.integers(2, V - 1, size=n - 1)
        source[row, n - 1] = 0
    ours_source = ids.marian_to_ours[source]
    greedy = numpy(kt.greedy_decode(model, ours_source, START_ID, END_ID, max_output_length=N)[0])

    def teacher_forced(tokens):  # our model's log P(tokens | source), and the lengths, the end token counted
        _, log_prob, _ = kt.score_targets(model, ours_source, tokens, START_ID, length_penalty=0.0)
        return numpy(log_prob), (tokens != 0).sum(axis=1)

    report = {}
    for alpha in (0.0, 1.0):
        generated = reference.generate(
            torch.tensor(source), attention_mask=torch.tensor(source != V - 1),
            logits_processor=LogitsProcessorList([on_our_terms(V - 1, 0, N + 1)]),
            generation_config=GenerationConfig(
                num_beams=4, do_sample=False, max_length=N + 1, early_stopping=alpha == 0.0, length_penalty=alpha,
                decoder_start_token_id=V - 1, eos_token_id=0, pad_token_id=V - 1, bad_words_ids=[[V - 1]],
                output_scores=True, return_dict_in_generate=True))
        theirs = np.full((len(lengths), N), V - 1)  # after the start; their batch is as long as their longest
        theirs[:, :generated.sequences.shape[1] - 1] = generated.sequences.numpy()[:, 1:]
        theirs = ids.marian_to_ours[theirs]  # <pad>, their filling after EOS, is our 0
        ours, our_score = map(numpy, kt.beam_search(model, ours_source, START_ID, END_ID, beam_size=4,
                                                    length_penalty=alpha, max_output_length=N))
        assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
        (their_log_prob, their_length), (our_log_prob, our_length) = teacher_forced(theirs), teacher_forced(ours)
        assert all(row[n - 1] == END_ID for row, n in zip(theirs, their_length)), theirs
        # transformers' score is its output's log-probability over its length (the generated tokens, EOS
        # included) to the power length_penalty: our model's log-probabilities of those tokens give it back.
        their_score = generated.sequences_scores.numpy()
        gap = float(np.max(np.abs(their_score - their_log_prob / their_length ** alpha)))
        assert gap < 1e-4, (alpha, gap, their_score, their_log_prob, their_length)
        assert np.allclose(our_score, our_log_prob / ((5 + our_length) / 6) ** alpha, atol=1e-4, rtol=0)
        same = (ours == theirs).all(axis=1)
        if alpha == 0.0:  # one objective: the same output, or ours is the greedy one and likelier
            for row in np.flatnonzero(~same):
                assert (ours[row] == greedy[row]).all() and our_log_prob[row] > their_log_prob[row], (
                    row, ours[row], theirs[row], our_log_prob[row], their_log_prob[row])
            assert same.sum() > len(lengths) / 2, same
            # Most outputs end before the limit, and one at least only there (the last token forced).
            assert (their_length < N).sum() > len(lengths) / 2 and (their_length == N).any(), their_length
            report["length_penalty 0"] = {
                "rows_same": f"{int(same.sum())}/{len(lengths)}", "lengths": their_length.tolist(),
                "log_prob": their_log_prob.astype(float).round(4).tolist(), "score_gap": gap}
        else:  # their objective is log P / length, ours log P / ((5 + length) / 6): neither output must win
            report["length_penalty 1"] = {
                "rows_same": f"{int(same.sum())}/{len(lengths)}", "score_gap": gap,
                "theirs": [row[:n].tolist() for row, n in zip(theirs, their_length)],
                "ours": [row[:n].tolist() for row, n in zip(ours, our_length)],
                "theirs_by_their_objective": (their_log_prob / their_length).astype(float).round(4).tolist(),
                "ours_by_their_objective": (our_log_prob / our_length).astype(float).round(4).tolist()}
    return report


def check(out, activation):
    V = 30
    config = MarianConfig(vocab_size=V, decoder_vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          activation_function=activation, max_position_embeddings=64, scale_embedding=True,
                          pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1, forced_eos_token_id=None,
                          dropout=0.0)
    torch.manual_seed(15)
    reference = MarianMTModel(config).eval()
    # Every weight random, the LayerNorms' and the logits' bias too (they start as 1 and 0), the matrices scaled by
    # their inputs (std 1 / sqrt(fan-in)). With std 0.5 for every weight the decoder's last states were nearly one
    # vector whatever came before: each step the same token, EOS as likely at every step, so beam search's outputs
    # were EOS alone or ran to the limit. The seed and the raised EOS bias are chosen so that they end at different
    # lengths, and some only at the limit (check_beams asserts that mix).
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if "embed_positions" in name:
                continue
            if name == "model.shared.weight" or "layer_norm.weight" in name:
                weight.normal_()
            elif weight.ndim == 2:
                weight.normal_(std=weight.shape[1] ** -0.5)
            else:
                weight.normal_(std=0.3)
        reference.final_logits_bias.normal_()
        reference.final_logits_bias[0, 0] += 1.0  # Marian's EOS, so that most outputs end before the limit
        reference.model.shared.weight[V - 1] = 0.0  # Marian's <pad> row, the decoder's start
    reference.save_pretrained(out)
    config_json = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    model = marian_transformer(config_json, state)  # a MarianError if a weight is unmapped either way

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
    assert (ours[..., [0, START_ID]] < ours[..., columns].max(axis=-1, keepdims=True) - 50).all()  # MASKED_LOGIT

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
    beams = check_beams(reference, model, ids, V, rng)
    print(activation, json.dumps({"gap": gap, "outputs": tokens.tolist(), "beam search": beams}))


for activation in sys.argv[2:]:
    check(Path(sys.argv[1]) / activation, activation)
"""


def test_a_random_marian_model_maps_to_the_same_logits_and_greedy_output(tmp_path):
    """A random MarianMTModel (OPUS-MT's swish, and gelu; every weight random, the logits' bias too), saved as
    safetensors, read with numpy and mapped: the logits of every Marian id but <pad> agree to 1e-4 on a batch with
    padding, pad and start are never outputs, and greedy decoding gives transformers' `generate(num_beams=1)`
    token for token.

    Beam search of 4, on 8 sources of 2 to 9 tokens, 11 output tokens at most (transformers' max_length 12 counts
    its start): at length penalty 0 (both rank by log P) it gives transformers' `generate(num_beams=4,
    early_stopping=True)` token for token in most rows (all, with this seed), and where it does not, its output is
    the greedy one and likelier; most outputs end before the limit, one at least only there. At transformers'
    default length penalty 1 (log P / length; ours is GNMT's log P / ((5 + length) / 6)) the outputs may differ:
    there, and at 0, transformers' `sequences_scores` equal its outputs' log-probabilities under our model over
    their length (EOS counted) to 1e-4, and both sides' outputs are printed with that score (`pytest -s`)."""
    printed = run_on_backend("torch", REFERENCE, tmp_path, "swish", "gelu", cwd=tmp_path)
    print(printed)
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
