"""Small clients for a translator served by TF Serving.

REST needs nothing beyond the standard library; gRPC needs the
`tensorflow-serving-api` package (`pip install tensorflow-serving-api`, or
the project's `serving` extra), imported only when a `GrpcClient` is made.

    from export.client import RestClient, GrpcClient

    rest = RestClient("http://localhost:8501", "translator")
    rest.translate(["A man is riding a bike."])          # ["Ein Mann fährt Fahrrad."]
    rest.translate_with_scores(["A dog runs."])          # (["..."], [-0.53])
    rest.translate_batch(["A dog runs."])                # TranslatedBatch(translations, scores, truncated)
    rest.n_best(["A dog runs."]).translations            # [["...", "...", "...", "..."]]: best first
    rest.sample(["A dog runs."], seed=7, temperature=0.8, top_k=20)   # TranslatedBatch: a sample, the same each time
    rest.translate_with_prefix(["A dog runs."], ["Ein Hund"])          # TranslatedBatch: beginning with "Ein Hund"
    rest.translate_with_prefix(["A dog runs."], ["Ein Hund"], greedy=True)   # the same, greedy decoding
    rest.score(["A dog runs."], ["Ein Hund rennt."])     # ScoredBatch(scores, log_probs, truncated)
    rest.align(["A dog runs."]).alignments               # [[(0, 0), (1, 1), ...]]: (source piece, target piece)
    rest.metadata()                                      # the signatures, as TF Serving reports them

    grpc_client = GrpcClient("localhost:8500", "translator")
    grpc_client.translate(["A man is riding a bike."])  # and every method above but status()

Both send the `text` input of a signature (`serving_default`: beam search,
`greedy`: greedy decoding) and read its `translation`, `score` and
`truncated` outputs (`truncated`: the source was longer than the model's
limit and only its beginning was translated; False from exports older than
that output). `sample`, `translate_with_prefix`, `score` and `align` call the
signatures of those names (`translate_with_prefix(..., greedy=True)`:
`greedy_prefix`), with their other inputs (`seed`, `temperature`,
`top_k`; `prefix`; `target`) beside `text`: over REST in each instance
(`{"text": ..., "seed": 7, ...}`), over gRPC as more named tensors of the
signature's dtypes.
Strings that are not valid UTF-8 are sent base64-encoded over REST
(`{"b64": ...}`, TF Serving's convention for binary strings).

    python -m export.client --rest http://localhost:8501 "A man is riding a bike."
    python -m export.client --grpc localhost:8500 --metadata
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import urllib.error
import urllib.request
from typing import NamedTuple

TEXT_INPUT = "text"
# The dtypes of the inputs beyond `text`, as the signatures declare them (TF Serving refuses other dtypes).
INPUT_DTYPES = {"seed": "int64", "temperature": "float32", "top_k": "int32", "prefix": "string", "target": "string"}


class TranslatedBatch(NamedTuple):
    """A text signature's outputs for a batch, one entry per input text."""

    translations: list[str]
    scores: list[float]
    truncated: list[bool]  # the source was cut to the model's limit before it was translated


class ScoredBatch(NamedTuple):
    """The `score` signature's outputs, one entry per (text, target)."""

    scores: list[float]  # log P(target | text) / ((5 + len) / 6)^alpha, len counting the end token
    log_probs: list[float]  # log P(target | text)
    truncated: list[bool]  # the source or the target was cut to the model's limit before it was scored


class AlignedBatch(NamedTuple):
    """The `align` signature's outputs, one entry per input text, padding dropped."""

    translations: list[str]
    scores: list[float]
    truncated: list[bool]
    alignments: list[list[tuple[int, int]]]  # (source piece index, target piece index): the source piece each
    #                                          target piece attends to most, one pair per target piece
    source_pieces: list[list[str]]  # sentencepiece pieces, the final "</s>" included
    target_pieces: list[list[str]]  # the translation's pieces, its final "</s>" included


class ServingError(RuntimeError):
    """TF Serving answered with an error (its message is kept)."""


def _rest_value(text):
    if isinstance(text, str):
        return text
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(bytes(text)).decode("ascii")}


