"""One translator alone in its own process, timed on request (the worker of bench/ctranslate2_side_by_side.py and
bench/served_load.py; not a test).

    python bench/translate_worker.py ours --saved-model EXPORT/translator/1 --inter-op-threads 2 --intra-op-threads 1
    python bench/translate_worker.py ct2 --ct2-model CT2_DIR --tokenizer CT2_DIR/tokenizer.model \\
        --setting float32:2x1 --length-penalty 0.84 --max-source-length 128 --extra-output-length 50

`compare` starts one worker per system and thread layout, so that each runs
as a user runs it: alone in its process, with its own thread pools, and no
other framework loaded (the CTranslate2 worker imports neither TensorFlow nor
Keras). A worker loads its translator, says it is ready, then answers
requests one at a time, each a line of JSON on stdin:

    {"batches": [["a sentence", ...], ...], "beam": 4, "signature": "serving_default"}

It translates the batches in order and answers with one line on stdout,

    REPLY {"seconds": 12.3, "translations": [["ein Satz", ...], ...]}

where `seconds` is measured in the worker around the batches alone (not the
pipe, not the JSON). Anything else a library prints on stdout is ignored by
the caller. An empty line or end of input ends the worker.

A load request (bench/served_load.py) runs clients in a closed loop instead:

    {"load": {"clients": 16, "seconds": 20, "warmup_seconds": 3, "beam": 4, "signature": "serving_default"},
     "sentences": ["a sentence", ...]}

The worker starts `clients` threads at once; client i walks the sentences from
offset i * len(sentences) // clients, sends ONE sentence per call (the same
translate function as a batch request, given a batch of one) and sends the
next as soon as its answer is back. Calls that end in the first
`warmup_seconds` are discarded; those that end in the `seconds` after it are
counted, with their latency (from the call to its answer, so a call begun in
the warm-up counts its whole wait). No call starts after the window; the
calls still running then finish and are not counted. The answer:

    REPLY {"clients": 16, "sentences": 812, "seconds": 20.0, "sentences_per_s": 40.6,
           "latency_ms": {"p50": ..., "p90": ..., "p99": ..., "mean": ..., "max": ...},
           "per_client": [min, max], "drain_seconds": 0.4}

(`per_client`: the fewest and most calls one client completed in the window;
`drain_seconds`: how long the calls running at the window's end took to
finish), or `{"error": "..."}` if a call failed. With `"trace_batches": true`
in the load, ours also answers `"merged_batches": {"batches": N, "mean_size":
M, "sizes": [...]}`: every batch its request batching ran from the first call
to the last (warm-up included), in order, read from TensorFlow's profiler
(`export.tf_internals.merged_batch_sizes`), which runs through the whole load.

ours: the request's text signature of the SavedModel (`greedy`, or
`serving_default`: the beam search it was exported with), tokenization and
detokenization in the graph; the session's thread pools as
TF Serving's --tensorflow_inter_op_parallelism and
--tensorflow_intra_op_parallelism set them.

ct2: `ctranslate2.Translator(compute_type, inter_threads=WORKERS,
intra_threads=THREADS).translate_batch` with the request's beam size on sentencepiece pieces, tokenized and
detokenized (Python sentencepiece, the model's own) inside the timed section.
With 2 workers each batch is split into two halves that run at once.
Under load the clients share the one `Translator`, as CTranslate2's documentation
says to serve concurrent requests: each of its `inter_threads` workers takes
the next queued `translate_batch` call (here of one sentence).
Ours under load: the clients call the same loaded signature at once, as TF
Serving's request threads do; an export with request batching merges the calls
that arrive while it decodes (export/request_batching.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPLY_PREFIX = "REPLY "


def reply(message: dict):
    sys.stdout.write(REPLY_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def parse_layout(text) -> tuple[int, int]:
    """'2x1' -> (2, 1)."""
    try:
        first, second = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxM, e.g. 2x1") from None
    if first < 1 or second < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: thread counts must be >= 1")
    return first, second


def parse_ct2_setting(text):
    """'int8:2x1' -> ("int8", 2, 1): compute type, workers (inter_threads) x threads per worker (intra_threads)."""
    compute_type, _, layout = text.partition(":")
    try:
        inter, intra = parse_layout(layout)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected COMPUTE_TYPE:WORKERSxTHREADS, e.g. int8:2x1 or float32:1x2 ({e})") from None
    if compute_type not in ("float32", "int8", "int8_float32", "bfloat16", "int8_bfloat16"):
        raise argparse.ArgumentTypeError(f"{text!r}: unknown compute type {compute_type!r}")
    return compute_type, inter, intra


class CTranslate2Texts:
    """Text in, text out through a converted model, as our text signatures: translate(texts, beam_size)
    -> translations.

    compute_type: "float32" or "int8" (CTranslate2 quantizes the float32 weights when it loads them, with a
    scale per output channel). With inter_threads > 1 each batch is split into inter_threads chunks of equal
    size that run at once, one per worker."""

    def __init__(self, model_dir, tokenizer, max_source_length, length_penalty, extra_output_length, pad_id,
                 threads, inter_threads=1, compute_type="float32"):
        import ctranslate2
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
        self.translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=inter_threads)
        self.inter_threads = inter_threads
        self.max_source_length = max_source_length
        self.length_penalty = length_penalty
        self.extra_output_length = extra_output_length
        self.pad = self.sp.id_to_piece(pad_id)

    def output_limit(self, pieces) -> int:
        """CTranslate2's max_decoding_length for a batch: our limit for its longest source, minus the end token.

        Ours: source tokens (pieces, truncated, + </s>) + extra_output_length, the end token counted;
        CTranslate2 does not count it (its last step takes any token).
        """
        longest = max(min(len(p), self.max_source_length - 1) + 1 for p in pieces)
        return longest + self.extra_output_length - 1

    def translate(self, texts, beam_size):
        pieces = self.sp.encode(list(texts), out_type=str)
        chunk = -(-len(pieces) // self.inter_threads)
        results = self.translator.translate_batch(
            pieces, beam_size=beam_size, length_penalty=self.length_penalty,
            max_input_length=self.max_source_length, max_decoding_length=self.output_limit(pieces),
            min_decoding_length=0, suppress_sequences=[[self.pad]], max_batch_size=chunk)
        return self.sp.decode([r.hypotheses[0] for r in results])


def ours_translator(args):
    """(batch, request) -> translations through the request's signature of the SavedModel, and a description."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common.native_logs import import_tensorflow_quietly

    tf = import_tensorflow_quietly()
    # Before any op runs: TensorFlow fixes its thread pools when it first executes.
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    from export.translate import SavedModelTranslator

    saved_model = SavedModelTranslator(args.saved_model)

    def translate(batch, request):
        return list(saved_model.translate_batch(batch, request["signature"]).translations)

    from export.tf_internals import merged_batch_sizes

    translate.merged_batch_sizes = merged_batch_sizes  # a load with "trace_batches" reports how calls were merged
    return translate, {"tensorflow": tf.__version__, "inter_op_threads": args.inter_op_threads,
                       "intra_op_threads": args.intra_op_threads}


