"""A small random OPUS-MT-like Marian model, made and run by the reference implementation: what the kt-import tests
(tests/test_marian_import.py) compare our import, export and fine-tuning against. Run in the PyTorch test
virtualenv, where transformers is (`make venv-torch`):

    python tests/marian_reference.py OUT_DIR TRAIN_SOURCE TRAIN_TARGET SENTENCES

Writes OUT_DIR as a Hugging Face Marian directory, the way an OPUS-MT download has it: config.json,
model.safetensors, generation_config.json (beam 4, `<pad>` a bad word, as OPUS-MT's), source.spm and target.spm
(sentencepiece models trained here on the first lines of TRAIN_SOURCE and TRAIN_TARGET, each side its own),
vocab.json (the two sides' pieces, one vocabulary) and tokenizer_config.json. The model is trained for a few
seconds on those lines (a random one repeats one token to its limit: no test of a search). Then OUT_DIR/reference.json: for
each line of SENTENCES, `MarianTokenizer`'s source ids, and `generate`'s greedy and beam-4 outputs (ids, the
text `MarianTokenizer.decode` gives, and the beam's score) at length penalty 0: both libraries then rank by the
sum of log-probabilities, so the two searches look for the same thing.
"""

import io
import json
import sys
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import GenerationConfig, LogitsProcessorList, MarianConfig, MarianMTModel, MarianTokenizer

from bench.marian_bleu import on_our_terms  # the repository is on PYTHONPATH

# Each output is at most its source's length + this many tokens: the export's --extra-output-length in the
# tests, transformers' max_new_tokens here.
EXTRA_OUTPUT_LENGTH = 20
SPM_PIECES, TRAIN_LINES = 300, 3000
TRAIN_STEPS, BATCH = 200, 64


def train_spm(path, lines):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=SPM_PIECES,
                                   hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, num_threads=1)
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


def main(out, train_source, train_target, sentences_file):
    torch.set_num_threads(1)  # the test suite runs two test processes on two cores
    out.mkdir(parents=True, exist_ok=True)
    read = lambda p: Path(p).read_text(encoding="utf-8").split("\n")[:TRAIN_LINES]  # noqa: E731
    sides = [train_spm(out / "source.spm", read(train_source)), train_spm(out / "target.spm", read(train_target))]
    pieces = []
    for sp in sides:  # Marian's vocabulary: </s>, <unk>, both sides' pieces, <pad> last
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in pieces:
                pieces.append(sp.id_to_piece(i))
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    V = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

    config = MarianConfig(vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, activation_function="swish", max_position_embeddings=256,
                          scale_embedding=True, pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1,
                          forced_eos_token_id=0, dropout=0.1)
    torch.manual_seed(0)
    model = MarianMTModel(config)
    tokenizer = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                                source_lang="en", target_lang="de")
    pairs = [(s, t) for s, t in zip(read(train_source), read(train_target)) if s and t]
    data = tokenizer([s for s, _ in pairs], text_target=[t for _, t in pairs], padding=True, truncation=True,
                     max_length=48, return_tensors="pt")
    data["labels"][data["labels"] == V - 1] = -100  # padding: no loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for step in range(TRAIN_STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(pairs)
        loss = model(**{key: value[rows] for key, value in data.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():  # the bias of the logits is learned too, as OPUS-MT's final_logits_bias is not
        model.final_logits_bias.normal_(std=0.1)
    model.generation_config = GenerationConfig(num_beams=4, max_length=512, bad_words_ids=[[V - 1]],
                                               decoder_start_token_id=V - 1, eos_token_id=0, pad_token_id=V - 1,
                                               forced_eos_token_id=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    sentences = Path(sentences_file).read_text(encoding="utf-8").split("\n")[:-1]
    reference = {"sentences": sentences, "source_ids": [], "greedy_ids": [], "greedy": [], "beam_ids": [],
                 "beam": [], "beam_score": []}
    for sentence in sentences:  # one at a time: each sentence's own limit, no padding
        ids = tokenizer(sentence)["input_ids"]
        reference["source_ids"].append(ids)
        limit = len(ids) + EXTRA_OUTPUT_LENGTH
        common = dict(max_new_tokens=limit, do_sample=False, output_scores=True, return_dict_in_generate=True)
        # Greedy as OPUS-MT's generation config has it. The beam scored as ours (`on_our_terms`: <pad> renormalised
        # away, the end forced at the limit at its own log-probability), ranked by the sum of log-probabilities
        # (length penalty 0, in both libraries), and done once 4 hypotheses have ended (early_stopping=True), as
        # ours is (tests/test_marian.py says how the two stop).
        beam = dict(num_beams=4, length_penalty=0.0, early_stopping=True, forced_eos_token_id=None,
                    logits_processor=LogitsProcessorList([on_our_terms(V - 1, 0, limit + 1)]))
        with torch.no_grad():
            for search, options in (("greedy", dict(num_beams=1)), ("beam", beam)):
                result = model.generate(torch.tensor([ids]), **options, **common)
                tokens = result.sequences[0, 1:].tolist()  # after the start (<pad>)
                reference[f"{search}_ids"].append(tokens)
                reference[search].append(tokenizer.decode(tokens, skip_special_tokens=True))
                if search == "beam":
                    reference["beam_score"].append(float(result.sequences_scores[0]))
    (out / "reference.json").write_text(json.dumps(reference, ensure_ascii=False), encoding="utf-8")
    ended = sum(ids[-1] == 0 for ids in reference["greedy_ids"])
    print(json.dumps({"vocab": V, "final_loss": float(loss.detach()), "sentences": len(sentences), "greedy_ended": ended}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:5])