def output_text(value) -> str:
    """A string output as str: bytes (gRPC, in process) decoded with invalid UTF-8 replaced, REST's
    `{"b64": ...}` decoded, str as it is."""
    if isinstance(value, dict) and "b64" in value:  # a binary string, as TF Serving encodes one
        value = base64.b64decode(value["b64"])
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def translated_batch(outputs) -> TranslatedBatch:
    """A text signature's outputs as a `TranslatedBatch`; with the `n_best` signature's `translations` and
    `scores`, a list of translations and of scores per text. `outputs`: output name -> one value per text (a
    list; strings as bytes, str or REST's `{"b64": ...}`). Without a `truncated` output (exports older than
    it): all False. RestClient, GrpcClient and kt-translate's SavedModelTranslator all read outputs so."""
    many = "translations" in outputs  # n_best: [batch, n]
    translations = [[output_text(t) for t in row] if many else output_text(row)
                    for row in outputs["translations" if many else "translation"]]
    scores = [[float(s) for s in row] if many else float(row) for row in outputs["scores" if many else "score"]]
    truncated = ([bool(t) for t in outputs["truncated"]] if "truncated" in outputs
                 else [False] * len(translations))
    return TranslatedBatch(translations, scores, truncated)


def scored_batch(outputs) -> ScoredBatch:
    """The `score` signature's outputs (as `translated_batch` takes them) as a `ScoredBatch`."""
    return ScoredBatch([float(s) for s in outputs["score"]], [float(s) for s in outputs["log_prob"]],
                       [bool(t) for t in outputs["truncated"]])


def aligned_batch(outputs) -> AlignedBatch:
    """The `align` signature's outputs (as `translated_batch` takes them) as an `AlignedBatch`: the
    alignment as (source piece, target piece) index pairs, without its padding (-1) or the pieces' ("")."""
    translations, scores, truncated = translated_batch(outputs)
    alignments = [[(int(source), target) for target, source in enumerate(row) if source >= 0]
                  for row in outputs["alignment"]]
    return AlignedBatch(translations, scores, truncated, alignments,
                        [_unpadded(row) for row in outputs["source_pieces"]],
                        [_unpadded(row) for row in outputs["target_pieces"]])


def _unpadded(pieces):
    """A row of pieces without its padding: the "" at its end."""
    pieces = [output_text(p) for p in pieces]
    while pieces and pieces[-1] == "":
        pieces.pop()
    return pieces


def _per_text(value, n, name):
    """`value` for each of `n` texts: a list of n values as it is, a scalar repeated."""
    if not isinstance(value, (str, bytes)):
        try:
            values = list(value)
        except TypeError:  # a scalar (a number, or a 0-d array)
            pass
        else:
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} values for {n} texts (give one value, or one per text)")
            return values
    return [value] * n


def _sample_inputs(n, seed, temperature, top_k):
    return {"seed": [int(s) for s in _per_text(seed, n, "seed")],
            "temperature": [float(t) for t in _per_text(temperature, n, "temperature")],
            "top_k": [int(k) for k in _per_text(top_k, n, "top_k")]}


def _one_per_text(values, n, name):
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} texts (give one per text)")
    return values