def ct2_translator(args):
    import ctranslate2

    compute_type, workers, threads = args.setting
    texts = CTranslate2Texts(args.ct2_model, args.tokenizer, args.max_source_length, args.length_penalty,
                             args.extra_output_length, args.pad_id, threads, workers, compute_type)
    return (lambda batch, request: texts.translate(batch, request["beam"]),
            {"ctranslate2": ctranslate2.__version__, "compute_type": compute_type, "inter_threads": workers,
             "intra_threads": threads, "length_penalty": args.length_penalty})


def percentile(ordered, p):
    """The nearest-rank p-th percentile of an ascending list (None if empty)."""
    if not ordered:
        return None
    return ordered[max(0, min(len(ordered), -(-len(ordered) * p // 100)) - 1)]


def run_load(translate, load, sentences) -> dict:
    """A load request (see the module docstring): `load["clients"]` threads in a closed loop, one sentence per
    call of `translate(batch, load)`, for `load["warmup_seconds"]` then `load["seconds"]`."""
    clients, seconds = int(load["clients"]), float(load["seconds"])
    if clients < 1 or seconds <= 0 or not sentences:
        return {"error": f"load: need clients >= 1, seconds > 0 and sentences (got {clients}, {seconds}, "
                         f"{len(sentences)})"}
    latencies = [[] for _ in range(clients)]
    failures = []
    failed = threading.Event()
    window_start = time.perf_counter() + float(load.get("warmup_seconds", 0))
    window_end = window_start + seconds

    def client(i):
        k = i * len(sentences) // clients
        try:
            while not failed.is_set():
                t0 = time.perf_counter()
                if t0 >= window_end:
                    return
                translate([sentences[k % len(sentences)]], load)
                t1 = time.perf_counter()
                if window_start < t1 <= window_end:
                    latencies[i].append(t1 - t0)
                k += 1
        except Exception as e:  # noqa: BLE001 (reported to the caller, which stops)
            failures.append(f"client {i}: {type(e).__name__}: {e}")
            failed.set()

    def run_clients():
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    merged = None
    if load.get("trace_batches") and hasattr(translate, "merged_batch_sizes"):
        _, sizes = translate.merged_batch_sizes(run_clients)
        merged = {"batches": len(sizes), "mean_size": round(sum(sizes) / len(sizes), 2) if sizes else None,
                  "sizes": sizes}
    else:
        run_clients()
    drain = max(0.0, time.perf_counter() - window_end)
    if failures:
        return {"error": "; ".join(failures[:3])}
    ordered = sorted(t * 1000 for per_client in latencies for t in per_client)
    return {"clients": clients, "sentences": len(ordered), "seconds": seconds,
            "sentences_per_s": round(len(ordered) / seconds, 2),
            "latency_ms": {**{f"p{p}": None if not ordered else round(percentile(ordered, p), 1)
                              for p in (50, 90, 99)},
                           "mean": None if not ordered else round(sum(ordered) / len(ordered), 1),
                           "max": None if not ordered else round(ordered[-1], 1)},
            "per_client": [min(map(len, latencies)), max(map(len, latencies))], "drain_seconds": round(drain, 2),
            **({"merged_batches": merged} if merged is not None else {})}


def serve(translate, description):
    reply({"ready": True, **description})
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        if "load" in request:
            reply(run_load(translate, request["load"], request["sentences"]))
            continue
        t0 = time.perf_counter()
        translations = [translate(batch, request) for batch in request["batches"]]
        reply({"seconds": time.perf_counter() - t0, "translations": translations})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    systems = p.add_subparsers(dest="system", required=True)
    o = systems.add_parser("ours", help="an exported SavedModel")
    o.add_argument("--saved-model", required=True, help="EXPORT_DIR/NAME[/VERSION]")
    o.add_argument("--inter-op-threads", type=int, default=0, help="0: TensorFlow's choice, one per core")
    o.add_argument("--intra-op-threads", type=int, default=0, help="0: TensorFlow's choice, one per core")
    c = systems.add_parser("ct2", help="a CTranslate2 model written by ctranslate2_side_by_side.py convert")
    c.add_argument("--ct2-model", required=True)
    c.add_argument("--tokenizer", required=True, help="the sentencepiece model `convert` copied beside it")
    c.add_argument("--setting", required=True, type=parse_ct2_setting,
                   help="COMPUTE_TYPE:WORKERSxTHREADS, e.g. float32:2x1")
    c.add_argument("--length-penalty", type=float, required=True)
    c.add_argument("--max-source-length", type=int, required=True, help="source pieces, end token included")
    c.add_argument("--extra-output-length", type=int, required=True,
                   help="our output limit past the source length, end token included")
    c.add_argument("--pad-id", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    serve(*(ours_translator(args) if args.system == "ours" else ct2_translator(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
