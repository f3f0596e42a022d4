"""Export a trained translator as a SavedModel that TF Serving serves.

    python -m export.export_model --model-dir runs/en-de --export-dir exports [--name translator]
    kt-export --model-dir runs/en-de --export-dir exports

Writes TF Serving's layout EXPORT_DIR/NAME/VERSION/ (saved_model.pb,
variables/, assets/tokenizer.model), VERSION being 1 or the next integer
after the highest existing one. The version directory appears atomically
(written under a hidden temporary name, then renamed), so a model server
polling EXPORT_DIR/NAME never loads a half-written version. It holds TF
Serving's warm-up requests, assets.extra/tf_serving_warmup_requests, which the
model server replays before it serves the version.

Every decoding signature merges concurrent requests into one batch in the
graph (export/request_batching.py; --max-request-batch 0 turns it off): the
model server needs no batching flags for it.

Signatures: serving_default (text -> translation, score, truncated; beam
search), greedy (same, greedy decoding), n_best, sample, prefix, greedy_prefix,
score, align, translate_ids (source_ids -> tokens, score), tokenize (text ->
source_ids).
See export/translator.py and export/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.native_logs import VERBOSE_HELP, quiet_import_for_commands

# Before TensorFlow is imported: a command prints none of its C++ start-up lines (see common/native_logs.py).
quiet_import_for_commands(__name__)

import tensorflow as tf  # noqa: E402
from tensorflow_serving.apis import prediction_log_pb2  # noqa: E402

from export.graph_ops import registered_ops, saved_model_ops, unservable_ops  # noqa: E402
from export.request_batching import DEFAULT_MAX_BATCH_SIZE, DEFAULT_TIMEOUT_MICROS, RequestBatching  # noqa: E402
from export.translator import GREEDY_SIGNATURE, PRECISIONS, TEXT_SIGNATURE, Translator  # noqa: E402
from export.translator import decode_loops, decode_policy  # noqa: E402
from keras_transformer.decoding import EXTRA_OUTPUT_LENGTH  # noqa: E402
from keras_transformer.renamed import renamed_arguments  # noqa: E402
from common.run_dir import (DEFAULT_BEAM_SIZE, DEFAULT_LENGTH_PENALTY, add_renamed_flags, read_config_or_exit,  # noqa: E402
                            recorded_setting, take_renamed_flags)

# TF Serving's warm-up file (read at load, at most 1000 records, each replayed once by default).
WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
# Warm-up requests: both text signatures, one sentence and a batch of 8 (first requests then pay no
# one-time graph optimization or allocation). Any language does: only the work matters.
WARMUP_TEXTS = ["A man is riding a bike.", "Two dogs play in the snow.", "A little girl climbs the stairs.",
                "People are walking down a busy city street at night.", "A woman sings on a stage.",
                "Three children sit on a bench and eat ice cream.", "A cat sleeps.",
                "A group of workers in orange vests repair the road next to a red truck."]
WARMUP_BATCHES = [(signature, WARMUP_TEXTS[:n]) for signature in (TEXT_SIGNATURE, GREEDY_SIGNATURE) for n in (1, 8)]


def next_version(base: Path) -> int:
    """1 + the highest integer-named subdirectory of `base` (1 if none)."""
    versions = [int(p.name) for p in base.iterdir() if p.is_dir() and p.name.isdigit()] if base.is_dir() else []
    return max(versions, default=0) + 1


def write_warmup_requests(saved_model_dir, model_name, batches=WARMUP_BATCHES) -> Path:
    """Writes SAVED_MODEL_DIR/assets.extra/tf_serving_warmup_requests: a TFRecord file of
    `tensorflow.serving.PredictionLog`s, one predict request per (signature, texts) of `batches`."""
    path = Path(saved_model_dir) / WARMUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for signature, texts in batches:
            log = prediction_log_pb2.PredictionLog()
            request = log.predict_log.request
            request.model_spec.name, request.model_spec.signature_name = model_name, signature
            request.inputs["text"].CopyFrom(tf.make_tensor_proto([t.encode("utf-8") for t in texts],
                                                                 dtype=tf.string, shape=[len(texts)]))
            writer.write(log.SerializeToString())
    return path


@renamed_arguments(alpha="length_penalty")
def export(model_dir, export_dir, *, name="translator", version=None, model_file=None, beam_size=4, length_penalty=0.6,
           use_cache=True, check_ops=True, precision="auto", xla_max_batch=0, parallel_loops="auto",
           no_repeat_ngram_size=0, extra_output_length=EXTRA_OUTPUT_LENGTH, request_batching=RequestBatching()) -> Path:
    """Writes the SavedModel; returns EXPORT_DIR/NAME/VERSION. `length_penalty`: the length penalty's exponent
    alpha (Wu et al., 2016; kt-export's --length-penalty; `alpha=` is its old name); `parallel_loops`: see
    `decode_loops`; `no_repeat_ngram_size`, `extra_output_length`: see `Translator`; `request_batching`: how the decoding signatures
    merge concurrent requests (a `RequestBatching`; None: each request decodes on its own)."""
    base = Path(export_dir) / name
    base.mkdir(parents=True, exist_ok=True)
    version = next_version(base) if version is None else int(version)
    target = base / str(version)
    if target.exists():
        raise FileExistsError(f"{target} exists; omit --version to write the next version")
    translator = Translator.from_model_dir(model_dir, model_file=model_file, beam_size=beam_size, length_penalty=length_penalty,
                                           use_cache=use_cache, precision=precision, xla_max_batch=xla_max_batch,
                                           parallel_loops=parallel_loops, no_repeat_ngram_size=no_repeat_ngram_size,
                                           extra_output_length=extra_output_length,
                                           request_batching=request_batching)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=base))  # not an integer: TF Serving ignores it
    try:
        translator.save(tmp)
        write_warmup_requests(tmp, name)
        if check_ops:
            bad = unservable_ops(saved_model_ops(tmp), registered_ops(), allow_xla=bool(xla_max_batch))
            if bad:
                raise RuntimeError(f"The exported graph has ops tensorflow_model_server cannot run: {bad}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_parser():
    p = argparse.ArgumentParser(prog="kt-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="directory written by kt-train "
                   "(model.keras, tokenizer.model, config.json)")
    p.add_argument("--export-dir", required=True, help="TF Serving base directory; writes EXPORT_DIR/NAME/VERSION")
    p.add_argument("--name", default="translator", help="model name (TF Serving's --model_name; default translator)")
    p.add_argument("--version", type=int, help="version number (default: next free integer)")
    p.add_argument("--model-file", help="another .keras file in place of MODEL_DIR/model.keras (e.g. averaged)")
    p.add_argument("--beam-size", type=int, help="beam size of serving_default (default: the one kt-train --beam-size "
                   f"recorded in config.json, else {DEFAULT_BEAM_SIZE})")
    p.add_argument("--length-penalty", type=float, metavar="A",
                   help="length penalty: a hypothesis scores log P / ((5 + length) / 6)^A (default: the one kt-train "
                   f"--length-penalty recorded in config.json, else {DEFAULT_LENGTH_PENALTY})")
    add_renamed_flags(p, "alpha")  # --alpha, still read (with a note): see main
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="decode without the key/value cache (same output, slower; for benchmarks)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="what the exported graph decodes in. auto (default): float32, the same translation "
                        "alone or in any batch. bfloat16: faster where the CPU computes it natively "
                        "(avx512_bf16/amx_bf16), but there a translation may depend on its batch. "
                        "model: the training policy")
    p.add_argument("--xla-max-batch", type=int, default=0, metavar="N",
                   help="decode batches of at most N sentences with the search compiled by XLA in float32 (faster at "
                        "batch 1 on CPU, where the graph's step costs the dispatch of its many small ops; each new "
                        "input shape compiles once, for seconds; docs/design.md, "
                        "\"Small batches under XLA, opt-in\"). "
                        "The model server must then run with --xla_cpu_compilation_enabled. Default 0: no XLA")
    p.add_argument("--parallel-loops", default="auto", metavar="N",
                   help="decode a batch in N loops at once, outside XLA (one loop keeps about one core busy: at batch "
                        "64 on 2 cores, with the flags that follow, greedy and beam 4 decode faster than one loop on "
                        "the same threads; docs/design.md, \"Parallel decoding loops\"); "
                        "serve with --tensorflow_inter_op_parallelism=N --tensorflow_intra_op_parallelism=1. "
                        "Default auto: one per CPU of THIS machine, at most 8")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0, metavar="N",
                   help="N > 0: no translation of any signature repeats an N-gram of pieces, against outputs that "
                        "loop (as the library's searches' no_repeat_ngram_size). Default 0: no ban")
    p.add_argument("--extra-output-length", type=int, metavar="N",
                   help="a translation has at most its source's length + N pieces (default: the one kt-train "
                        f"--extra-output-length recorded in config.json, else {EXTRA_OUTPUT_LENGTH})")
    p.add_argument("--max-request-batch", type=int, default=DEFAULT_MAX_BATCH_SIZE, metavar="N",
                   help="every decoding signature merges the requests that arrive while it decodes into batches of "
                        f"up to N sentences, in the graph (docs/serving.md, \"Under load\"); a larger request "
                        f"decodes whole on its own. 0: no merging, each request decodes on its own. "
                        f"Default {DEFAULT_MAX_BATCH_SIZE}")
    p.add_argument("--request-batch-timeout-us", type=int, default=DEFAULT_TIMEOUT_MICROS, metavar="T",
                   help="how long a batch that is not full waits for more requests, in microseconds (a lone "
                        f"request waits that long too). Default {DEFAULT_TIMEOUT_MICROS}: it runs as soon as the "
                        "previous batch is done")
    p.add_argument("--skip-op-check", dest="check_ops", action="store_false",
                   help="do not check that every op is one tensorflow_model_server has")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.xla_max_batch < 0:
        parser.error(f"--xla-max-batch must be >= 0 (0: no XLA), got {args.xla_max_batch}")
    if args.no_repeat_ngram_size < 0:
        parser.error(f"--no-repeat-ngram-size must be >= 0 (0: no ban), got {args.no_repeat_ngram_size}")
    if args.max_request_batch < 0:
        parser.error(f"--max-request-batch must be >= 0 (0: no request batching), got {args.max_request_batch}")
    if args.request_batch_timeout_us < 0:
        parser.error(f"--request-batch-timeout-us must be >= 0, got {args.request_batch_timeout_us}")
    batching = (RequestBatching(max_batch_size=args.max_request_batch, timeout_micros=args.request_batch_timeout_us)
                if args.max_request_batch else None)
    try:
        loops, loops_reason = decode_loops(args.parallel_loops)
    except ValueError:
        parser.error(f"--parallel-loops must be a number >= 1 or auto, got {args.parallel_loops!r}")
    take_renamed_flags(parser, args, "kt-export:")
    config = read_config_or_exit(args.model_dir, "kt-export")
    args.beam_size = recorded_setting(config, "beam_size", args.beam_size, DEFAULT_BEAM_SIZE)
    args.length_penalty = recorded_setting(config, "length_penalty", args.length_penalty, DEFAULT_LENGTH_PENALTY)
    args.extra_output_length = recorded_setting(config, "extra_output_length", args.extra_output_length,
                                                EXTRA_OUTPUT_LENGTH)
    if args.extra_output_length < 0:
        parser.error(f"--extra-output-length must be >= 0, got {args.extra_output_length}")
    t0 = time.time()
    policy, reason = decode_policy(args.precision)
    print(f"kt-export: decoding in {policy or 'the model policy'}: {reason}.", flush=True)
    print(f"kt-export: {loops} decoding loop{'s' if loops > 1 else ''} per batch: {loops_reason}.", flush=True)
    print(f"kt-export: request batching: " + (f"{batching.describe()}, in the graph (no model server flag needed)."
                                              if batching else "off (--max-request-batch 0): each request decodes "
                                              "on its own."), flush=True)
    try:
        path = export(args.model_dir, args.export_dir, name=args.name, version=args.version,
                      model_file=args.model_file, beam_size=args.beam_size, length_penalty=args.length_penalty,
                      use_cache=args.use_cache, check_ops=args.check_ops, precision=args.precision,
                      xla_max_batch=args.xla_max_batch, parallel_loops=loops,
                      no_repeat_ngram_size=args.no_repeat_ngram_size, extra_output_length=args.extra_output_length,
                      request_batching=batching)
    except (FileNotFoundError, FileExistsError) as e:
        print(f"kt-export: error: {e}", file=sys.stderr)
        return 2
    print(f"Exported {path} in {time.time() - t0:.1f}s (beam {args.beam_size}, length penalty {args.length_penalty}, "
          f"output at most source + {args.extra_output_length} pieces, "
          f"{'cached' if args.use_cache else 'uncached'} decoding). Serve it with:\n"
          f"  tensorflow_model_server --rest_api_port=8501 --port=8500 --model_name={args.name} "
          f"--model_base_path={path.parent.resolve()}"
          + (f" --tensorflow_inter_op_parallelism={loops} --tensorflow_intra_op_parallelism=1" if loops > 1 else "")
          + (" --xla_cpu_compilation_enabled" if args.xla_max_batch else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