class SignatureMethods:
    """What RestClient, GrpcClient and kt-translate's SavedModelTranslator share: each signature's call with
    its inputs and outputs. A subclass provides `_outputs(texts, signature, inputs)`: the signature's outputs
    for a non-empty batch of texts, `inputs` its other inputs (name -> one value per text), as
    `translated_batch` takes them. An empty batch is answered without a request."""

    signature = "serving_default"

    def _outputs(self, texts, signature, inputs) -> dict:
        raise NotImplementedError

    def _call(self, texts, signature, inputs=None):
        texts = list(texts)
        return self._outputs(texts, signature or self.signature, inputs or {}) if texts else None

    def translate_batch(self, texts, signature=None, inputs=None) -> TranslatedBatch:
        """One signature's outputs for `texts` (`inputs`: the signature's other inputs, name -> one value per
        text); with the `n_best` signature a list of translations and of scores per text."""
        outputs = self._call(texts, signature, inputs)
        return TranslatedBatch([], [], []) if outputs is None else translated_batch(outputs)

    def n_best(self, texts) -> TranslatedBatch:
        """The `n_best` signature: each text's n different translations and their scores, best first."""
        return self.translate_batch(texts, "n_best")

    def sample(self, texts, seed=0, temperature=1.0, top_k=0) -> TranslatedBatch:
        """The `sample` signature: each text's translation sampled from the model, token by token, from the
        `top_k` most likely tokens (0: all of them) with the probabilities at `temperature` (> 0; TF Serving
        refuses 0 or less: ServingError over REST). The same (text, seed) gives the same sample alone or in
        any batch; `top_k` 1 is greedy decoding. `seed`, `temperature` and `top_k`: one value for every
        text, or a list of one per text."""
        texts = list(texts)
        return self.translate_batch(texts, "sample", _sample_inputs(len(texts), seed, temperature, top_k))

    def translate_with_prefix(self, texts, prefixes, greedy=False) -> TranslatedBatch:
        """The `prefix` signature: each text's beam search translation that begins with its prefix (whole
        sentencepiece pieces of it; "" gives serving_default's translation). `prefixes`: one per text.
        `greedy`: the `greedy_prefix` signature instead, greedy decoding that begins with the prefix ("" gives
        the greedy signature's translation)."""
        texts = list(texts)
        return self.translate_batch(texts, "greedy_prefix" if greedy else "prefix",
                                    {"prefix": _one_per_text(prefixes, len(texts), "prefixes")})

    def score(self, texts, targets) -> ScoredBatch:
        """The `score` signature: how likely the model finds each target as the text's translation, scored
        as serving_default scores its own translations. `targets`: one per text."""
        texts = list(texts)
        outputs = self._call(texts, "score", {"target": _one_per_text(targets, len(texts), "targets")})
        return ScoredBatch([], [], []) if outputs is None else scored_batch(outputs)

    def align(self, texts) -> AlignedBatch:
        """The `align` signature: serving_default's translation of each text, its pieces and those of the
        source, and for each target piece the source piece it attends to most (as (source, target) index
        pairs)."""
        outputs = self._call(texts, "align")
        return AlignedBatch([], [], [], [], [], []) if outputs is None else aligned_batch(outputs)

    def translate_with_scores(self, texts, signature=None):
        return self.translate_batch(texts, signature)[:2]

    def translate(self, texts, signature=None) -> list[str]:
        return self.translate_with_scores(texts, signature)[0]


class RestClient(SignatureMethods):
    """TF Serving's REST API: `POST /v1/models/NAME[/versions/V]:predict` with
    `{"instances": [{"text": ...}, ...]}` (row format; a signature's other inputs beside `text` in each
    instance)."""

    def __init__(self, url="http://localhost:8501", model="translator", *, version=None,
                 signature="serving_default", timeout=60.0):
        self.url = url.rstrip("/")
        self.model, self.version, self.signature, self.timeout = model, version, signature, timeout

    def _model_url(self):
        url = f"{self.url}/v1/models/{self.model}"
        return url if self.version is None else f"{url}/versions/{self.version}"

    def _request(self, url, body=None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            raise ServingError(f"TF Serving returned HTTP {e.code} for {url}: {detail}") from None

    def predict(self, texts, signature=None, inputs=None) -> list[dict]:
        """Row format: one `{"translation": str, "score": float, ...}` per input text. `inputs`: the
        signature's other inputs, name -> one value per text."""
        texts = list(texts)
        if not texts:
            return []
        inputs = inputs or {}
        # Named form ({"text": ...} per instance): unambiguous also for {"b64": ...} values.
        instances = [{TEXT_INPUT: _rest_value(t)} for t in texts]
        for name, values in inputs.items():
            string = INPUT_DTYPES.get(name) == "string"
            for instance, value in zip(instances, _one_per_text(values, len(texts), name)):
                instance[name] = _rest_value(value) if string else value
        body = {"signature_name": signature or self.signature, "instances": instances}
        predictions = self._request(self._model_url() + ":predict", body)["predictions"]
        if len(predictions) != len(texts):
            raise ServingError(f"Sent {len(texts)} texts, got {len(predictions)} predictions")
        return predictions

    def _outputs(self, texts, signature, inputs):
        predictions = self.predict(texts, signature, inputs)
        return {name: [p[name] for p in predictions] for name in predictions[0]}

    def metadata(self) -> dict:
        """`GET /v1/models/NAME[/versions/V]/metadata`: the model spec and its signature_def map."""
        return self._request(self._model_url() + "/metadata")

    def status(self) -> dict:
        """`GET /v1/models/NAME[/versions/V]`: the model's version states (AVAILABLE once loaded)."""
        return self._request(self._model_url())


class GrpcClient(SignatureMethods):
    """TF Serving's gRPC `PredictionService` (port 8500 by default). Needs `tensorflow-serving-api`."""

    def __init__(self, target="localhost:8500", model="translator", *, version=None, signature="serving_default",
                 timeout=60.0):
        try:
            import grpc
            from tensorflow_serving.apis import prediction_service_pb2_grpc
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("GrpcClient needs the tensorflow-serving-api package: "
                              "pip install tensorflow-serving-api (or keras-transformer[serving])") from e
        self.model, self.version, self.signature, self.timeout = model, version, signature, timeout
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)])
        self._stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)

    def _model_spec(self, spec, signature=None):
        spec.name = self.model
        if self.version is not None:
            spec.version.value = int(self.version)
        if signature is not False:
            spec.signature_name = signature or self.signature

    def predict(self, texts, signature=None, inputs=None):
        """Returns the raw `PredictResponse`. `inputs`: the signature's other inputs, name -> one value per
        text, sent as tensors of the signature's dtypes (`INPUT_DTYPES`)."""
        from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorflow_serving.apis import predict_pb2

        texts = list(texts)
        request = predict_pb2.PredictRequest()
        self._model_spec(request.model_spec, signature)
        shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(texts))])
        tensors = {TEXT_INPUT: ("string", texts)}
        tensors.update({name: (INPUT_DTYPES[name], _one_per_text(values, len(texts), name))
                        for name, values in (inputs or {}).items()})
        for name, (dtype, values) in tensors.items():
            if dtype == "string":
                tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=shape, string_val=[
                    v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values])
            elif dtype == "int64":
                tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_INT64, tensor_shape=shape, int64_val=values)
            elif dtype == "int32":
                tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, tensor_shape=shape, int_val=values)
            else:
                tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=shape, float_val=values)
            request.inputs[name].CopyFrom(tensor)
        return self._stub.Predict(request, timeout=self.timeout)

    def _outputs(self, texts, signature, inputs):
        from tensorflow import make_ndarray  # float outputs may come as float_val or packed tensor_content

        response = self.predict(texts, signature, inputs)
        outputs = {name: make_ndarray(tensor).tolist() for name, tensor in response.outputs.items()}
        for name, values in outputs.items():
            if len(values) != len(texts):
                raise ServingError(f"Sent {len(texts)} texts, got {len(values)} values of {name!r}")
        return outputs

    def metadata(self):
        """`GetModelMetadata` with `signature_def`: returns the `SignatureDefMap` proto."""
        from tensorflow_serving.apis import get_model_metadata_pb2

        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        self._model_spec(request.model_spec, signature=False)
        response = self._stub.GetModelMetadata(request, timeout=self.timeout)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        response.metadata["signature_def"].Unpack(signatures)
        return signatures

    def close(self):
        self._channel.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rest", help="REST address, e.g. http://localhost:8501")
    where.add_argument("--grpc", help="gRPC address, e.g. localhost:8500")
    p.add_argument("--model-name", default="translator")
    p.add_argument("--signature", default="serving_default", help="serving_default (beam) or greedy")
    p.add_argument("--metadata", action="store_true", help="print the model's signatures instead")
    p.add_argument("texts", nargs="*", help="sentences to translate (default: lines of stdin)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    client = (RestClient(args.rest, args.model_name, signature=args.signature) if args.rest
              else GrpcClient(args.grpc, args.model_name, signature=args.signature))
    if args.metadata:
        print(json.dumps(client.metadata(), indent=2) if args.rest else client.metadata())
        return 0
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
    for translation, score in zip(*client.translate_with_scores(texts)):
        print(f"{score:.4f}\t{translation}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
